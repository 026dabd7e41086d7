"""The decode stand-in server the Go tests start: its documented scene, over real HTTP."""

import os
import subprocess
import sys
import unittest

from . import harness

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin_decode_server.py")


class StandinDecodeServerTest(unittest.TestCase):
    def launch(self, *args):
        proc, match = harness.launch_standin(self, SCRIPT, args)
        self.metrics_port = int(match[2])
        return proc, harness.Client(int(match[1]))

    def metric(self, name):
        return harness.metric(self.metrics_port, name)

    def rows(self, client):
        return {row["rid"]: row for row in client.get_json()[1]["decode_requests"]}

    def test_decode_scene_nixl(self):
        proc, client = self.launch()
        _, listing = client.get_json()
        self.assertEqual((listing["server"]["disaggregation_mode"], listing["server"]["levers"],
                          listing["server"]["deferred_release"]), ("decode", ["abort"], True))
        self.assertEqual(listing["inflight"], [])
        rows = {row["rid"]: row for row in listing["decode_requests"]}
        self.assertEqual(list(rows)[:4], ["waiting-0001", "HEALTH_CHECK_1764403200.0", "warmup-0005", "live-0002"])
        self.assertEqual({k: rows["waiting-0001"][k] for k in ("queue", "poll", "progress", "transfer_started")},
                         {"queue": "prealloc", "poll": "Bootstrapping", "progress": 0, "transfer_started": False})
        live = rows["live-0002"]
        self.assertEqual((live["bootstrap_room"], live["queue"], live["poll"], live["progress"], live["transfer_started"]),
                         (18446744073709551557, "transfer", "WaitingForInput", 2, True))
        self.assertEqual(self.metric("sglang:num_decode_prealloc_queue_reqs"), 3)

        # Health checks and warm-ups: refused, dry run or not.
        for rid in ("HEALTH_CHECK_1764403200.0", "warmup-0005"):
            status, body = client.force_fail({"rid": rid, "dry_run": True})
            self.assertEqual((status, body["result"]), (409, "health_check"))
        # The live transfer: refused without prefill_stopped.
        status, body = client.force_fail({"rid": "live-0002"})
        self.assertEqual((status, body["result"]), (409, "transfer_live"))
        # The healthy request completes by itself, counting nothing.
        harness.wait_until(lambda: "healthy-0003" not in self.rows(client), timeout=10)
        # The waiting request: released as a bootstrap failure.
        status, body = client.force_fail({"rid": "waiting-0001", "bootstrap_room": 9223372036854775011})
        self.assertEqual((status, body["result"], body["levers"]), (200, "flipped", ["abort"]))
        harness.wait_until(lambda: self.metric("sglang:num_bootstrap_failed_reqs_total") == 1)
        self.assertNotIn("waiting-0001", self.rows(client))
        # The live one, once the caller asserts prefill stopped: abort and deferred abort.
        status, body = client.force_fail({"rid": "live-0002", "prefill_stopped": True})
        self.assertEqual((status, body["result"], body["levers"]), (200, "flipped", ["abort", "deferred_abort"]))
        harness.wait_until(lambda: self.metric("sglang:num_transfer_failed_reqs_total") == 1)
        self.assertEqual(self.metric("sglang:num_decode_transfer_queue_reqs"), 0)
        self.assertEqual(list(self.rows(client)), ["HEALTH_CHECK_1764403200.0", "warmup-0005"])

    def test_decode_scene_mooncake_without_deferred_release(self):
        proc, client = self.launch("--backend", "mooncake", "--deferred-release", "absent")
        _, listing = client.get_json()
        self.assertIsNone(listing["server"]["deferred_release"])
        live = self.rows(client)["live-0002"]
        self.assertEqual((live["poll"], live["progress"], live["chunks_expected"]), ("Transferring", -1, None))
        status, body = client.force_fail({"rid": "live-0002", "prefill_stopped": True, "dry_run": True})
        self.assertEqual((status, body["result"], body["levers"]), (200, "would_flip", ["abort"]))

    def test_live_room(self):
        # The room of the prefill parity scene's pinned-0001, as the Go tests pass it.
        proc, client = self.launch("--live-room", "9223372036854775001")
        live = self.rows(client)["live-0002"]
        self.assertEqual((live["bootstrap_room"], live["transfer_started"]), (9223372036854775001, True))
        status, body = client.force_fail({"rid": "live-0002", "bootstrap_room": 9223372036854775001})
        self.assertEqual((status, body["result"]), (409, "transfer_live"))

    def test_live_room_must_be_free(self):
        for room in ("0", "9223372036854775011", str(2**64)):
            proc = subprocess.run([sys.executable, SCRIPT, "--live-room", room], capture_output=True, timeout=30)
            self.assertEqual(proc.returncode, 2, room)
            self.assertIn(b"--live-room", proc.stderr)


if __name__ == "__main__":
    unittest.main()
