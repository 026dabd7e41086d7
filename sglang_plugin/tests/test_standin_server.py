import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

from . import harness

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin_server.py")


class StandinServerTest(unittest.TestCase):
    def launch(self, *args):
        proc = subprocess.Popen([sys.executable, SCRIPT, "--port", "0", "--metrics-port", "0", *args],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.addCleanup(self.stop, proc)
        line = proc.stdout.readline().decode()
        match = re.fullmatch(r"READY plugin=(\d+) metrics=(\d+)\n", line)
        if match is None:  # the process died or printed something else: show why
            proc.kill()
            self.fail(f"no READY line: {line!r}\n{proc.stderr.read().decode()}")
        return proc, harness.Client(int(match[1])), int(match[2])

    def stop(self, proc):
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
        if proc.stdin:
            proc.stdin.close()

    def metric(self, port, name):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)[1])

    def test_parity_scenario_nixl(self):
        proc, client, metrics_port = self.launch("--backend", "nixl", "--scenario", "parity")
        status, listing = client.get_json()
        self.assertEqual(status, 200)
        self.assertEqual(listing["server"]["transfer_backend"], "nixl")
        self.assertEqual(listing["queues"], {"bootstrap": 0, "waiting": 0, "inflight": 3})
        pinned, healthy, health = listing["inflight"]
        self.assertEqual(
            {k: pinned[k] for k in ("rid", "bootstrap_room", "bootstrap_addr", "poll", "prompt_tokens", "progress",
                                    "send_failed", "health_check")},
            {"rid": "pinned-0001", "bootstrap_room": 9223372036854775001, "bootstrap_addr": "10.0.0.7:8998",
             "poll": "Transferring", "prompt_tokens": 4096, "progress": 3, "send_failed": False,
             "health_check": False})
        self.assertGreaterEqual(pinned["age_seconds"], 120)
        self.assertEqual((healthy["rid"], healthy["bootstrap_room"], healthy["poll"]),
                         ("healthy-0002", 18446744073709551557, "Transferring"))
        self.assertEqual((health["rid"], health["bootstrap_room"], health["bootstrap_addr"], health["poll"],
                          health["progress"], health["health_check"]),
                         ("HEALTH_CHECK_1764403200.0", 0, "2.2.2.2", "WaitingForInput", -1, True))
        self.assertGreaterEqual(health["age_seconds"], 200)

        time.sleep(0.35)
        _, later = client.get_json()
        self.assertGreater(later["inflight"][1]["progress"], healthy["progress"])
        self.assertEqual(later["inflight"][0]["progress"], 3)
        self.assertGreater(later["loop"]["iterations"], listing["loop"]["iterations"])

        self.assertEqual(self.metric(metrics_port, "sglang:num_transfer_failed_reqs_total"), 0)
        status, body = client.force_fail({"rid": "pinned-0001", "bootstrap_room": 9223372036854775001,
                                          "reason": "stuck 120s"})
        self.assertEqual((status, body["result"], body["lever"]), (200, "flipped", "_send_failed"))
        harness.wait_until(lambda: self.metric(metrics_port, "sglang:num_transfer_failed_reqs_total") == 1)
        self.assertEqual([r["rid"] for r in client.get_json()[1]["inflight"]],
                         ["healthy-0002", "HEALTH_CHECK_1764403200.0"])
        self.assertEqual(self.metric(metrics_port, "sglang:num_prefill_inflight_queue_reqs"), 2)
        self.assertEqual(client.force_fail({"rid": "pinned-0001"})[0], 404)

        proc.stdin.close()
        self.assertEqual(proc.wait(10), 0)

    def test_mooncake_with_token_and_sigterm(self):
        with tempfile.NamedTemporaryFile("w", delete=False) as f:
            f.write("tok-123\n")
        self.addCleanup(os.unlink, f.name)
        proc, client, _ = self.launch("--backend", "mooncake", "--token-file", f.name)
        self.assertEqual(client.force_fail({"rid": "pinned-0001"})[0], 401)
        status, body = client.force_fail({"rid": "pinned-0001", "dry_run": True}, token="tok-123")
        self.assertEqual((status, body["result"], body["lever"]), (200, "would_flip", "conclude_state"))
        self.assertEqual(client.get_json()[1]["inflight"][0]["progress"], 3)
        proc.terminate()
        self.assertEqual(proc.wait(10), 0)


if __name__ == "__main__":
    unittest.main()
