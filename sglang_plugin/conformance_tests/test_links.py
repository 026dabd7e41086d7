"""Each chunk's link on SGLang's own transfer workers: the decode destinations SGLang sends its room to.

The bench's prefill rank sends to several decode destinations here, each
SGLang's own decode KV manager (its own NIXL agent, or Mooncake session),
learnt by SGLang's prefill bootstrap from their receivers; the fake
transports time every KV transfer by its destination's speed. The plugin's
listing must name each chunk's link by the keys SGLang's ``transfer_infos``
holds for its room, in flight and finished, on a queue of its own and on a
queue two destinations share (SGLang's port-sum rule).
"""

import unittest

from sglang_watchdog_plugin.conformance import bench as bench_module
from sglang_watchdog_plugin.conformance import aftermath, transports
from sglang_watchdog_plugin.conformance.scheduler import _until

from . import test_prefill

_rooms = iter(range(400000, 500000))

FAST, SLOW = 0.005, 0.2  # seconds per page: a 2-page chunk in 10 ms, and in 0.4 s


class _Links(aftermath.Checked):
    backend = None

    def setUp(self):
        self.bench = bench_module.Bench(test_prefill._RT, self.backend).start()
        self.addCleanup(self.bench.stop)
        self.watch_aftermath(self.bench)
        queues = getattr(self.bench.prefill_mgr, "transfer_queues", None)
        if not self.bench.listing()["server"]["transfer_progress"]:
            self.skipTest(f"{self.backend} has no transfer workers in this release (NIXL before v0.5.18 posts "
                          "from the scheduler thread): chunks have no link to list")
        self.assertGreaterEqual(len(queues), 4)

    def tearDown(self):
        self.check_aftermath()
        self.assertEqual(self.bench.errors, [], "SGLang's pass raised: a real scheduler would have died")

    def test_each_chunk_names_its_destination_as_sglang_keys_it(self):
        # Odd queues: Linux binds a random port odd, so a NIXL room with one destination never lands on an
        # even queue; Mooncake's session ports are chosen here.
        fast = self.bench.destination("fast", 1, FAST)
        slow = self.bench.destination("slow", 3, SLOW)
        shared = self.bench.destination("shared", 1, SLOW)  # on the fast one's queue
        rooms = {}
        for name in ("fast", "slow", "shared", "fast"):
            req = self.bench.admit(next(_rooms), transports.COMPLETE, chunks=2, link=name)
            rooms[req.rid] = (req.bootstrap_room, name)
            # SGLang's own key of the room's one destination is the destination's name on the prefill side.
            self.assertEqual(self.bench.links[req.rid].destinations, [self.bench.destinations[name].key], name)
        queue_of = {name: self.bench.links[rid].queue for rid, (_, name) in rooms.items()}
        self.assertEqual(queue_of, {"fast": 1, "slow": 3, "shared": 1})

        # In flight: the slow destination's chunk, held 0.4 s.
        def slow_held():
            chunk = self.bench.worker(3)["in_flight"]
            return chunk if chunk is not None and chunk["pages"] > 0 else None

        _until(slow_held, 10, "the slow destination's chunk in its worker's hands")
        self.assertEqual(slow_held()["link"], slow.key)

        for rid in rooms:
            self.bench.wait_released(rid)
        finished = {q: self.bench.worker(q)["finished"] for q in (1, 3)}
        links = {q: [entry["link"] for entry in entries if entry["link"]] for q, entries in finished.items()}
        # Queue 1 is shared: each of its chunks names its own destination, in the order SGLang sent them.
        self.assertEqual(links[1], [fast.key] * 2 + [shared.key] * 2 + [fast.key] * 2)
        self.assertEqual(links[3], [slow.key] * 2)
        for q, entries in finished.items():
            self.assertEqual([e["chunk"] for e in entries], sorted(e["chunk"] for e in entries))
            for entry in entries:
                if entry["link"] in (slow.key, shared.key):
                    # Timed by its destination's speed, not by its queue's.
                    self.assertGreaterEqual(entry["seconds"], entry["pages"] * SLOW * 0.9, entry)
                elif entry["link"] == fast.key:
                    self.assertLess(entry["seconds"], entry["pages"] * SLOW * 0.5, entry)


class Nixl(_Links, unittest.TestCase):
    backend = "nixl"


class Mooncake(_Links, unittest.TestCase):
    backend = "mooncake"


def setUpModule():
    test_prefill.setUpModule()


if __name__ == "__main__":
    unittest.main()
