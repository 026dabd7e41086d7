"""The user check: which levers release a stuck request on *this* SGLang, before ``--force-fail.mode=auto``.

    python3 -m sglang_watchdog_plugin.conformance.check            # the installed sglang
    SGLANG_SRC=DIR python3 -m sglang_watchdog_plugin.conformance.check   # a source tree (DIR/python/sglang)

Run it on the machine where the SGLang you serve with is installed; no GPU
is needed. It loads that SGLang's own PD code on CPU (``Runtime``), brings up
a prefill scheduler whose inflight pass is SGLang's own, with the plugin
loaded the way that release loads plugins (``Bench``), over fake NIXL and
Mooncake libraries whose transfers it controls, and plays per backend:

* a stuck transfer (a handle that never completes) and the plugin's
  force-fail: released (left the queue with an abort, KV and metadata slot
  handed back), an honest ``501 unsupported``, or anything else;
* a second stuck transfer and SGLang's own abort (the ``sender.abort()``
  that its ``Scheduler.abort_request`` calls for a request in the inflight
  queue, where that release's ``abort_request`` does so);
* a healthy transfer: SGLang completes it, the plugin must not touch it;
* a health check request: the plugin must refuse it.

It prints one table per backend and a verdict line each. Exit status 0
when the check ran (whatever it found), 2 when it could not run (no
SGLang, SGLang's PD code does not load, or it did not finish in time).
Nothing leaves the machine: every socket is on 127.0.0.1.
"""

import argparse
import ast
import glob
import os
import sys
import threading
import time
import traceback

from . import aftermath, loader, runtime, transports

FLAG = "--force-fail.mode=auto"
_ROOMS = iter(range(70000, 80000))


class Result:
    def __init__(self, backend):
        self.backend = backend
        self.rows = []  # (check, outcome text)
        self.levers = None
        self.lever_note = ""
        self.lever_released = None  # True, False (honest 501) or None (could not tell)
        self.abort_released = None
        self.healthy_ok = None
        self.health_check_ok = None
        self.errors = []  # what went wrong, in words
        self.scheduler_errors = []
        self.aftermath = None  # the aftermath check's problems after the plugin's force-fail ([]: serves as before)
        self.decode_abort_problem = ""  # why a decode release that would send prefill an ABORT frame is refused
        self.absent = None  # why this SGLang has no such backend, where it has none

    @classmethod
    def unavailable(cls, backend, why):
        res = cls(backend)
        res.absent = why
        res.row("not checked", why)
        return res

    def row(self, check, text):
        self.rows.append((check, text))

    def verdict(self):
        b = self.backend
        if self.absent:
            return f"nothing to turn on for {b}: {self.absent}"
        if self.errors:
            return f"NOT safe to turn {FLAG} on for {b}: the check could not finish ({self.errors[0]})"
        if self.scheduler_errors:
            return (f"NOT safe to turn {FLAG} on for {b}: SGLang's inflight pass raised "
                    f"({self.scheduler_errors[0]!r}); a real scheduler would have died")
        if self.aftermath:
            return (f"NOT safe to turn {FLAG} on for {b}: after the plugin's force-fail SGLang no longer serves as "
                    f"before ({self.aftermath[0]})")
        if not self.healthy_ok:
            return f"NOT safe to turn {FLAG} on for {b}: a healthy transfer was not left to SGLang"
        if not self.health_check_ok:
            return f"NOT safe to turn {FLAG} on for {b}: a health check request was not refused"
        if self.lever_released is True:
            # What the check proves is the lever, not the rules: a healthy transfer slower than the
            # deadline still looks stuck to them (README, "Limits").
            decode = (f"; decode releases of requests that know their prefill peers are refused here "
                      f"(501: {self.decode_abort_problem})" if self.decode_abort_problem else "")
            return (f"safe to turn {FLAG} on for {b} as far as the levers go: keep --watchdog.deadline "
                    f"above your slowest healthy KV transfer (README, Limits){decode}")
        if self.lever_released is False:
            return (f"no use turning {FLAG} on for {b}: the plugin has no lever here and answers "
                    f"501 unsupported (harmless, but nothing is released; alerts and restarts only)")
        return f"NOT safe to turn {FLAG} on for {b}: the force-fail did not end as released or unsupported"


def _reason_name(reason):
    return type(reason).__name__ if reason is not None else "none"


def _wait(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def _released_fully(bench, req):
    """The release SGLang's pass makes: an abort, streamed, KV pages and metadata slot handed back."""
    reason = bench.released(req.rid)
    parts = [f"left the queue as {_reason_name(reason)}"]
    ok = _reason_name(reason) == "FINISH_ABORT"
    if req.rid in bench.scheduler.tree_cache.released:
        parts.append("KV pages handed back")
    else:
        ok = False
        parts.append("KV pages NOT handed back")
    if req.metadata_buffer_index == -1:
        parts.append("metadata slot handed back")
    else:
        ok = False
        parts.append("metadata slot NOT handed back")
    return ok, ", ".join(parts)


def abort_reaches_inflight_queue(folder):
    """Whether this release's ``Scheduler.abort_request`` calls ``abort()`` on requests of the inflight queue."""
    return abort_reaches(folder, "disagg_prefill_inflight_queue")


def abort_reaches(folder, queue_attr):
    """Whether this release's ``Scheduler.abort_request`` calls ``abort()`` on requests of that queue.

    Read from the source of the installed SGLang (no import of the scheduler,
    which needs the GPU stack): the function's body names the queue's
    attribute and calls ``.abort()``. None when the function cannot be found
    or read.
    """
    for path in glob.glob(os.path.join(folder, "srt", "managers", "*.py")):
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name.startswith("Scheduler"):
                for fn in node.body:
                    if isinstance(fn, ast.FunctionDef) and fn.name == "abort_request":
                        names = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
                        return queue_attr in names and "abort" in names
    return None


def check_backend(rt, backend, abort_reached, timeout):
    from . import bench as bench_module

    res = Result(backend)
    try:
        bench = bench_module.Bench(rt, backend).start()
    except Exception as e:
        res.errors.append(f"SGLang's {backend} KV manager or the plugin did not come up: {type(e).__name__}: {e}")
        res.row("could not run", res.errors[0])
        return res
    try:
        server = bench.listing()["server"]
        res.levers = list(server.get("levers") or [])
        res.lever_note = server.get("lever_note") or ""
        res.row("levers found", ",".join(res.levers) if res.levers else f"none ({res.lever_note or 'no reason given'})")
        before = aftermath.Before(bench)
        _healthy(bench, res, timeout)
        _health_check(bench, res, timeout)
        _stuck_lever(bench, res, timeout)
        res.aftermath = aftermath.check(before)
        res.row("afterwards", "; ".join(res.aftermath) + "  <- unexpected" if res.aftermath else
                "SGLang serves a new request end to end, every thread of its KV managers alive")
        _decode_abort(rt, backend, res)
    except Exception as e:
        res.errors.append(f"{type(e).__name__}: {e}")
        res.row("error", res.errors[-1])
    finally:
        res.scheduler_errors.extend(bench.errors)
        bench.stop()
    # SGLang's own abort on a fresh bench: a hung handle holds its transfer worker, as in SGLang.
    try:
        bench = bench_module.Bench(rt, backend).start()
    except Exception as e:
        res.row("stuck request, SGLang's abort()", f"could not run: {type(e).__name__}: {e}")
        return res
    try:
        _stuck_abort(bench, res, abort_reached, timeout)
    except Exception as e:
        res.row("stuck request, SGLang's abort()", f"could not tell: {type(e).__name__}: {e}")
    finally:
        res.scheduler_errors.extend(bench.errors)
        bench.stop()
    if res.scheduler_errors:
        res.row("SGLang's inflight pass", f"RAISED {res.scheduler_errors[0]!r}")
    return res


def _decode_abort(rt, backend, res):
    """Whether the decode release would send prefill an ABORT frame its bootstrap thread cannot read (read from
    the code, as the decode plugin decides it)."""
    from .. import decode_capabilities

    conn = rt.conns[backend]
    receiver_cls = runtime._class_named(conn, f"{backend}kvreceiver")
    manager_cls = runtime._class_named(conn, f"{backend}kvmanager")
    res.decode_abort_problem = decode_capabilities.abort_frame_problem(receiver_cls, manager_cls)
    res.row("decode release, peers known", f"refused (501): {res.decode_abort_problem}"
            if res.decode_abort_problem else "offered: prefill's bootstrap thread reads the ABORT frame, or none is sent")


def _healthy(bench, res, timeout):
    req = bench.admit(next(_ROOMS), transports.COMPLETE)
    if not _wait(lambda: bench.released(req.rid) is not None, timeout):
        res.healthy_ok = False
        res.row("healthy transfer", "did NOT complete in SGLang's pass within the time allowed")
        return
    reason = _reason_name(bench.released(req.rid))
    status, body = bench.force_fail(req)
    res.healthy_ok = reason == "FINISH_LENGTH" and status == 404
    res.row("healthy transfer", f"completed by SGLang ({reason}); a force-fail afterwards: {status} {body.get('result')}"
            + ("" if res.healthy_ok else "  <- unexpected"))


def _health_check(bench, res, timeout):
    try:
        req = bench.health_check(next(_ROOMS), rid=f"HEALTH_CHECK_usercheck_{res.backend}")
    except Exception as e:
        res.health_check_ok = False
        res.row("health check request", f"could not be built on this SGLang: {type(e).__name__}: {e}")
        return
    if not _wait(lambda: bench.listed(req.rid) is not None, timeout):
        res.health_check_ok = False
        res.row("health check request", "was never listed by the plugin")
        return
    status, body = bench.force_fail(req)
    res.health_check_ok = (status, body.get("result")) == (409, "health_check") and bench.queued(req.rid)
    res.row("health check request", f"force-fail refused: {status} {body.get('result')}"
            + ("" if res.health_check_ok else "  <- unexpected"))


def _stuck_lever(bench, res, timeout):
    req = bench.admit(next(_ROOMS), transports.HANG)
    time.sleep(0.3)
    if not bench.queued(req.rid):
        res.row("stuck request, plugin force-fail", "could not tell: the hung transfer left the queue on its own")
        return
    status, body = bench.force_fail(req)
    result = body.get("result")
    if (status, result) == (200, "flipped"):
        if _wait(lambda: bench.released(req.rid) is not None, timeout):
            ok, text = _released_fully(bench, req)
            res.lever_released = True if ok else None
            res.row("stuck request, plugin force-fail", ("released: " if ok else "PARTLY released: ")
                    + f"200 flipped, {text}")
        else:
            res.row("stuck request, plugin force-fail", "200 flipped, but the request is still in the inflight queue")
    elif (status, result) == (501, "unsupported"):
        time.sleep(0.3)
        if bench.queued(req.rid):
            res.lever_released = False
            res.row("stuck request, plugin force-fail",
                    f"unsupported (501): {body.get('error') or res.lever_note or 'no reason given'}"
                    + ("" if "nothing was changed" in (body.get("error") or "") else "; nothing changed"))
        else:
            res.row("stuck request, plugin force-fail", "501 unsupported, yet the request left the queue  <- unexpected")
    else:
        res.row("stuck request, plugin force-fail", f"{status} {result}: {body.get('error', '')}  <- unexpected")


def _stuck_abort(bench, res, abort_reached, timeout):
    check = "stuck request, SGLang's abort()"
    req = bench.admit(next(_ROOMS), transports.HANG)
    time.sleep(0.3)
    if not bench.queued(req.rid):
        res.row(check, "could not tell: the hung transfer left the queue on its own")
        return
    sender = req.disagg_kv_sender
    if abort_reached is False:
        res.row(check, "not reached: this SGLang's Scheduler.abort_request does not abort requests of the "
                       "inflight queue, so a client's abort leaves it pinned")
        res.abort_released = False
        return
    if not hasattr(sender, "abort"):
        res.row(check, "unsupported: this SGLang's sender has no abort()")
        res.abort_released = False
        return
    sender.abort()
    if _wait(lambda: bench.released(req.rid) is not None, min(timeout, 3.0)):
        ok, text = _released_fully(bench, req)
        res.abort_released = ok
        res.row(check, ("released: " if ok else "PARTLY released: ") + text)
    else:
        res.abort_released = False
        res.row(check, "unsupported: sender.abort() leaves the request in the inflight queue (poll() never "
                       "reads Failed)")


def _print_report(rt, results, out):
    source = loader.loaded.source or "?"
    how = "source tree (SGLANG_SRC)" if os.environ.get("SGLANG_SRC") else "installed package"
    out.write(f"sglang-watchdog user check\n")
    version = rt.version or "version not recorded (a source tree without _version.py)"
    out.write(f"  SGLang        {version}\n")
    out.write(f"  from          {how}: {source}\n")
    out.write(f"  plugin loaded {'by sglang.srt.plugins (load_plugins, hook registry)' if rt.plugin_framework else 'by its .pth autoloader (no plugin framework in this SGLang)'}\n")
    out.write(f"  transports    fake NIXL agent, Mooncake and Ascend engines (this check moves no bytes; no GPU used)\n")
    if loader.loaded.placeholders:
        out.write(f"  stood in for  {len(loader.loaded.placeholders)} modules SGLang's PD path never calls "
                  f"(missing or too old here)\n")
    for res in results:
        out.write(f"\n{res.backend}\n")
        width = max(len(check) for check, _ in res.rows) if res.rows else 0
        for check, text in res.rows:
            out.write(f"  {check.ljust(width)}  {text}\n")
    out.write("\n")
    for res in results:
        out.write(f"verdict: {res.verdict()}\n")
    out.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m sglang_watchdog_plugin.conformance.check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", action="append", choices=runtime.BACKENDS + runtime.OPTIONAL_BACKENDS,
                        help="check only this backend (repeatable; default: nixl and mooncake; ascend on request)")
    parser.add_argument("--timeout", type=float, default=float(os.environ.get("SGLANG_WATCHDOG_CHECK_TIMEOUT", 240)),
                        help="give up after this many seconds in all (default 240)")
    args = parser.parse_args(argv)
    out = sys.stdout

    def give_up():
        sys.stderr.write(f"sglang-watchdog user check: did not finish within {args.timeout:g} s; nothing proven\n")
        sys.stderr.flush()
        os._exit(2)

    timer = threading.Timer(args.timeout, give_up)
    timer.daemon = True
    timer.start()
    # The check's own plugin settings: the operator's (token, restarts, port) must not leak in.
    for key in [k for k in os.environ if k.startswith("SGLANG_WATCHDOG_PLUGIN_")]:
        del os.environ[key]
    os.environ["SGLANG_WATCHDOG_PLUGIN_HOST"] = "127.0.0.1"
    import logging

    logging.basicConfig(level=logging.CRITICAL)  # SGLang's and the plugin's logs would drown the table
    try:
        rt = runtime.Runtime()
    except Exception as e:
        sys.stderr.write("sglang-watchdog user check: could not load SGLang's PD code here: "
                         f"{type(e).__name__}: {e}\n")
        if os.environ.get("SGLANG_WATCHDOG_CHECK_DEBUG"):
            traceback.print_exc()
        return 2
    abort_reached = abort_reaches_inflight_queue(loader.loaded.source or "")
    results = [check_backend(rt, backend, abort_reached, timeout=15) if backend not in rt.missing
               else Result.unavailable(backend, rt.missing[backend])
               for backend in (args.backend or runtime.BACKENDS)]
    _print_report(rt, results, out)
    timer.cancel()
    return 0 if any(not r.errors and not r.absent for r in results) else 2


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # SGLang's NIXL bootstrap thread is not a daemon thread and never ends
