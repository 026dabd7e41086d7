"""The admin entry points of a Monitor, on the HTTP threads: force-fail, wedge and restart orders.

A force-fail is answered from the latest snapshot where it can be (not
found, room mismatch, health check, no lever), else handed to the scheduler
thread through the monitor's order deque and waited for; a wedge order is
left to wedge.py's standing orders; a restart is decided here and carried
out by ``end_process`` once the HTTP handler sent the answer.
"""

import logging
import os
import signal
import time

from . import process_tree
from .orders import (
    ForceFailOrder,
    Outcome,
    health_check,
    not_found,
    room_mismatch,
    too_many_orders,
    unresponsive,
    unsupported,
)
from .snapshot import listed_rooms
from .wedge import would_fail

logger = logging.getLogger("sglang_watchdog_plugin")


class Admin:
    """The admin part of a Monitor: HTTP threads only; SGLang's objects are the scheduler thread's."""

    def force_fail(self, rid, bootstrap_room, reason, dry_run, prefill_stopped=False):
        """Answers fast from the latest snapshot where it can, else waits for the scheduler thread."""
        known = self._known_facts(rid)
        if known is None:
            return not_found(rid, self.where)
        if bootstrap_room is not None and bootstrap_room != known.bootstrap_room:
            return room_mismatch(rid, known.bootstrap_room, self.where)
        if known.health_check:
            return health_check(rid, known.bootstrap_room)
        caps = self.capabilities
        if caps is not None and not caps.levers:
            return unsupported(rid, caps.note)
        order = ForceFailOrder(rid, bootstrap_room, reason, dry_run, prefill_stopped)
        with self._enqueue_lock:
            pending = len(self._orders)
            if pending >= self.max_pending_orders:
                return too_many_orders(rid, pending)
            self._orders.append(order)
        timeout = self.order_timeout
        outcome = order.wait(timeout)
        if outcome is not None:
            return outcome
        # Withdrawn: take it out now rather than leave it to the next pass,
        # which may be far off while the scheduler loop is stuck.
        try:
            self._orders.remove(order)
        except (ValueError, IndexError):
            pass  # the scheduler thread popped it first (and skips it: it is withdrawn)
        return unresponsive(rid, timeout)

    def wedge_order(self, transfer_queue, chunk, ttl, min_age, reason, dry_run):
        """POST /admin/wedge_order, on the HTTP thread: wedge.py holds the orders, the scheduler thread applies them."""
        workers = self.workers
        if workers is None:
            return _no_wedge_orders(f"this SGLang's {self.identity.backend} KV manager has no transfer worker "
                                    "queues that the plugin watches (transfer_progress is false)")
        caps = self.capabilities
        if caps is not None and not caps.levers:
            return _no_wedge_orders(f"no lever releases a request on this SGLang version and backend: {caps.note}",
                                    caps.note)
        if transfer_queue >= len(workers):
            return Outcome(404, {"result": "not_found", "failed": [],
                                 "error": f"no transfer queue {transfer_queue}: this KV manager has {len(workers)}"})
        levers = caps.levers if caps is not None else ()
        return self.wedges.order(
            workers, transfer_queue, chunk, ttl, min_age, reason, dry_run,
            lambda: would_fail(listed_rooms(self.snapshot), transfer_queue, min_age, levers, time.perf_counter()))

    def _known_facts(self, rid):
        """The facts of the latest observation of this rid (rid, bootstrap_room, health_check), or None."""
        return next((facts for _, facts, *_ in listed_rooms(self.snapshot) if facts.rid == rid), None)

    def restart_target(self):
        """SGLang's launcher to signal (process_tree.serving_top), refused if this process was re-parented."""
        target = self.find_restart_target()
        if target.ok and len(target.chain) > 1 and target.chain[1] != self.parent_pid:
            return process_tree.Target(None, None, "", target.chain,
                                       f"this process's parent changed since load (was pid {self.parent_pid}, now "
                                       f"pid {target.chain[1]}): SGLang's launcher is gone")
        return target

    def restart(self, pid, dry_run):
        """Decides a restart order (the HTTP handler sends the answer, then calls end_process)."""
        me = os.getpid()
        if pid != me:
            return Outcome(409, {"result": "pid_mismatch", "pid": me,
                                 "error": f"pid {pid} is not this process (pid {me}); it may have restarted already"})
        target = self.restart_target()
        if not target.ok:
            return Outcome(501, {"result": "restart_unsupported", "pid": me, "signal_target": target.json(),
                                 "error": f"a restart would not end SGLang's server: {target.reason}"})
        self._restart_target = target
        if dry_run:
            return Outcome(200, {"result": "would_restart", "pid": me, "signal_target": target.json()})
        return Outcome(202, {"result": "restarting", "pid": me, "signal_target": target.json()})

    def end_process(self, reason):
        """Ends SGLang's server on this node as its own child-failure path does, then this process.

        SIGQUIT to SGLang's launcher (the top of the tree: the HTTP server and
        tokenizer manager, found by restart_target; under DP the scheduler's
        parent is the DataParallelController, which has no SIGQUIT handler),
        whose handler kills the whole process tree; then exit status 1
        (os._exit: this runs on a listener thread) so that the orchestrator
        restarts the server.
        """
        target = getattr(self, "_restart_target", None)
        if target is None or not target.ok:
            target = self.restart_target()
        logger.error("sglang-watchdog plugin ends SGLang's server on request: %s (%s to pid %s, the top of its "
                     "process tree, then exit status 1)", reason or "no reason given",
                     signal.Signals(target.signal).name if target.ok else "no signal", target.pid)
        try:
            if target.ok and target.pid != os.getpid():
                self.kill(target.pid, target.signal)
        except OSError as e:
            logger.error("cannot signal process %d: %s", target.pid, e)
        finally:
            self.exit(1)


def _no_wedge_orders(error, lever_note=None):
    body = {"result": "unsupported", "failed": [], "error": f"no wedge order can stand here: {error}"}
    if lever_note:
        body["lever_note"] = lever_note
    return Outcome(501, body)
