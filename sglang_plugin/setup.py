"""Ships sglang_watchdog_plugin.pth at the root of site-packages, and of the conformance harness only the user check.

Python only reads .pth files from a site directory, and setuptools has no
declarative way to put a file there: ``data_files`` lands under
``sys.prefix``. Copying the file into the root of ``build_lib`` makes it part
of the wheel's purelib, which pip installs into site-packages.

``sglang_watchdog_plugin.conformance`` is the conformance suite's harness
(scripts/conformance.sh, the e2e tests and the cost measurements run it from
the source tree) and the user check (``python3 -m
sglang_watchdog_plugin.conformance.check``, docs/plugin.md), which is all a
user needs of it: the wheel carries the check and the modules it imports.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_FILE = "sglang_watchdog_plugin.pth"
HARNESS = "sglang_watchdog_plugin.conformance"
# check.py and what it imports: the bench it plays each backend on, with its
# scheduler, SGLang's loader and runtime, and the fake transports.
CHECK_MODULES = {"__init__", "check", "bench", "scheduler", "runtime", "loader", "transports"}


class BuildPlugin(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH_FILE, os.path.join(self.build_lib, PTH_FILE), preserve_mode=False)

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package != HARNESS:
            return modules
        return [(pkg, module, path) for pkg, module, path in modules if module in CHECK_MODULES]

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH_FILE)]


setup(cmdclass={"build_py": BuildPlugin})
