"""The .pth loader, run in fresh interpreters against a fake sglang package."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

PLUGIN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PREFILL = """
class SchedulerDisaggregationPrefillMixin:
    def process_disagg_prefill_inflight_queue(self, rids_to_check=None):
        return ["original", rids_to_check]
"""

DECODE = """
class SchedulerDisaggregationDecodeMixin:
    def process_decode_queue(self):
        return "decode pass"
"""

PP = """
class SchedulerPPMixin:
    def process_prealloc_queue(self, prealloc_rids):
        return ["prealloc", prealloc_rids]

    def process_decode_transfer_queue(self, release_rids):
        return ["transfer", release_rids]
"""

# Loads the site directory the way site.py loads site-packages at start-up,
# so the real .pth line runs; then reports what the process looks like.
PROBE = """
import json, site, sys
site.addsitedir(sys.argv[1])
report = {"loaded_before": sorted(m for m in sys.modules if m.startswith(("sglang", "http", "logging")))}
if sys.argv[2] == "import":
    from sglang.srt.disaggregation import prefill
    method = prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue
    report["hooked"] = getattr(method, "__sglang_watchdog_hook__", False)
    report["result"] = method(object(), ["r1"])
    from sglang.srt.disaggregation import decode
    report["decode_hooked"] = getattr(decode.SchedulerDisaggregationDecodeMixin.process_decode_queue,
                                      "__sglang_watchdog_hook__", False)
    report["decode_result"] = decode.SchedulerDisaggregationDecodeMixin().process_decode_queue()
    from sglang.srt.managers import scheduler_pp_mixin
    pp = scheduler_pp_mixin.SchedulerPPMixin
    report["pp_hooked"] = [name for name in ("process_prealloc_queue", "process_decode_transfer_queue")
                           if getattr(getattr(pp, name, None), "__sglang_watchdog_hook__", False)]
    report["pp_results"] = [getattr(pp(), name)(["r"]) for name in report["pp_hooked"]]
print(json.dumps(report))
"""


class AutoloadTest(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root)
        self.site = os.path.join(self.root, "site")
        os.makedirs(self.site)
        shutil.copy(os.path.join(PLUGIN_ROOT, "sglang_watchdog_plugin.pth"), self.site)
        self.write("sglang/__init__.py", "__version__ = '0.0.test'\n")
        self.write("sglang/srt/__init__.py", "")
        self.write("sglang/srt/disaggregation/__init__.py", "")
        self.write("sglang/srt/disaggregation/prefill.py", PREFILL)
        self.write("sglang/srt/disaggregation/decode.py", DECODE)
        self.write("sglang/srt/managers/__init__.py", "")
        self.write("sglang/srt/managers/scheduler_pp_mixin.py", PP)

    def write(self, relative, text):
        path = os.path.join(self.root, "pkgs", relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text))

    def probe(self, mode, **extra_env):
        env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
        env.update(PYTHONPATH=os.pathsep.join([PLUGIN_ROOT, os.path.join(self.root, "pkgs")]), **extra_env)
        done = subprocess.run([sys.executable, "-c", PROBE, self.site, mode], env=env, capture_output=True,
                              timeout=60, check=True)
        return json.loads(done.stdout), done.stderr.decode()

    def test_inert_in_processes_without_sglang(self):
        report, stderr = self.probe("nothing")
        # Only the tiny loader: no SGLang, no listener, no logging machinery.
        self.assertEqual(report["loaded_before"], ["sglang_watchdog_plugin", "sglang_watchdog_plugin.autoload"])
        self.assertEqual(stderr, "")

    def test_hooks_the_mixin_when_sglang_imports_it(self):
        report, stderr = self.probe("import")
        self.assertTrue(report["hooked"], stderr)
        self.assertEqual(report["result"], ["original", ["r1"]])  # not a prefill scheduler: passes through
        self.assertTrue(report["decode_hooked"], stderr)
        self.assertEqual(report["decode_result"], "decode pass")  # not a decode scheduler: passes through
        self.assertEqual(report["pp_hooked"], ["process_prealloc_queue", "process_decode_transfer_queue"])
        self.assertEqual(report["pp_results"], [["prealloc", ["r"]], ["transfer", ["r"]]])

    def test_a_pp_mixin_without_pp_decode_is_left_alone(self):
        self.write("sglang/srt/managers/scheduler_pp_mixin.py",
                   "class SchedulerPPMixin:\n    def event_loop_pp_disagg_prefill(self):\n        pass\n")
        report, stderr = self.probe("import")
        self.assertEqual(report["pp_hooked"], [])
        self.assertNotIn("could not hook", stderr)

    def install_entry_point(self):
        self.write("sglang/srt/plugins/__init__.py", "")
        self.write("sglang_watchdog_plugin-0.1.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: sglang-watchdog-plugin\nVersion: 0.1.0\n")
        self.write("sglang_watchdog_plugin-0.1.0.dist-info/entry_points.txt",
                   "[sglang.srt.plugins]\nsglang_watchdog = sglang_watchdog_plugin:register\n")

    def test_defers_to_the_plugin_framework(self):
        self.install_entry_point()
        for whitelist in (None, "other_plugin, sglang_watchdog"):
            extra = {} if whitelist is None else {"SGLANG_PLUGINS": whitelist}
            report, stderr = self.probe("import", **extra)
            self.assertFalse(report["hooked"], whitelist)
            self.assertFalse(report["decode_hooked"], whitelist)
            self.assertNotIn("does not name sglang_watchdog", stderr)

    def test_a_whitelist_without_us_is_honoured_and_said(self):
        # The framework skips us; hooking here would override the operator's whitelist, and
        # saying nothing would leave the sidecar facing a plugin that never listens.
        self.install_entry_point()
        report, stderr = self.probe("import", SGLANG_PLUGINS="other_plugin")
        self.assertFalse(report["hooked"])
        self.assertFalse(report["decode_hooked"])
        self.assertIn("SGLANG_PLUGINS=other_plugin does not name sglang_watchdog", stderr)

    def test_a_changed_sglang_is_not_broken(self):
        self.write("sglang/srt/disaggregation/prefill.py", "VALUE = 1\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([PLUGIN_ROOT, os.path.join(self.root, "pkgs")]))
        done = subprocess.run(
            [sys.executable, "-c",
             "import site, sys; site.addsitedir(sys.argv[1]); "
             "from sglang.srt.disaggregation import prefill; print(prefill.VALUE)", self.site],
            env=env, capture_output=True, timeout=60, check=True)
        self.assertEqual(done.stdout, b"1\n")
        self.assertIn(b"could not hook sglang.srt.disaggregation.prefill", done.stderr)


if __name__ == "__main__":
    unittest.main()
