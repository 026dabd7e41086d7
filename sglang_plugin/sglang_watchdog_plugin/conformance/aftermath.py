"""The aftermath of an action: SGLang still serves a new request, with every thread it had, and nothing escaped.

A lever that releases the request it aims at can still leave the server
worse than doing nothing: a frame that kills the prefill bootstrap thread, a
pass that raises, a worker left holding a queue. So after each scene, on the
same prefill and decode ranks (SGLang's own managers, bootstrap server and
threads), the check asks four things:

* every SGLang thread of those managers that was alive before the scene is
  alive after it (kv_threads.py finds them);
* no exception escaped an SGLang thread (``threading.excepthook``) or the
  scheduler pass (``Bench.errors``) during the scene;
* a new request goes end to end: bootstrapped through SGLang's bootstrap
  server and the prefill bootstrap thread, its KV sent, the receiver at
  ``Success``, and the scheduler releasing it as SGLang does (prefill: out
  of the inflight queue with a length finish; decode: admitted to the
  waiting queue);
* no lever freed pages under a handle still moving (the page ledger,
  transports.py): a transfer that reads (prefill) or writes (decode) pages
  SGLang handed back, because the plugin's order released the request, while
  it still moved bytes. Pages freed by a lever under a hung handle are the
  remedy for that handle, and pages SGLang frees under outstanding handles on
  its own (its abort, its failure branch) are stock behaviour: both are
  counted and printed, never a problem.

The scene's faults are lifted first (hung handles end, links at full
speed), as a link that recovers would lift them: what is checked is what the
scene's actions left behind, not the fault itself.
"""

import itertools
import threading
import time

from .. import kv_threads
from ..orders import DEFAULT_REASON
from . import transports

# Time for the new request: milliseconds on a healthy bench; generous for three releases side by side on 2 cores.
SERVE_SECONDS = 20.0

_rooms = itertools.count(3_000_000)
_lock = threading.Lock()
_escaped = []  # (thread name, exception) of every thread that died of an exception
_installed = False


def install():
    """Records exceptions that end a thread, then prints them as Python does. Idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        previous = threading.excepthook

        def hook(args):
            thread = args.thread
            with _lock:
                _escaped.append((getattr(thread, "name", "?"), args.exc_value))
            previous(args)

        threading.excepthook = hook


def escaped_since(mark):
    with _lock:
        return list(_escaped[mark:])


class Before:
    """What the scene started with: the managers' live threads, and where the exception records stood.

    ``bench``: a Bench or DecodeBench, a TP group (tp2.Tp2Group), or a list of
    PP stages, which serve one request together.
    """

    def __init__(self, bench, extra_managers=()):
        install()
        self.bench = bench
        self.stages = list(bench) if isinstance(bench, (list, tuple)) else [bench]
        seen, self.threads = set(), []
        for manager in [*(m for stage in self.stages for m in _managers(stage)), *extra_managers]:
            if id(manager) in seen:
                continue
            seen.add(id(manager))
            self.threads.extend((type(manager).__name__, t) for t in kv_threads.find(manager))
            _watch_orders(manager)
        with _lock:
            self.mark = len(_escaped)
        self.pass_errors = [len(stage.errors) for stage in self.stages]
        self.ledger_mark = transports.ledger.mark()


def _watch_orders(manager):
    """Tells the page ledger which rooms the plugin's orders fail: the plugin records its reason with the
    manager's ``record_failure`` (SGLang's own failures record theirs there too, with other reasons). Calls
    through; once per manager."""
    record = getattr(manager, "record_failure", None)
    if record is None or getattr(record, "ledger_watched", False):
        return

    def record_failure(room, reason, *args, **kwargs):
        if str(reason).startswith(DEFAULT_REASON):
            transports.ledger.order_seen(room)
        return record(room, reason, *args, **kwargs)

    record_failure.ledger_watched = True
    manager.record_failure = record_failure


def _managers(bench):
    if hasattr(bench, "prefill_mgrs"):  # a TP group: every rank's managers
        return [*bench.prefill_mgrs, *bench.decode_mgrs]
    return [bench.prefill_mgr, bench.decode_mgr, *(d.manager for d in bench.destinations.values())]


def _links(bench):
    return list(bench.links) if isinstance(bench.links, list) else list(bench.links.values())


def dead_threads(before):
    return [f"{manager} {t.role} thread ({t.function}{'' if t.transfer_queue is None else f', queue {t.transfer_queue}'})"
            for manager, t in before.threads if not t.thread.is_alive()]


def check(before, serve=True, what=None):
    """The aftermath's problems, in words; [] when SGLang is as it was and serves.

    Threads and exceptions are read after the new request, so that what an
    action set off on SGLang's threads (a frame on the way to prefill) has
    happened by then. The scene's frees under outstanding handles are printed
    (``conformance: ledger:``), named ``what``.
    """
    problems = []
    if serve:
        for stage in before.stages:
            heal(stage)
        problem = serve_new(before.stages)
        if problem:
            problems.append(problem)
    problems += [f"died: {d}" for d in dead_threads(before)]
    problems += [f"an exception escaped SGLang's thread {name}: {type(e).__name__}: {e}"
                 for name, e in escaped_since(before.mark)]
    for stage, mark in zip(before.stages, before.pass_errors):
        problems += [f"SGLang's scheduler pass raised: {type(e).__name__}: {e}" for e in stage.errors[mark:]]
    return problems + ledger_problems(before, what)


def ledger_problems(before, what=None):
    """The page ledger's verdict on the scene: a problem per lever free under a handle still moving. Prints the
    scene's counts when any free was under an outstanding handle."""
    frees, reused = transports.ledger.since(before.ledger_mark)
    if any(f.live or f.stuck for f in frees) or reused:
        print(f"\nconformance: ledger: {what or 'a scene'}: "
              f"{transports.describe_counts(transports.ledger_counts(frees, reused))}", flush=True)
    return [f"a lever freed pages under an outstanding handle that was still progressing: {f.describe()}"
            for f in frees if f.live and f.by_lever]


def assert_serves(testcase, before, what="the scene"):
    problems = check(before, what=what)
    if problems:
        testcase.fail(f"after {what}, SGLang is worse than before: " + "; ".join(problems))


def heal(bench):
    """Lifts the scene's faults: hung handles complete, links run at full speed."""
    transports.fabric.end_hangs((link.room for link in _links(bench)), transports.COMPLETE)
    transports.fabric.link_speed(0.0)
    destinations = bench.destinations
    for key in (d.key for d in destinations.values()) if isinstance(destinations, dict) else destinations:
        transports.fabric.destination_speed(key, None)


def serve_new(stages, timeout=SERVE_SECONDS):
    """A new request end to end on these ranks: "" once SGLang served it, else what went wrong.

    One request with one rid: on a bench, on every rank of a TP group, or on
    every PP stage (each stage its own room, as SGLang's PP stages have).
    """
    stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    rid = f"aftermath-{next(_rooms)}"
    deadline = time.monotonic() + timeout
    waits, receivers = [], []
    try:
        for stage in stages:
            reqs = stage.admit(next(_rooms), transports.COMPLETE, rid=rid)
            if isinstance(reqs, list):  # a TP group: each rank's share, each rank's scheduler
                waits += [(lambda r=r, g=stage: g.released(r, rid)) for r in range(len(reqs))]
                receivers += [link.receiver for link in stage.links[-len(reqs):]]
            else:
                waits.append(_outcome(stage, rid))
                receivers.append(stage.links[rid].receiver)
    except Exception as e:  # the bootstrap or the admission timed out: SGLang no longer takes requests
        return f"a new request could not be bootstrapped and sent ({type(e).__name__}: {e})"
    for outcome in waits:
        while (reason := outcome()) is None:
            if time.monotonic() > deadline:
                return f"a new request was not served within {timeout:g}s ({_where(stages, rid)})"
            time.sleep(0.01)
        if reason is not True and type(reason).__name__ != "FINISH_LENGTH":
            return f"a new request left the inflight queue as {type(reason).__name__}, not served"
    # Decode learns Success on its own thread (Mooncake: prefill's status message), after prefill let go.
    for receiver in receivers:
        while (poll := stages[0].rt.poll_names[int(receiver.poll())]) != "Success":
            if time.monotonic() > deadline:
                return f"a new request's receiver reads {poll}, not Success, {timeout:g}s on"
            time.sleep(0.01)
    return ""


def _where(stages, rid):
    """Where the request waits, per stage, in words."""
    return ", ".join(f"stage {i}: {(stage.queue_of(rid) if hasattr(stage, 'queue_of') else None) or ('inflight' if getattr(stage, 'queued', lambda r: False)(rid) else 'not queued')}"
                     for i, stage in enumerate(stages))


def _outcome(stage, rid):
    """None while the request waits; then True (decode: admitted to the waiting queue) or the finish reason."""
    if hasattr(stage, "transferred"):
        return lambda: True if stage.transferred(rid) else None
    return lambda: stage.released(rid)


class Checked:
    """A test case whose scenes are followed by the aftermath check.

    ``watch_aftermath(bench)`` once the bench runs (setUp); ``check_aftermath()``
    in tearDown. A scene that goes on to break SGLang by SGLang's own doing (its
    own abort_request where that kills the scheduler) checks the plugin's part
    with ``check_aftermath()`` before, then says why with
    ``sglang_breaks_itself(why)``; the scene itself asserts how SGLang broke.
    """

    _aftermath = None
    _breaks_itself = None
    _unserved = None

    def watch_aftermath(self, bench, extra_managers=(), unserved=None):
        """``unserved``: why this bench cannot serve a second request at all, not even with no action taken (a
        limit of the bench, stated); then only threads and exceptions are checked."""
        self._aftermath = Before(bench, extra_managers)
        self._breaks_itself = None
        self._unserved = unserved

    def sglang_breaks_itself(self, why):
        self._breaks_itself = why

    def check_aftermath(self, what=None):
        """Asserts that SGLang serves as before; once per scene, unless SGLang was said to break itself since."""
        if self._aftermath is None or self._breaks_itself is not None:
            return
        before, self._aftermath = self._aftermath, None
        what = what or self.id().rsplit(".", 1)[-1]
        if self._unserved is not None:
            problems = check(before, serve=False, what=what)
            if problems:
                self.fail(f"after {what}, SGLang is worse than before: " + "; ".join(problems))
            return
        assert_serves(self, before, what)
