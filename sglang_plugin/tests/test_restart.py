"""POST /admin/restart: opt-in, token, pid, dry run, and the way the process ends."""

import os
import signal
import tempfile
import threading
import unittest

from . import harness, standins

TOKEN = "r3start-t0ken"


class RestartTest(unittest.TestCase):
    def serve(self, token=TOKEN, allow="1"):
        env = harness.plugin_env(SGLANG_WATCHDOG_PLUGIN_ALLOW_RESTART=allow)
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
        return monitor, harness.Client(monitor.listener.port)

    def restart(self, client, payload, token=TOKEN, raw=None):
        return client.post_json("/admin/restart", payload, token=token, raw=raw)

    def test_restart_signals_the_parent_and_exits_1_after_answering(self):
        _, client = self.serve()
        status, body = self.restart(client, {"pid": os.getpid(), "reason": "transfer queue 2 wedged"})
        self.assertEqual((status, body), (202, {"result": "restarting", "pid": os.getpid()}))
        self.assertTrue(self.ended.wait(5))
        self.assertEqual(self.calls, [("kill", 424242, signal.SIGQUIT), ("exit", 1)])

    def test_init_is_never_signalled(self):
        monitor, client = self.serve()
        monitor.parent_pid = 1
        self.assertEqual(self.restart(client, {"pid": os.getpid()})[0], 202)
        self.assertTrue(self.ended.wait(5))
        self.assertEqual(self.calls, [("exit", 1)])

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


if __name__ == "__main__":
    unittest.main()
