"""A restart ends SGLang's whole tree on this node: process_tree.serving_top on real process trees.

tests/process_shapes.py builds trees shaped like SGLang's (spawned children,
a launcher whose SIGQUIT handler kills its tree, a DataParallelController
without one) in their own process group; each test kills that group at the end.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from sglang_watchdog_plugin import process_tree

_SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "process_shapes.py")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
        return "Z" not in state.split()[1]
    except (OSError, StopIteration):
        return False


@unittest.skipUnless(os.path.isdir("/proc/self"), "needs /proc")
class Shapes(unittest.TestCase):
    def run_shape(self, shape):
        outdir = tempfile.mkdtemp(prefix="sglang-watchdog-tree-")
        self.addCleanup(shutil.rmtree, outdir, True)
        proc = subprocess.Popen([sys.executable, _SHAPES, shape, outdir])
        self.addCleanup(self._kill_group, proc)
        deadline = time.monotonic() + 20
        while not os.path.exists(os.path.join(outdir, "target.json")):
            self.assertLess(time.monotonic(), deadline, "the scheduler never reported its target")
            time.sleep(0.05)
        def read(name):
            with open(os.path.join(outdir, name)) as f:
                return json.load(f)

        pids = {name: read(f"{name}.json") for name in ("launcher", "controller", "scheduler")
                if os.path.exists(os.path.join(outdir, f"{name}.json"))}
        return proc, pids, read("target.json")

    def _kill_group(self, proc):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait(5)

    def assert_all_end(self, proc, pids):
        self.assertEqual(proc.wait(10), -signal.SIGKILL, "the launcher did not end through its SIGQUIT handler")
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual([name for name, pid in pids.items() if _alive(pid)], [])

    def test_dp1_signals_the_launcher_the_scheduler_parent(self):
        proc, pids, target = self.run_shape("dp1")
        self.assertEqual((target["pid"], target["signal"]), (pids["launcher"], "SIGQUIT"))
        self.assertEqual(target["chain"], [pids["scheduler"], pids["launcher"]])
        self.assert_all_end(proc, pids)

    def test_dp2_signals_the_launcher_above_the_data_parallel_controller(self):
        proc, pids, target = self.run_shape("dp2")
        self.assertEqual((target["pid"], target["signal"]), (pids["launcher"], "SIGQUIT"))
        self.assertEqual(target["chain"], [pids["scheduler"], pids["controller"], pids["launcher"]])
        self.assert_all_end(proc, pids)

    def test_dp2_signalling_the_parent_leaves_the_front_end_up(self):
        """What the plugin did before: SIGQUIT to the controller kills it alone (no handler)."""
        proc, pids, _ = self.run_shape("dp2-parent")
        deadline = time.monotonic() + 10
        while _alive(pids["controller"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(_alive(pids["controller"]))
        time.sleep(0.5)
        self.assertTrue(_alive(pids["launcher"]), "the front end would have gone too: the old way was enough")

    def test_a_launcher_without_a_sigquit_handler_is_refused_with_the_reason(self):
        proc, pids, target = self.run_shape("nohandler")
        self.assertNotIn("pid", target)
        self.assertIn("does not handle SIGQUIT", target["reason"])
        self.assertEqual(target["chain"][-1], pids["launcher"])
        self.assertTrue(_alive(pids["launcher"]) and _alive(pids["scheduler"]))


class Unreadable(unittest.TestCase):
    def test_no_proc_means_no_target(self):
        target = process_tree.serving_top(proc=tempfile.mkdtemp())
        self.assertFalse(target.ok)
        self.assertIn("not visible", target.reason)
