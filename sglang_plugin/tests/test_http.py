import hmac
import json
import os
import select
import socket
import tempfile
import time
import unittest
from unittest import mock

from sglang_watchdog_plugin import server
from sglang_watchdog_plugin.config import Config, admin_allowed

from . import harness, standins

ROOM = 6619432765110349211


class HttpTest(unittest.TestCase):
    token = None

    def setUp(self):
        env = harness.plugin_env()
        if self.token is not None:
            fd, path = tempfile.mkstemp()
            os.write(fd, f"  {self.token}\n".encode())
            os.close(fd)
            self.addCleanup(os.unlink, path)
            env["SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE"] = path
            self.token_path = path
        self.mgr = standins.KVManager()
        self.sender = standins.NixlKVSender(self.mgr, ROOM)
        self.scheduler = standins.NewScheduler()
        self.scheduler.disagg_prefill_inflight_queue = [standins.Req("r1", ROOM, self.sender)]
        self.loop, self.monitor = harness.start_loop(self.scheduler, env)
        self.addCleanup(self.loop.stop)
        self.addCleanup(self.monitor.close)
        self.client = harness.Client(self.monitor.listener.port)


class OpenListenerTest(HttpTest):
    def test_healthz(self):
        self.assertEqual(self.client.request("GET", "/healthz"), (200, "text/plain; charset=utf-8", b"ok"))

    def test_listing_is_json(self):
        status, content_type, _ = self.client.request("GET", "/debug/inflight?verbose=1")
        self.assertEqual((status, content_type), (200, "application/json"))

    def test_unknown_paths_and_methods(self):
        for method, path in (("GET", "/nope"), ("POST", "/admin/other"), ("POST", "/debug/inflight")):
            status, content_type, _ = self.client.request(method, path, body=b"{}")
            self.assertEqual((status, content_type), (404, "application/json"), (method, path))
        self.assertEqual(self.client.request("GET", "/admin/force_fail")[0], 405)

    def test_bad_requests(self):
        cases = [
            b"not json",
            b"",
            b"[1, 2]",
            b'"rid"',
            b"{}",
            b'{"rid": ""}',
            b'{"rid": 7}',
            b'{"rid": null}',
            b'{"rid": "r1", "bootstrap_room": -1}',
            b'{"rid": "r1", "bootstrap_room": 18446744073709551616}',
            b'{"rid": "r1", "bootstrap_room": 1.0}',
            b'{"rid": "r1", "bootstrap_room": "6619432765110349211"}',
            b'{"rid": "r1", "bootstrap_room": true}',
            b'{"rid": "r1", "bootstrap_room": null}',
            b'{"rid": "r1", "dry_run": "yes"}',
            b'{"rid": "r1", "dry_run": 0}',
            b'{"rid": "r1", "bootstrap_room": ' + b"9" * 5000 + b"}",
            b"\xff\xfe{",
        ]
        for raw in cases:
            status, body = self.client.force_fail(None, raw=raw)
            self.assertEqual((status, body["result"]), (400, "bad_request"), raw[:60])
            self.assertIsInstance(body["error"], str)
        self.assertEqual(self.sender.write_threads, [])

    def test_body_limit(self):
        padding = " " * (server.MAX_BODY_BYTES - 40)
        fits = ('{"rid": "r1", "dry_run": true}' + padding).encode()
        self.assertLessEqual(len(fits), server.MAX_BODY_BYTES)
        self.assertEqual(self.client.force_fail(None, raw=fits)[1]["result"], "would_flip")

        too_big = ('{"rid": "r1", "dry_run": true}' + padding + " " * 100).encode()
        self.assertGreater(len(too_big), server.MAX_BODY_BYTES)
        self.assertEqual(self.client.force_fail(None, raw=too_big), (400, {
            "result": "bad_request", "error": f"body larger than {server.MAX_BODY_BYTES} bytes"}))

    def test_missing_content_length(self):
        with socket.create_connection(("127.0.0.1", self.monitor.listener.port), timeout=10) as conn:
            conn.sendall(b"POST /admin/force_fail HTTP/1.0\r\nHost: x\r\n\r\n")
            answer = conn.makefile("rb").read()
        self.assertTrue(answer.startswith(b"HTTP/1.0 400"), answer[:40])

    def test_open_on_loopback_without_token(self):
        status, body = self.client.force_fail({"rid": "r1", "bootstrap_room": ROOM, "dry_run": True})
        self.assertEqual((status, body["result"]), (200, "would_flip"))


class HardeningTest(HttpTest):
    def test_deeply_nested_json_is_a_bad_request(self):
        # 12.12: a RecursionError in the parser used to drop the connection.
        for raw in (b"[" * 65000, b'{"rid": ' + b"[" * 60000 + b"]" * 60000 + b"}"):
            status, body = self.client.force_fail(None, raw=raw)
            self.assertEqual((status, body["result"]), (400, "bad_request"))
        self.assertEqual(self.client.request("GET", "/healthz")[0], 200)
        self.assertEqual(self.sender.write_threads, [])

    def test_a_failing_handler_answers_500_and_the_listener_lives_on(self):
        with mock.patch.object(self.monitor, "listing", side_effect=RuntimeError("boom")), \
                self.assertLogs("sglang_watchdog_plugin", "ERROR"):
            status, content_type, body = self.client.request("GET", "/debug/inflight")
        self.assertEqual((status, content_type, json.loads(body)["result"]), (500, "application/json", "internal_error"))
        with mock.patch.object(self.monitor, "force_fail", side_effect=RuntimeError("boom")), \
                self.assertLogs("sglang_watchdog_plugin", "ERROR"):
            status, body = self.client.force_fail({"rid": "r1"})
        self.assertEqual((status, body["result"]), (500, "internal_error"))
        self.assertEqual(self.client.get_json()[0], 200)


class TokenFileTest(unittest.TestCase):
    def token_file(self, content):
        fd, path = tempfile.mkstemp()
        os.write(fd, content)
        os.close(fd)
        self.addCleanup(os.unlink, path)
        return path

    def test_tokens_with_whitespace_or_control_characters_inside_are_refused(self):
        # 12.13: "SeCrEt\nTok-987" used to be accepted as one token.
        for content in (b"SeCrEt\nTok-987\n", b"SeCrEt Tok-987", b"SeCrEt\tTok", b"SeCrEt\rTok\n", b"a\x00b",
                        b"a\x7fb", b"Bearer SeCrEt"):
            with mock.patch.dict(os.environ, {"SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE": self.token_file(content)}), \
                    self.assertLogs("sglang_watchdog_plugin", "ERROR") as logs:
                config = Config.from_env()
                token, unusable = config.token()
            self.assertEqual((token, unusable, admin_allowed(config.host, token, unusable)), (None, True, False), content)
            self.assertIn("whitespace or a control character", logs.output[0])

    def test_surrounding_whitespace_and_the_trailing_newline_are_stripped(self):
        for content in (b"SeCrEt-Tok-987\n", b"  SeCrEt-Tok-987\r\n", b"SeCrEt-Tok-987"):
            with mock.patch.dict(os.environ, {"SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE": self.token_file(content)}):
                config = Config.from_env()
            self.assertEqual(config.token(), (b"SeCrEt-Tok-987", False))


class TokenTest(HttpTest):
    token = "s3cr3t-t0ken"

    def test_token_required_on_admin_only(self):
        for token in (None, "wrong", "s3cr3t-t0ke", self.token + "x", ""):
            status, body = self.client.force_fail({"rid": "r1", "dry_run": True}, token=token)
            self.assertEqual((status, body["result"]), (401, "unauthorized"), token)
            self.assertIsInstance(body["error"], str)
        status, body = self.client.force_fail({"rid": "r1", "dry_run": True}, token=self.token)
        self.assertEqual((status, body["result"]), (200, "would_flip"))
        self.assertEqual(self.client.request("GET", "/debug/inflight")[0], 200)
        self.assertEqual(self.client.request("GET", "/healthz")[0], 200)

    def test_token_guards_wedge_orders(self):
        body = {"transfer_queue": 0, "chunk": 1, "ttl_seconds": 5}
        status, answer = self.client.post_json("/admin/wedge_order", body, token="wrong")
        self.assertEqual((status, answer["result"], answer["failed"]), (401, "unauthorized", []))
        status, answer = self.client.post_json("/admin/wedge_order", body, token=self.token)
        self.assertEqual((status, answer["result"]), (501, "unsupported"), answer)  # list queues: no workers

    def test_auth_is_decided_before_the_body(self):
        status, body = self.client.force_fail(None, raw=b"not json")
        self.assertEqual((status, body["result"]), (401, "unauthorized"))

    def test_wrong_scheme_is_refused(self):
        status, _, _ = self.client.request("POST", "/admin/force_fail", body=b'{"rid": "r1"}',
                                           headers={"Authorization": f"Basic {self.token}"})
        self.assertEqual(status, 401)

    def test_comparison_is_constant_time(self):
        with mock.patch.object(server.hmac, "compare_digest", wraps=hmac.compare_digest) as compare:
            self.client.force_fail({"rid": "r1", "dry_run": True}, token="guess")
        compare.assert_called_once_with(b"guess", self.token.encode())


class ListenerLimitsTest(HttpTest):
    def connect(self):
        return socket.create_connection(("127.0.0.1", self.monitor.listener.port), timeout=5)

    def healthz_ok(self):
        try:
            return self.client.request("GET", "/healthz")[0] == 200
        except OSError:
            return False

    def test_connections_beyond_the_limit_are_refused_at_once(self):
        # Idle connections each hold a listener thread until their deadline.
        held = [self.connect() for _ in range(server.MAX_CONNECTIONS)]
        try:
            with self.connect() as extra:
                extra.settimeout(3)
                started = time.monotonic()
                try:
                    answer = extra.makefile("rb").read()  # up to the server's close
                except TimeoutError:
                    self.fail("a connection beyond the limit was kept waiting")
                self.assertLess(time.monotonic() - started, 2)
            head, _, body = answer.partition(b"\r\n\r\n")
            self.assertTrue(head.startswith(b"HTTP/1.0 503 "), head)
            self.assertIn(b"Content-Type: application/json", head)
            payload = json.loads(body)
            self.assertEqual(payload["result"], "busy")
            self.assertIsInstance(payload["error"], str)
        finally:
            for conn in held:
                conn.close()
        # The slots come back once those connections end.
        harness.wait_until(self.healthz_ok, message="the listener did not take connections again")
        for _ in range(server.MAX_CONNECTIONS + 4):
            self.assertTrue(self.healthz_ok())

    def trickle_until_closed(self, head, limit_s=5.0):
        """Sends `head`, then one more byte every 0.2 s; returns the seconds until the server closed."""
        with self.connect() as conn:
            started = time.monotonic()
            conn.sendall(head)
            while time.monotonic() - started < limit_s:
                readable, _, _ = select.select([conn], [], [], 0.2)
                try:
                    if readable and conn.recv(4096) == b"":
                        return time.monotonic() - started
                    conn.sendall(b"a")
                except OSError:  # reset or broken pipe: closed as well
                    return time.monotonic() - started
        self.fail(f"the server still read the trickled request after {limit_s:g}s")

    def test_trickled_requests_are_cut_at_the_deadline(self):
        cases = {
            "request line": b"GET /heal",
            "headers": b"GET /healthz HTTP/1.0\r\nX-Slow: ",
            "body": b"POST /admin/force_fail HTTP/1.0\r\nContent-Length: 1000\r\n\r\n{",
        }
        with mock.patch.object(server._Handler, "request_deadline", 1.0):
            for name, head in cases.items():
                with self.subTest(name):
                    elapsed = self.trickle_until_closed(head)
                    self.assertGreaterEqual(elapsed, 0.9)
                    self.assertLess(elapsed, 3.0)
        self.assertEqual(self.sender.write_threads, [])
        self.assertTrue(self.healthz_ok())


class OpenAdminWarningTest(unittest.TestCase):
    def start(self, env):
        scheduler = standins.NewScheduler()
        scheduler.disagg_prefill_inflight_queue = [standins.Req("r1", 1, standins.NixlKVSender(standins.KVManager(), 1))]
        loop, monitor = harness.start_loop(scheduler, env)
        self.addCleanup(loop.stop)
        self.addCleanup(monitor.close)
        return monitor

    def test_open_admin_on_loopback_is_warned_about_once(self):
        with self.assertLogs("sglang_watchdog_plugin", "WARNING") as logs:
            monitor = self.start(harness.plugin_env())
        warnings = [r.getMessage() for r in logs.records if "without a token" in r.getMessage()]
        self.assertEqual(len(warnings), 1, logs.output)
        self.assertIn("/admin/*", warnings[0])
        self.assertIn("SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE", warnings[0])
        # It keeps serving /admin/*, as the contract allows on loopback.
        status, body = harness.Client(monitor.listener.port).force_fail({"rid": "r1", "dry_run": True})
        self.assertEqual((status, body["result"]), (200, "would_flip"))

    def test_no_warning_with_a_token(self):
        fd, path = tempfile.mkstemp()
        os.write(fd, b"t0ken\n")
        os.close(fd)
        self.addCleanup(os.unlink, path)
        with self.assertNoLogs("sglang_watchdog_plugin", "WARNING"):
            self.start(harness.plugin_env(SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE=path))


class TokenRotationTest(HttpTest):
    """The token file is read again when it changes: a rotated Secret applies without restarting SGLang."""

    token = "first-t0ken"

    def rotate(self, content):
        # As the kubelet updates a Secret volume: a new file swapped in
        # under the same name (a new inode), never an edit in place.
        tmp = self.token_path + ".new"
        with open(tmp, "wb") as f:
            f.write(content)
        os.replace(tmp, self.token_path)

    def test_a_rotated_token_applies_to_the_next_request(self):
        payload = {"rid": "r1", "dry_run": True}
        self.assertEqual(self.client.force_fail(payload, token="first-t0ken")[0], 200)
        self.rotate(b"second-t0ken\n")
        self.assertEqual(self.client.force_fail(payload, token="first-t0ken")[0], 401)
        self.assertEqual(self.client.force_fail(payload, token="second-t0ken")[0], 200)

    def test_a_broken_rotation_closes_admin_until_the_file_is_fixed(self):
        payload = {"rid": "r1", "dry_run": True}
        with self.assertLogs("sglang_watchdog_plugin", "ERROR") as logs:
            self.rotate(b"")
            self.assertEqual(self.client.force_fail(payload, token="first-t0ken")[0], 401)
            self.assertEqual(self.client.force_fail(payload, token="")[0], 401)
        # One line for the change, not one per request.
        self.assertEqual(len([line for line in logs.output if "is empty" in line]), 1, logs.output)
        self.rotate(b"third-t0ken")
        self.assertEqual(self.client.force_fail(payload, token="third-t0ken")[0], 200)

    def test_an_unchanged_file_is_not_read_again(self):
        payload = {"rid": "r1", "dry_run": True}
        with mock.patch("sglang_watchdog_plugin.config._read_token") as read:
            for _ in range(3):
                self.assertEqual(self.client.force_fail(payload, token="first-t0ken")[0], 200)
        read.assert_not_called()


class AdminRefusalTest(unittest.TestCase):
    def test_admin_needs_a_token_off_loopback(self):
        for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
            self.assertTrue(admin_allowed(host, None, False), host)
        for host in ("0.0.0.0", "10.1.2.3", "pod.example"):
            self.assertFalse(admin_allowed(host, None, False), host)
        self.assertTrue(admin_allowed("0.0.0.0", b"t", False))
        self.assertFalse(admin_allowed("127.0.0.1", None, True))

    def test_refused_listener_still_serves_the_listing(self):
        # An unusable token file closes /admin/* through the same check as a
        # non-loopback bind without a token, while binding loopback only.
        env = harness.plugin_env(SGLANG_WATCHDOG_PLUGIN_TOKEN_FILE="/nonexistent/token")
        scheduler = standins.NewScheduler()
        sender = standins.NixlKVSender(standins.KVManager(), 1)
        scheduler.disagg_prefill_inflight_queue = [standins.Req("r1", 1, sender)]
        with self.assertLogs("sglang_watchdog_plugin", "WARNING") as logs:
            loop, monitor = harness.start_loop(scheduler, env)
        self.addCleanup(loop.stop)
        self.addCleanup(monitor.close)
        self.assertTrue(any("/admin/* stays closed" in line for line in logs.output))
        client = harness.Client(monitor.listener.port)
        status, body = client.force_fail({"rid": "r1"})
        self.assertEqual((status, body["result"]), (401, "unauthorized"))
        self.assertEqual(client.request("GET", "/debug/inflight")[0], 200)
        self.assertEqual(sender.write_threads, [])


if __name__ == "__main__":
    unittest.main()
