"""Which process to signal so that a restart ends SGLang's whole serving tree on this node.

SGLang's launcher (the process that runs the HTTP server and the tokenizer
manager, or the program that owns an ``Engine``) starts every other process
of the server with multiprocessing's *spawn* method (``mp.set_start_method
("spawn", force=True)`` in ``entrypoints/engine.py``, v0.4.6 to v0.5.18):
schedulers directly when ``dp_size == 1``, else a DataParallelController
that starts them, plus the detokenizer. The launcher installs a SIGQUIT
handler that kills its whole process tree (``kill_process_tree``); the
DataParallelController installs none, so SIGQUIT to a scheduler's parent
under DP kills only the controller, and the front end stays up (answering
with no backend) unless the release has a subprocess watchdog.

So the target is found by structure, not by release: walk up from this
process's parent through the spawned children (their command line carries
``--multiprocessing-fork``, or repeats their parent's under the fork
method) to the first ancestor that was not spawned that way: SGLang's
launcher. It is signalled with SIGQUIT only when it catches SIGQUIT (the
``SigCgt`` mask of ``/proc/PID/status``), which is how SGLang's handler is
seen from outside; otherwise there is no way known here to end the tree and
the restart is refused with the reason.
"""

import os
import signal

SPAWN_MARKERS = ("--multiprocessing-fork", "multiprocessing.spawn", "multiprocessing.forkserver")


class Target:
    """Where a restart's signal goes: ``pid`` (None: nowhere) and why."""

    def __init__(self, pid, sig, process, chain, reason=""):
        self.pid, self.signal, self.process, self.chain, self.reason = pid, sig, process, chain, reason

    @property
    def ok(self):
        return self.pid is not None

    def json(self):
        out = {"chain": self.chain}
        if self.ok:
            out.update(pid=self.pid, signal=signal.Signals(self.signal).name, process=self.process)
        else:
            out["reason"] = self.reason
        return out


def _read(proc, pid):
    """(ppid, cmdline words, SIGQUIT caught) of pid, or None when unreadable."""
    try:
        with open(os.path.join(proc, str(pid), "status")) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as f:
            words = [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
        ppid = int(fields["PPid"].strip())
        caught = int(fields.get("SigCgt", "0").strip(), 16)
    except (OSError, ValueError, KeyError):
        return None
    return ppid, words, bool(caught & (1 << (signal.SIGQUIT - 1)))


def _spawned(words, parent_words):
    line = " ".join(words)
    return any(marker in line for marker in SPAWN_MARKERS) or (parent_words is not None and words == parent_words)


def _short(words):
    line = " ".join(words)
    return line if len(line) <= 160 else line[:157] + "..."


def serving_top(pid=None, proc="/proc", max_depth=16):
    """The launcher of the SGLang tree this process belongs to, as a Target (pid None with a reason if not found)."""
    pid = os.getpid() if pid is None else pid
    me = _read(proc, pid)
    if me is None:
        return Target(None, None, "", [pid], f"cannot read {proc}/{pid}: the process tree is not visible here")
    chain = [pid]
    child_words = me[1]
    current = me[0]
    for _ in range(max_depth):
        if current <= 0:
            break
        info = _read(proc, current)
        if info is None:
            return Target(None, None, "", chain, f"cannot read {proc}/{current} (an ancestor of this process)")
        ppid, words, catches_quit = info
        chain.append(current)
        parent = _read(proc, ppid) if ppid > 0 else None
        if _spawned(words, parent[1] if parent else None) and current != 1:
            child_words = words
            current = ppid
            continue
        # The first ancestor not started by multiprocessing: SGLang's launcher.
        if catches_quit:
            return Target(current, signal.SIGQUIT, _short(words), chain)
        return Target(None, None, _short(words), chain,
                      f"the top of this process tree (pid {current}: {_short(words)}) does not handle SIGQUIT, so "
                      "no signal known here ends SGLang's whole server (SGLang installs its handler only when it "
                      "is launched from the main thread); exiting this scheduler alone would leave the front end "
                      "up")
    del child_words
    return Target(None, None, "", chain, "no launcher found above this process")
