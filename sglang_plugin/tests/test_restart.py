"""POST /admin/restart: opt-in, token, pid, dry run, and the way the process ends."""

import os
import shutil
import signal
import tempfile
import threading
import time
import unittest

from sglang_watchdog_plugin import process_tree

from . import harness, standins

TOKEN = "r3start-t0ken"


class Serving(unittest.TestCase):
    def serve(self, token=TOKEN, allow="1", **extra_env):
        env = harness.plugin_env(SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART=allow, **extra_env)
        if token is not None:
            fd, path = tempfile.mkstemp()
            os.write(fd, f"{token}\n".encode())
            os.close(fd)
            self.addCleanup(os.unlink, path)
            env["SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE"] = path
        scheduler = standins.NewScheduler()
        scheduler.disagg_prefill_inflight_queue = [
            standins.Req("r1", 5, standins.NixlKVSender(standins.NewestNixlKVManager(), 5))]
        loop, monitor = harness.start_loop(scheduler, env)
        self.addCleanup(loop.stop)
        self.addCleanup(monitor.close)
        self.ended = threading.Event()
        self.calls = []
        monitor.kill = lambda pid, sig: self.calls.append(("kill", pid, sig))
        monitor.exit = lambda status: (self.calls.append(("exit", status)), self.ended.set())
        monitor.parent_pid = 424242
        # SGLang's launcher, as process_tree would find it (tests/test_process_tree.py walks real trees).
        monitor.find_restart_target = lambda: process_tree.Target(
            424242, signal.SIGQUIT, "python3 -m sglang.launch_server", [os.getpid(), 424242])
        return monitor, harness.Client(monitor.listener.port)

    def restart(self, client, payload, token=TOKEN, raw=None):
        return client.post_json("/admin/restart", payload, token=token, raw=raw)


class RestartTest(Serving):
    def test_restart_signals_the_parent_and_exits_1_after_answering(self):
        _, client = self.serve()
        status, body = self.restart(client, {"pid": os.getpid(), "reason": "transfer queue 2 wedged"})
        self.assertEqual((status, body["result"], body["pid"]), (202, "restarting", os.getpid()))
        self.assertEqual(body["signal_target"]["pid"], 424242)
        self.assertEqual(body["signal_target"]["signal"], "SIGQUIT")
        self.assertTrue(self.ended.wait(5))
        self.assertEqual(self.calls, [("kill", 424242, signal.SIGQUIT), ("exit", 1)])

    def test_without_a_launcher_to_signal_the_restart_is_refused(self):
        monitor, client = self.serve()
        monitor.find_restart_target = lambda: process_tree.Target(
            None, None, "bash", [os.getpid(), 77], "the top of this process tree (pid 77: bash) does not handle SIGQUIT")
        for dry_run in (True, False):
            status, body = self.restart(client, {"pid": os.getpid(), "dry_run": dry_run})
            self.assertEqual((status, body["result"]), (501, "restart_unsupported"), body)
            self.assertIn("does not handle SIGQUIT", body["error"])
        time.sleep(0.2)
        self.assertEqual(self.calls, [])

    def test_a_reparented_process_signals_nobody(self):
        monitor, client = self.serve()
        monitor.parent_pid = 4242  # the parent at load is gone: the walk starts from another one
        status, body = self.restart(client, {"pid": os.getpid()})
        self.assertEqual((status, body["result"]), (501, "restart_unsupported"), body)
        self.assertIn("parent changed", body["error"])
        time.sleep(0.2)
        self.assertEqual(self.calls, [])

    def test_dry_run_and_refusals_change_nothing(self):
        _, client = self.serve()
        me = os.getpid()
        cases = [
            ({"pid": me, "dry_run": True}, TOKEN, 200, "would_restart"),
            ({"pid": me + 1}, TOKEN, 409, "pid_mismatch"),
            ({"pid": me}, None, 401, "unauthorized"),
            ({"pid": me}, "wrong", 401, "unauthorized"),
            ({}, TOKEN, 400, "bad_request"),
            ({"pid": 0}, TOKEN, 400, "bad_request"),
            ({"pid": str(me)}, TOKEN, 400, "bad_request"),
            ({"pid": True}, TOKEN, 400, "bad_request"),
            ({"pid": me, "dry_run": "yes"}, TOKEN, 400, "bad_request"),
        ]
        for payload, token, status, result in cases:
            got_status, body = self.restart(client, payload, token=token)
            self.assertEqual((got_status, body["result"], body["pid"]), (status, result, me), payload)
            self.assertEqual("error" in body, status >= 400)
        self.assertEqual(self.restart(client, None, raw=b"[" * 60000)[1]["result"], "bad_request")
        body = self.restart(client, {"pid": me + 1})[1]
        self.assertEqual(body["pid"], me)
        self.assertFalse(self.ended.wait(0.2))
        self.assertEqual(self.calls, [])

    def test_without_a_token_restart_is_always_refused(self):
        _, client = self.serve(token=None)
        status, body = self.restart(client, {"pid": os.getpid()}, token=None)
        self.assertEqual((status, body["result"]), (401, "unauthorized"))
        self.assertFalse(self.ended.wait(0.2))

    def test_restart_needs_the_operator_opt_in(self):
        for allow in ("", "0", "true"):
            _, client = self.serve(allow=allow)
            for payload in ({"pid": os.getpid()}, {"pid": os.getpid(), "dry_run": True}):
                status, body = self.restart(client, payload)
                self.assertEqual((status, body["result"], body["pid"]), (403, "restart_disabled", os.getpid()), allow)
        self.assertEqual(self.calls, [])

    def test_get_is_not_allowed(self):
        _, client = self.serve()
        self.assertEqual(client.request("GET", "/admin/restart")[0], 405)


class RestartFloorTest(Serving):
    """The plugin's own minimum interval, kept in SGLANG_WATCHDOG_PLUGIN_STATE_DIR across the restart it causes."""

    def serve_with_state(self, interval="60"):
        state = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, state)
        self.stamp = os.path.join(state, "last-restart")
        return self.serve(SGLANG_WATCHDOG_PLUGIN_STATE_DIR=state, SGLANG_WATCHDOG_PLUGIN_RESTART_MIN_INTERVAL=interval)

    def test_a_restart_is_recorded_and_the_next_process_refuses_within_the_interval(self):
        _, client = self.serve_with_state()
        before = time.time()
        self.assertEqual(self.restart(client, {"pid": os.getpid()})[0], 202)
        self.assertTrue(self.ended.wait(5))
        with open(self.stamp) as f:
            self.assertGreaterEqual(float(f.read()), before)
        # The successor: a new listener on the same state directory (the
        # orchestrator restarted the container; the emptyDir stayed).
        self.ended.clear()
        self.calls.clear()
        state = os.path.dirname(self.stamp)
        _, client = self.serve(SGLANG_WATCHDOG_PLUGIN_STATE_DIR=state, SGLANG_WATCHDOG_PLUGIN_RESTART_MIN_INTERVAL="60")
        with self.assertLogs("sglang_watchdog_plugin", "WARNING"):
            for payload in ({"pid": os.getpid()}, {"pid": os.getpid(), "dry_run": True}):
                status, body = self.restart(client, payload)
                self.assertEqual((status, body["result"], body["pid"]), (429, "too_soon", os.getpid()), payload)
                self.assertTrue(0 < body["retry_after_s"] <= 61, body)
        self.assertFalse(self.ended.wait(0.2))
        self.assertEqual(self.calls, [])

    def test_after_the_interval_restarts_are_allowed_again(self):
        _, client = self.serve_with_state(interval="60")
        with open(self.stamp, "w") as f:
            f.write(f"{time.time() - 61}\n")
        self.assertEqual(self.restart(client, {"pid": os.getpid(), "dry_run": True})[1]["result"], "would_restart")
        self.assertEqual(self.restart(client, {"pid": os.getpid()})[0], 202)
        self.assertTrue(self.ended.wait(5))

    def test_a_garbled_stamp_counts_from_when_it_was_written(self):
        _, client = self.serve_with_state(interval="60")
        for content in ("garbage\n", "nan\n", "inf\n"):
            with open(self.stamp, "w") as f:
                f.write(content)
            self.assertEqual(self.restart(client, {"pid": os.getpid()})[0], 429, content)
            os.utime(self.stamp, (time.time() - 61, time.time() - 61))
            self.assertEqual(self.restart(client, {"pid": os.getpid(), "dry_run": True})[0], 200, content)

    def test_two_ranks_asked_at_once_restart_once(self):
        # Every rank of a server shares the stamp; the check and the record
        # happen under one lock, so only one of two concurrent calls wins.
        _, first = self.serve_with_state()
        _, second = self.serve(SGLANG_WATCHDOG_PLUGIN_STATE_DIR=os.path.dirname(self.stamp),
                               SGLANG_WATCHDOG_PLUGIN_RESTART_MIN_INTERVAL="60")
        statuses = []
        threads = [threading.Thread(target=lambda c=c: statuses.append(self.restart(c, {"pid": os.getpid()})[0]))
                   for c in (first, second)]
        with self.assertLogs("sglang_watchdog_plugin", "WARNING"):
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
        self.assertEqual(sorted(statuses), [202, 429])

    def test_an_unwritable_state_dir_refuses_the_restart(self):
        _, client = self.serve(SGLANG_WATCHDOG_PLUGIN_STATE_DIR="/nonexistent/state")
        with self.assertLogs("sglang_watchdog_plugin", "ERROR"):
            status, body = self.restart(client, {"pid": os.getpid()})
        self.assertEqual((status, body["result"]), (500, "internal_error"))
        self.assertFalse(self.ended.wait(0.2))

    def test_without_a_state_dir_the_start_warns(self):
        with self.assertLogs("sglang_watchdog_plugin", "WARNING") as logs:
            self.serve()
        self.assertTrue(any("SGLANG_WATCHDOG_PLUGIN_STATE_DIR" in line for line in logs.output), logs.output)


if __name__ == "__main__":
    unittest.main()
