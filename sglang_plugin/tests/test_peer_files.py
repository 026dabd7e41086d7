"""Issue 25, points 1 and 2: the peer files are the leader's evidence that no other rank still sends a room, so
nothing but this user's own ranks of this server instance may write them, and reading them must never block
SGLang's scheduler thread (it reads them when it force-fails a Success room).
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import types
import unittest
from unittest import mock

from sglang_watchdog_plugin import monitor as monitor_module
from sglang_watchdog_plugin import peers
from sglang_watchdog_plugin.identity import identify

from . import standins
from .test_peers import _group_scheduler

OTHER_UID = 54321


def _publish(folder, attn_tp_rank, counts, attn_tp_size=2):
    manager = standins.NewestNixlKVManager()
    manager._staging_outstanding.update(counts)
    ident = identify(_group_scheduler(attn_tp_rank, attn_tp_size=attn_tp_size))
    return peers.Publisher(folder, ident, manager).start()


def _finishes(fn, seconds=5.0):
    """Whether fn() returned within seconds (run on a thread of its own: a blocked call must not hang the suite)."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


class PeerFolderTest(unittest.TestCase):
    def setUp(self):
        self.base = tempfile.mkdtemp()
        self.folder = os.path.join(self.base, "port30000-dp0-pp0-launcher1.2")
        self.leader = identify(_group_scheduler(0))
        self.group = peers.Group(self.folder, self.leader)

    def start(self, counts):
        publisher = _publish(self.folder, 1, counts)
        self.addCleanup(publisher.stop)
        return publisher

    def test_the_folder_is_made_private(self):
        self.start({7: 1})
        self.assertEqual(os.stat(self.folder).st_mode & 0o777, 0o700)
        self.assertEqual(os.stat(os.path.join(self.folder, "rank-tp1-cp0.json")).st_mode & 0o777, 0o600)
        self.assertEqual((self.group.read().watched, self.group.sending(7)), (1, (True, [])))

    def test_a_folder_others_may_write_is_refused(self):
        """makedirs(exist_ok=True) took any folder there: one another user made world-writable (or theirs) let
        them plant the files that say a rank sends nothing."""
        os.mkdir(self.folder, 0o700)
        os.chmod(self.folder, 0o777)
        with self.assertRaisesRegex(peers.UnsafeFolder, "writable by other users"):
            _publish(self.folder, 1, {})
        with self.assertLogs("sglang_watchdog_plugin", "WARNING") as logs:
            self.assertEqual(self.group.sending(7), (False, ["tp1-cp0"]))
        self.assertIn("refuses the peer folder", logs.output[0])

    @unittest.skipUnless(os.geteuid() == 0, "chown needs root")
    def test_a_folder_or_file_of_another_user_is_refused(self):
        self.start({7: 1})
        path = os.path.join(self.folder, "rank-tp1-cp0.json")
        os.chown(path, OTHER_UID, OTHER_UID)
        self.assertEqual(self.group.sending(7), (False, ["tp1-cp0"]), "another user's file says nothing")
        os.chown(path, 0, 0)
        os.chown(self.folder, OTHER_UID, OTHER_UID)
        self.assertEqual(self.group.read().watched, 0)
        with self.assertRaisesRegex(peers.UnsafeFolder, f"owned by uid {OTHER_UID}"):
            _publish(self.folder, 1, {})

    def test_a_symbolic_link_for_the_folder_is_refused(self):
        elsewhere = tempfile.mkdtemp()
        os.symlink(elsewhere, self.folder)
        with self.assertRaises(peers.UnsafeFolder):
            _publish(self.folder, 1, {})
        self.assertEqual(os.listdir(elsewhere), [])

    def test_a_link_at_the_temporary_name_is_never_written_through(self):
        """The publisher opened its temporary file with open(tmp, "w"): a link planted there truncated and
        overwrote whatever it pointed at."""
        os.mkdir(self.folder, 0o700)
        victim = os.path.join(self.base, "victim")
        with open(victim, "w") as f:
            f.write("keep me")
        os.symlink(victim, os.path.join(self.folder, f"rank-tp1-cp0.json.{os.getpid()}.tmp"))
        self.start({7: 1})
        with open(victim) as f:
            self.assertEqual(f.read(), "keep me")
        self.assertEqual(self.group.read().in_flight, {7: 1})

    def test_a_link_in_place_of_a_peer_file_is_refused(self):
        os.mkdir(self.folder, 0o700)
        forged = os.path.join(self.base, "forged.json")
        with open(forged, "w") as f:
            json.dump({"tracking": True, "written_unix": time.time(), "in_flight": {}}, f)
        os.symlink(forged, os.path.join(self.folder, "rank-tp1-cp0.json"))
        self.assertEqual(self.group.sending(7), (False, ["tp1-cp0"]))

    def test_a_fifo_in_place_of_a_peer_file_never_blocks(self):
        """open() of a FIFO waits for a writer: the scheduler thread, force-failing a Success room, hung for
        ever."""
        os.mkdir(self.folder, 0o700)
        os.mkfifo(os.path.join(self.folder, "rank-tp1-cp0.json"))
        answers = []
        self.assertTrue(_finishes(lambda: answers.append(self.group.sending(7))), "the read blocked on a FIFO")
        self.assertEqual(answers, [(False, ["tp1-cp0"])])

    def test_an_oversized_file_is_refused(self):
        publisher = self.start({7: 1})
        body = {"tracking": True, "written_unix": time.time(), "in_flight": {"7": 1},
                "pad": "x" * peers.MAX_FILE_BYTES}
        with open(publisher.path, "w") as f:
            json.dump(body, f)
        self.assertEqual(self.group.sending(7), (False, ["tp1-cp0"]))

    def test_a_slow_read_costs_the_scheduler_thread_at_most_the_timeout(self):
        """A peer folder on a file system that stalls (SGLANG_WATCHDOG_PLUGIN_PEER_DIR on a network mount): the
        caller waits READ_TIMEOUT_S once, then not at all while the read stays stuck."""
        self.start({7: 1})
        release = threading.Event()
        read = peers._read

        def stalled(folder, name):
            release.wait(30)
            return read(folder, name)

        self.addCleanup(release.set)
        with mock.patch.object(peers, "_read", stalled), mock.patch.object(peers, "READ_TIMEOUT_S", 0.1):
            began = time.monotonic()
            self.assertEqual(self.group.sending(7), (False, ["tp1-cp0"]))
            first = time.monotonic() - began
            began = time.monotonic()
            self.assertEqual(self.group.read().watched, 0)
            second = time.monotonic() - began
            release.set()
        self.assertLess(first, 2.0)
        self.assertLess(second, first, "a caller waited again for a read still stuck")
        # The stuck read ends: the next one answers.
        deadline = time.monotonic() + 5
        while self.group.read().watched != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(self.group.sending(7), (True, []))

    def test_a_forged_quiet_file_with_bad_numbers_is_unwatched(self):
        """A file whose counts are not whole numbers in range passed for a rank with nothing in flight (or
        raised OverflowError on Infinity)."""
        publisher = self.start({})
        for counts in ({"7": float("inf")}, {"7": float("nan")}, {"7": 1.5}, {"7": -1}, {"7": True}, {"-7": 1},
                       {"7e0": 1}, {"7": 2 ** 70}, {str(2 ** 64): 1}, []):
            with self.subTest(counts=counts):
                with open(publisher.path, "w") as f:
                    json.dump({"tracking": True, "written_unix": time.time(), "in_flight": counts}, f)
                self.assertEqual(self.group.sending(7), (False, ["tp1-cp0"]))
        for written in (float("nan"), float("inf"), 10 ** 400, "now", None):
            with self.subTest(written=written):
                with open(publisher.path, "w") as f:
                    json.dump({"tracking": True, "written_unix": written, "in_flight": {}}, f)
                self.assertEqual(self.group.read().watched, 0)


class PeerWorkersTest(unittest.TestCase):
    """A rank's transfer_workers are copied into the leader's listing: a NaN there made the whole listing
    unreadable to the watchdog, which then took the leader's rank for down."""

    def setUp(self):
        self.folder = os.path.join(tempfile.mkdtemp(), "instance")
        self.group = peers.Group(self.folder, identify(_group_scheduler(0)))
        self.publisher = _publish(self.folder, 1, {7: 1})
        self.addCleanup(self.publisher.stop)
        self.publisher.stop()

    def write_worker(self, **fields):
        worker = {"transfer_queue": 0, "tracked": True, "depth": 0, "chunks_taken": 3,
                  "in_flight": {"chunk": 3, "bootstrap_room": 7, "pages": 8, "last_chunk": False, "seconds": 1.5,
                                "link": "agent-1"},
                  "recent": [[8, 0.5]], "finished": [{"chunk": 2, "pages": 8, "seconds": 0.5, "link": "agent-1"}],
                  "queued_rooms": [9]}
        worker.update(fields)
        with open(self.publisher.path, "w") as f:
            json.dump({"tracking": True, "written_unix": time.time(), "in_flight": {"7": 1},
                       "transfer_workers": [worker]}, f)
        return worker

    def test_valid_workers_pass_through_with_their_links(self):
        worker = self.write_worker()
        view = self.group.read(queues=1)
        self.assertEqual(view.workers, [{"rank": "tp1-cp0", "transfer_workers": [worker]}])
        self.assertEqual(self.group.read(queues=0).workers, [], "more workers than the leader has queues")

    def test_a_bad_worker_drops_that_ranks_workers_only(self):
        chunk = {"chunk": 3, "bootstrap_room": 7, "pages": 8, "last_chunk": False, "seconds": 1.5, "link": "a"}
        for fields in ({"depth": float("nan")}, {"chunks_taken": -1}, {"tracked": 1}, {"transfer_queue": 1},
                       {"in_flight": dict(chunk, seconds=float("inf"))}, {"in_flight": dict(chunk, bootstrap_room=-1)},
                       {"in_flight": dict(chunk, link="x" * 257)}, {"in_flight": dict(chunk, link="\ud800")},
                       {"in_flight": dict(chunk, pages="8")}, {"recent": [[8, float("nan")]]},
                       {"finished": [{"chunk": 2, "pages": 8, "seconds": float("nan"), "link": ""}]},
                       {"finished": [{"chunk": 2, "pages": 8, "seconds": 1, "link": ""}] * 2},
                       {"finished": [{"chunk": 2.0, "pages": 8, "seconds": 1, "link": ""}]},
                       {"queued_rooms": [2 ** 64]}, {"recent": [[1, 1]] * 33}):
            with self.subTest(fields=fields):
                self.write_worker(**fields)
                view = self.group.read(queues=1)
                self.assertEqual((view.watched, view.in_flight, view.workers), (1, {7: 1}, []))

    def test_the_leaders_listing_stays_valid_json(self):
        self.write_worker(depth=float("nan"))
        leader = monitor_module.Monitor(identify(_group_scheduler(0)))
        leader.peers, leader.transfer_tracking, leader.transfer_queues = self.group, True, 1
        listing = leader.listing()
        json.dumps(listing, allow_nan=False)
        self.assertEqual(listing["server"]["transfer_ranks_watched"], 2)
        self.assertNotIn("peer_transfer_workers", listing)


class InstanceTest(unittest.TestCase):
    """Point 2: two prefill servers on one host sharing /dev/shm (--ipc=host, hostIPC) with the same port wrote
    the same rank-tp1-cp0.json, and each leader merged the other's counts."""

    def test_two_servers_on_one_port_have_folders_of_their_own(self):
        scheduler = _group_scheduler(1)
        scheduler.server_args = types.SimpleNamespace(port=30000, disaggregation_transfer_backend="nixl")
        ident = identify(scheduler)
        base = tempfile.mkdtemp()
        env = {"SGLANG_WATCHDOG_PLUGIN_PEER_DIR": base}
        proc = tempfile.mkdtemp()
        for pid, started in ((101, 5000), (102, 6000), (103, 7000)):
            os.mkdir(os.path.join(proc, str(pid)))
            with open(os.path.join(proc, str(pid), "stat"), "w") as f:
                f.write(f"{pid} (python3 x) S 1 " + " ".join(["0"] * 17) + f" {started} 0 0\n")

        def folder(ppid):
            with mock.patch.object(os, "getppid", return_value=ppid):
                return peers.directory(scheduler, ident, env=env, proc=proc)

        a, b = folder(101), folder(102)
        self.assertNotEqual(a, b)
        self.assertTrue(a.startswith(os.path.join(base, "port30000-dp0-pp0-")), a)
        self.assertTrue(a.endswith("launcher101.5000"), a)

        # Server A's rank 1 sends room 4242; server B's leader reads its own instance's folder only.
        publisher = _publish(a, 1, {4242: 1})
        self.addCleanup(publisher.stop)
        leader_a, leader_b = identify(_group_scheduler(0)), identify(_group_scheduler(0))
        self.assertEqual(peers.Group(a, leader_a).sending(4242), (True, []))
        self.assertEqual(peers.Group(b, leader_b).read().watched, 0, "server B merged server A's rank")
        self.assertEqual(peers.Group(b, leader_b).sending(4242), (False, ["tp1-cp0"]))

    def test_ranks_of_one_launcher_share_the_key_and_others_do_not(self):
        """Spawned as SGLang spawns its schedulers: two children of one process name the same launcher, a child
        of another process does not."""
        code = "from sglang_watchdog_plugin import peers; print(peers.launcher())"
        cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

        def child():
            return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                                  check=True, timeout=60).stdout.strip()

        first, second = child(), child()
        grandchild = subprocess.run([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, "
                                     f"'-c', {code!r}], check=True)"], capture_output=True, text=True, cwd=cwd,
                                    check=True, timeout=60).stdout.strip()
        self.assertEqual(first, second)
        self.assertEqual(first, f"launcher{os.getpid()}.{first.rsplit('.', 1)[1]}")
        self.assertNotEqual(first, grandchild)


if __name__ == "__main__":
    unittest.main()
