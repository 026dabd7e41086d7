import os
import tempfile
import time
import unittest
import urllib.request

from . import harness

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin_server.py")


class StandinServerTest(unittest.TestCase):
    def launch(self, *args):
        proc, match = harness.launch_standin(self, SCRIPT, args, r"READY plugin=(\d+) metrics=(\d+)( pp_size=2)?\n")
        return proc, harness.Client(int(match[1])), int(match[2])

    metric = staticmethod(harness.metric)

    def test_parity_scenario_nixl(self):
        proc, client, metrics_port = self.launch("--backend", "nixl", "--scenario", "parity")
        status, listing = client.get_json()
        self.assertEqual(status, 200)
        self.assertEqual(listing["server"]["transfer_backend"], "nixl")
        self.assertEqual(listing["queues"], {"bootstrap": 0, "waiting": 0, "inflight": 4})
        pinned, healthy, health, warmup = listing["inflight"]
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
        self.assertEqual((warmup["rid"], warmup["bootstrap_room"], warmup["bootstrap_addr"], warmup["poll"],
                          warmup["progress"], warmup["health_check"]),
                         ("5f1e0c2a9b7d4e3f8a6b1c0d2e4f6a8b", 0, "2.2.2.2", "WaitingForInput", -1, True))

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
                         ["healthy-0002", "HEALTH_CHECK_1764403200.0", "5f1e0c2a9b7d4e3f8a6b1c0d2e4f6a8b"])
        self.assertEqual(self.metric(metrics_port, "sglang:num_prefill_inflight_queue_reqs"), 3)
        self.assertEqual(client.force_fail({"rid": "pinned-0001"})[0], 404)
        for rid in ("HEALTH_CHECK_1764403200.0", "5f1e0c2a9b7d4e3f8a6b1c0d2e4f6a8b"):
            status, body = client.force_fail({"rid": rid})
            self.assertEqual((status, body["result"]), (409, "health_check"), rid)

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


    def test_round2_fields_of_the_parity_scene(self):
        for backend, levers in (("nixl", ["abort", "_send_failed"]), ("mooncake", ["abort"])):
            _, client, _ = self.launch("--backend", backend)
            listing = client.get_json()[1]
            server = listing["server"]
            self.assertEqual((server["levers"], server["lever_note"], server["pp_size"], server["transfer_queues"]),
                             (levers, "", 1, 4), backend)
            self.assertEqual([(r["transfer_in_flight"], r["transfer_queue"]) for r in listing["inflight"]],
                             [(False, 2), (True, 1), (False, None), (False, None)], backend)
            self.assertEqual(listing["orphaned_transfers"], [])
            status, body = client.force_fail({"rid": "pinned-0001", "dry_run": True})
            self.assertEqual((status, body["result"], body["levers"]), (200, "would_flip", levers))

    def test_wedge_leaves_an_orphaned_transfer(self):
        _, client, _ = self.launch("--scenario", "wedge")
        pinned = client.get_json()[1]["inflight"][0]
        self.assertEqual((pinned["transfer_in_flight"], pinned["transfer_queue"]), (True, 2))
        self.assertEqual(client.force_fail({"rid": "pinned-0001"})[1]["result"], "flipped")
        harness.wait_until(lambda: client.get_json()[1]["orphaned_transfers"] != [], timeout=10)
        self.assertEqual(client.get_json()[1]["orphaned_transfers"],
                         [{"bootstrap_room": 9223372036854775001, "transfer_queue": 2, "outstanding_chunks": 1}])

    def test_old_eras_answer_unsupported(self):
        for era, note in (("mid2025", "update_status"), ("early", "raises")):
            _, client, metrics_port = self.launch("--era", era)
            listing = client.get_json()[1]
            self.assertEqual(listing["server"]["levers"], [], era)
            self.assertIn(note, listing["server"]["lever_note"])
            self.assertEqual([r["rid"] for r in listing["inflight"]],
                             ["pinned-0001", "healthy-0002", "HEALTH_CHECK_1764403200.0",
                              "5f1e0c2a9b7d4e3f8a6b1c0d2e4f6a8b"])
            for dry_run in (True, False):
                status, body = client.force_fail({"rid": "pinned-0001", "dry_run": dry_run})
                self.assertEqual((status, body["result"]), (501, "unsupported"), era)
            time.sleep(0.1)
            self.assertEqual(len(client.get_json()[1]["inflight"]), 4)
            self.assertEqual(self.metric(metrics_port, "sglang:num_transfer_failed_reqs_total"), 0)

    def test_pp2_releases_only_when_both_stages_fail(self):
        _, stage0, metrics_port = self.launch("--pp-size", "2")
        stage1 = harness.Client(stage0.port + 1)
        servers = [c.get_json()[1]["server"] for c in (stage0, stage1)]
        self.assertEqual([(s["pp_rank"], s["pp_size"]) for s in servers], [(0, 2), (1, 2)])
        room = 9223372036854775001
        self.assertEqual(stage0.force_fail({"rid": "pinned-0001", "bootstrap_room": room})[1]["result"], "flipped")
        time.sleep(0.2)
        for client in (stage0, stage1):
            self.assertEqual(len(client.get_json()[1]["inflight"]), 4)
        self.assertEqual(stage1.force_fail({"rid": "pinned-0001", "bootstrap_room": room})[1]["result"], "flipped")
        for client in (stage0, stage1):
            harness.wait_until(lambda: len(client.get_json()[1]["inflight"]) == 3, timeout=10)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        self.assertIn('sglang:num_transfer_failed_reqs_total{model_name="standin",pp_rank="1"} 1.0', text)

    def test_restart_ends_the_process_with_status_1(self):
        with tempfile.NamedTemporaryFile("w", delete=False) as f:
            f.write("tok-123\n")
        self.addCleanup(os.unlink, f.name)
        proc, client, _ = self.launch("--token-file", f.name, "--allow-restart")
        pid = client.get_json()[1]["server"]["pid"]
        self.assertEqual(pid, proc.pid)
        status, body = client.post_json("/admin/restart", {"pid": pid, "reason": "test"}, token="tok-123")
        self.assertEqual((status, body["result"]), (202, "restarting"))
        self.assertEqual(proc.wait(10), 1)


if __name__ == "__main__":
    unittest.main()
