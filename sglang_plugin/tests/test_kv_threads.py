"""kv_threads: SGLang's manager threads found by what they run, and listed dead once they end; and the decode
release's reading of the ABORT frame on both sides."""

import queue
import threading
import unittest

from sglang_watchdog_plugin import decode_capabilities, kv_threads


class _Manager:
    """Starts its threads the ways SGLang's managers do: a closure, and a bound method per queue."""

    def __init__(self, queues=2):
        self.transfer_queues = [queue.Queue() for _ in range(queues)]
        self.stop = threading.Event()
        self.frame_kills = False
        for q in self.transfer_queues:
            threading.Thread(target=self.transfer_worker, args=(q, None), daemon=True).start()
        self._start_bootstrap_thread()

    def transfer_worker(self, q, executor):
        while q.get() is not None:
            pass

    def _start_bootstrap_thread(self):
        def bootstrap_thread():
            self.stop.wait()
            if self.frame_kills:
                raise AssertionError("First message should be b'NixlMsgGuard'. Foreign traffic?")

        threading.Thread(target=bootstrap_thread, daemon=True).start()


class FindTest(unittest.TestCase):
    def setUp(self):
        self.manager = _Manager()
        self.addCleanup(self._end)
        self.threads = kv_threads.find(self.manager)

    def _end(self):
        self.manager.stop.set()
        for q in self.manager.transfer_queues:
            q.put(None)

    def test_finds_each_thread_by_what_it_runs(self):
        self.assertEqual(kv_threads.listing(self.threads), [
            {"role": "bootstrap", "function": "bootstrap_thread", "alive": True},
            {"role": "transfer_worker", "function": "transfer_worker", "alive": True, "transfer_queue": 0},
            {"role": "transfer_worker", "function": "transfer_worker", "alive": True, "transfer_queue": 1},
        ])

    def test_a_thread_that_dies_stays_listed_dead(self):
        hook, threading.excepthook = threading.excepthook, lambda args: None
        try:
            self.manager.frame_kills = True
            self.manager.stop.set()
            bootstrap = self.threads[0].thread
            bootstrap.join(5)
        finally:
            threading.excepthook = hook
        self.assertEqual([t.function for t in kv_threads.dead(self.threads)], ["bootstrap_thread"])
        self.assertIs(kv_threads.listing(self.threads)[0]["alive"], False)
        # Found anew, a dead thread is gone: it is remembered from the first finding only.
        self.assertNotIn("bootstrap_thread", [t.function for t in kv_threads.find(self.manager)])

    def test_other_managers_threads_are_not_listed(self):
        other = _Manager(queues=1)
        self.addCleanup(lambda: (other.stop.set(), other.transfer_queues[0].put(None)))
        self.assertEqual(len(kv_threads.find(self.manager)), 3)

    def test_nothing_known_is_null(self):
        self.assertIsNone(kv_threads.listing(None))
        self.assertIsNone(kv_threads.listing(()))
        self.assertEqual(kv_threads.find(None), ())


# Receivers and managers as SGLang writes them (disaggregation/common/conn.py and nixl/conn.py, v0.5.18): the
# receiver's abort() sends the frame through a method of its own; the manager reads it in a method its bootstrap
# thread calls, or not at all.
class _Receiver:
    def abort(self):
        self.conclude_state = "Failed"
        self._send_abort_notification()

    def _send_abort_notification(self):
        self.sock.send_multipart([b"ABORT", b"7"])


class _SilentReceiver:
    def abort(self):
        self.conclude_state = "Failed"


class _Reads:
    def _handle_abort_notification(self, msg):
        return msg[0] == b"ABORT"

    def _start_bootstrap_thread(self):
        def bootstrap_thread():
            msg = self.sock.recv_multipart()
            if self._handle_abort_notification(msg):
                return
            assert msg[0] == b"NixlMsgGuard"


class _ReadsInline:
    def start_prefill_thread(self):
        def bootstrap_thread():
            room = self.sock.recv_multipart()[0].decode()
            if room == "ABORT":
                return


class _Deaf:
    def _start_bootstrap_thread(self):
        def bootstrap_thread():
            msg = self.sock.recv_multipart()
            assert msg[0] == b"NixlMsgGuard", "Foreign traffic?"


for _cls in (_Receiver, _SilentReceiver, _Reads, _ReadsInline, _Deaf):
    _cls.__module__ = "sglang.srt.disaggregation.fake_for_tests"


class AbortFrameTest(unittest.TestCase):
    def setUp(self):
        decode_capabilities._abort_frame_problems.clear()

    def test_a_manager_that_reads_the_frame_takes_the_release(self):
        self.assertEqual(decode_capabilities.abort_frame_problem(_Receiver, _Reads), "")
        self.assertEqual(decode_capabilities.abort_frame_problem(_Receiver, _ReadsInline), "")

    def test_no_frame_sent_is_no_hazard(self):
        self.assertEqual(decode_capabilities.abort_frame_problem(_SilentReceiver, _Deaf), "")

    def test_a_bootstrap_thread_that_cannot_read_it_refuses_the_release(self):
        problem = decode_capabilities.abort_frame_problem(_Receiver, _Deaf)
        self.assertIn("does not read", problem)
        self.assertIn("bootstrap thread", problem)

    def test_a_manager_with_no_bootstrap_thread_found_is_unknown_and_refused(self):
        class Bare:
            pass

        Bare.__module__ = "sglang.srt.disaggregation.fake_for_tests"
        self.assertIn("unknown", decode_capabilities.abort_frame_problem(_Receiver, Bare))


if __name__ == "__main__":
    unittest.main()
