"""Ships sglang_watchdog_plugin.pth at the root of site-packages.

Python only reads .pth files from a site directory, and setuptools has no
declarative way to put a file there: ``data_files`` lands under
``sys.prefix``. Copying the file into the root of ``build_lib`` makes it part
of the wheel's purelib, which pip installs into site-packages.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_FILE = "sglang_watchdog_plugin.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH_FILE, os.path.join(self.build_lib, PTH_FILE), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH_FILE)]


setup(cmdclass={"build_py": BuildPyWithPth})
