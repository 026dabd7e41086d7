"""Issue 25, point 4: a fuzz run over the peer-file reader and the leader's listing merge (deterministic: Python has
no go-fuzz in the standard library, so a seeded generator stands in for it).

Each case writes one hostile file where rank 1's belongs (values of every wrong type and range in the counts and
in each field of its transfer workers, truncated or non-UTF-8 or deeply nested JSON, a link, a FIFO, a directory,
an oversized file) and builds the leader's listing from it. Whatever the file, the listing must encode with
``allow_nan=False`` and meet the rules the watchdog's decoder applies to every worker (pluginapi/client.go,
validateWorker), or the watchdog takes the leader's whole rank for down; a file whose counts are not valid must
leave rank 1 unwatched, and one whose workers are not valid must cost rank 1 its workers only.
"""

import json
import math
import os
import random
import tempfile
import threading
import time
import unittest

from sglang_watchdog_plugin import monitor as monitor_module
from sglang_watchdog_plugin import peers
from sglang_watchdog_plugin.identity import identify

from .test_peers import _group_scheduler

SEED = 25
CASES = 600
QUEUES = 2
HOSTILE = [float("nan"), float("inf"), float("-inf"), -1, 2 ** 64, 10 ** 400, "x" * 300, "\ud800", {"a": [1]},
           [[[]]]]


def _hostile(rnd, original):
    """A value of the wrong type or range for where original was: a bool where a number was, and the reverse."""
    return rnd.choice(HOSTILE + [1 if type(original) is bool else True])


def _valid_body():
    def worker(index):
        return {"transfer_queue": index, "tracked": True, "depth": 1, "chunks_taken": 5,
                "in_flight": {"chunk": 5, "bootstrap_room": 7, "pages": 16, "last_chunk": False, "seconds": 2.5,
                              "link": "agent-1,agent-2"},
                "recent": [[16, 0.25], [8, 0.125]],
                "finished": [{"chunk": 3, "pages": 16, "seconds": 0.25, "link": "agent-1,agent-2"},
                             {"chunk": 4, "pages": 8, "seconds": 0.125, "link": ""}],
                "queued_rooms": [9, 2 ** 64 - 1]}

    return {"pid": 1, "written_unix": time.time(), "tracking": True, "in_flight": {"7": 1, "8": 2},
            "queued": {"9": 1}, "transfer_workers": [worker(0), worker(1)]}


def _containers(value, path=()):
    """Every (path, container) inside value: where a hostile value may go."""
    yield path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _containers(child, path + (key,))


def _get(body, path):
    for key in path:
        body = body[key]
    return body


def _finite(x):
    return type(x) in (int, float) and x >= 0 and (type(x) is int or math.isfinite(x))


def _go_rules(listing):
    """The problems pluginapi's decoder would find in the peer workers and orphans of a listing ([] if none)."""
    problems = []
    int64 = lambda x: type(x) is int and 0 <= x < 2 ** 63  # noqa: E731
    link = lambda x: type(x) is str and len(x.encode("utf-8")) <= 256  # noqa: E731
    for peer in listing.get("peer_transfer_workers", []):
        for w in peer["transfer_workers"]:
            if not (int64(w["transfer_queue"]) and w["transfer_queue"] < QUEUES and type(w["tracked"]) is bool
                    and int64(w["depth"]) and int64(w["chunks_taken"])):
                problems.append(("worker", w))
            c = w["in_flight"]
            if c is not None and not (int64(c["chunk"]) and type(c["bootstrap_room"]) is int
                                      and 0 <= c["bootstrap_room"] < 2 ** 64 and int64(c["pages"])
                                      and type(c["last_chunk"]) is bool and _finite(c["seconds"]) and link(c["link"])):
                problems.append(("in_flight", c))
            chunks = [f["chunk"] for f in w.get("finished", [])]
            if chunks != sorted(set(chunks)) or not all(
                    int64(f["chunk"]) and int64(f["pages"]) and _finite(f["seconds"]) and link(f["link"])
                    for f in w.get("finished", [])):
                problems.append(("finished", w.get("finished")))
            if not all(len(pair) == 2 and _finite(pair[0]) and _finite(pair[1]) for pair in w["recent"]):
                problems.append(("recent", w["recent"]))
            if not all(type(r) is int and 0 <= r < 2 ** 64 for r in w.get("queued_rooms", [])):
                problems.append(("queued_rooms", w.get("queued_rooms")))
    for o in listing["orphaned_transfers"]:
        if not (type(o["bootstrap_room"]) is int and 0 <= o["bootstrap_room"] < 2 ** 64
                and type(o["outstanding_chunks"]) is int and o["outstanding_chunks"] >= 1):
            problems.append(("orphan", o))
    return problems


class PeerFileFuzzTest(unittest.TestCase):
    def setUp(self):
        self.folder = os.path.join(tempfile.mkdtemp(), "instance")
        os.mkdir(self.folder, 0o700)
        self.path = os.path.join(self.folder, "rank-tp1-cp0.json")
        self.leader = monitor_module.Monitor(identify(_group_scheduler(0)))
        self.leader.peers = peers.Group(self.folder, self.leader.identity)
        self.leader.transfer_tracking, self.leader.transfer_queues = True, QUEUES

    def place(self, data=None, kind="file"):
        if os.path.lexists(self.path):
            (os.rmdir if os.path.isdir(self.path) and not os.path.islink(self.path) else os.unlink)(self.path)
        if kind == "file":
            with open(self.path, "wb") as f:
                f.write(data)
        elif kind == "fifo":
            os.mkfifo(self.path)
        elif kind == "dir":
            os.mkdir(self.path)
        elif kind == "symlink":
            target = os.path.join(os.path.dirname(self.folder), "target.json")
            with open(target, "wb") as f:
                f.write(data)
            os.symlink(target, self.path)

    def listing(self):
        """The leader's listing, built on a thread of its own: a read that blocks fails the case, not the suite."""
        out = []
        thread = threading.Thread(target=lambda: out.append(self.leader.listing()), daemon=True)
        thread.start()
        thread.join(10)
        self.assertTrue(out, "the leader's listing blocked on a peer file")
        return out[0]

    def case(self, rnd):
        """(what was done, whether rank 1 must be unwatched, whether it must list no workers; None: may be either)."""
        body = _valid_body()
        kind = rnd.choice(["counts", "workers", "workers", "extra", "bytes", "fs"])
        if kind == "counts":
            target = rnd.choice(["tracking", "written_unix", "in_flight", "queued", "count", "room"])
            value = _hostile(rnd, body.get(target, 0))
            if target == "count":
                body["in_flight"]["8"] = value
            elif target == "room":
                body["in_flight"][rnd.choice(["-1", "1e3", "x", "007", "\u0663", str(2 ** 64), ""])] = 1
            else:
                body[target] = value
            self.place(json.dumps(body).encode())
            return f"{target} = {value!r:.40}", True, True
        if kind in ("workers", "extra"):
            paths = [path for path, _ in _containers(body["transfer_workers"], ("transfer_workers",)) if len(path) > 1]
            path = rnd.choice(paths)
            container = _get(body, path)
            if kind == "extra":
                if not isinstance(container, dict):
                    return self.case(rnd)
                container["unknown"] = float("nan")  # not a field a worker has: not copied into the listing
                self.place(json.dumps(body).encode())
                return f"{path} gains a NaN field", False, False
            value = _hostile(rnd, container)
            _get(body, path[:-1])[path[-1]] = value
            self.place(json.dumps(body).encode())
            return f"{path} = {value!r:.40}", False, True
        if kind == "bytes":
            data = json.dumps(body).encode()
            how = rnd.choice(["truncate", "utf8", "nest", "flip"])
            if how == "truncate":
                data = data[:rnd.randrange(len(data))]
            elif how == "utf8":
                at = data.index(b"agent-1") + rnd.randrange(7)
                data = data[:at] + b"\xff\xfe" + data[at:]
            elif how == "nest":
                at = data.index(b'"queued_rooms": ') + len(b'"queued_rooms": ')
                depth = rnd.choice([50, 100_000])
                data = data[:at] + b"[" * depth + b"]" * depth + b", \"x\": " + data[at:]
                self.place(data)
                # Nested in a worker, it costs the rank its workers; too deep for the parser, the whole file.
                return f"nest {depth}", depth > 50, True
            else:  # the file may even stay valid: only the listing's rules are asserted
                at = rnd.randrange(len(data))
                data = data[:at] + bytes([rnd.randrange(256)]) + data[at + 1:]
                self.place(data)
                return "a byte flipped", None, None
            self.place(data)
            return how, True, True
        how = rnd.choice(["fifo", "dir", "symlink", "oversize"])
        if how == "oversize":
            body["pad"] = "x" * peers.MAX_FILE_BYTES
            self.place(json.dumps(body).encode())
        else:
            self.place(json.dumps(body).encode(), kind=how)
        return how, True, True

    def test_hostile_peer_files(self):
        rnd = random.Random(SEED)
        seen = set()
        for index in range(CASES):
            what, unwatched, no_workers = self.case(rnd)
            seen.add(what.split(" ")[0])
            with self.subTest(case=index, what=what):
                listing = self.listing()
                json.dumps(listing, allow_nan=False)
                self.assertEqual(_go_rules(listing), [])
                ranks = [peer["rank"] for peer in listing.get("peer_transfer_workers", [])]
                watched = listing["server"]["transfer_ranks_watched"]
                if unwatched is not None:
                    self.assertEqual(watched, 1 if unwatched else 2, "rank 1's watch")
                    self.assertEqual(ranks, [] if no_workers else ["tp1-cp0"], "rank 1's workers")
                if watched == 2 and unwatched is not None:
                    orphans = {o["bootstrap_room"]: o["outstanding_chunks"] for o in listing["orphaned_transfers"]}
                    self.assertEqual(orphans, {7: 1, 8: 2}, "a rank watched with counts other than its own")
        self.assertGreaterEqual(len(seen), 10, f"the generator covered too little: {sorted(seen)}")

    def test_a_valid_file_lists_its_workers(self):
        """The generator's starting point is valid: every hostile case is a departure from a listed rank."""
        body = _valid_body()
        self.place(json.dumps(body).encode())
        listing = self.listing()
        self.assertEqual(listing["server"]["transfer_ranks_watched"], 2)
        self.assertEqual(listing["peer_transfer_workers"], [{"rank": "tp1-cp0",
                                                              "transfer_workers": body["transfer_workers"]}])


if __name__ == "__main__":
    unittest.main()
