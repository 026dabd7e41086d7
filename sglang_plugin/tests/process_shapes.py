"""Process trees shaped like SGLang's, for tests/test_process_tree.py (no SGLang, loopback-free).

    python3 process_shapes.py SHAPE OUTDIR

SHAPE is ``dp1`` (launcher -> scheduler), ``dp2`` (launcher ->
DataParallelController -> scheduler), ``nohandler`` (dp2 with a launcher that
installs no SIGQUIT handler, as SGLang when its Engine is not started from
the main thread) or ``dp2-parent`` (dp2 where the scheduler signals its
parent, as the plugin did before). Like SGLang, every child is started with
multiprocessing's spawn method; the launcher's SIGQUIT handler kills its
whole tree (SGLang: kill_process_tree), the controller has no handler. The
scheduler writes the target process_tree.serving_top finds to
OUTDIR/target.json, then (except for ``nohandler``) signals it and exits 1,
as the plugin's end_process does.
"""

import json
import multiprocessing
import os
import resource
import signal
import sys
import time

_PLUGIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(outdir, name, value):
    path = os.path.join(outdir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def scheduler(shape, outdir):
    sys.path.insert(0, _PLUGIN)
    from sglang_watchdog_plugin import process_tree

    _write(outdir, "scheduler.json", os.getpid())
    target = process_tree.serving_top()
    _write(outdir, "target.json", target.json())
    if shape == "dp2-parent":
        os.kill(os.getppid(), signal.SIGQUIT)
        os._exit(1)
    if target.ok:
        os.kill(target.pid, target.signal)
        os._exit(1)
    while True:
        time.sleep(1)


def controller(shape, outdir):
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGQUIT's default action dumps core
    _write(outdir, "controller.json", os.getpid())
    child = multiprocessing.get_context("spawn").Process(target=scheduler, args=(shape, outdir))
    child.start()
    child.join()
    while True:  # SGLang's controller keeps running its event loop
        time.sleep(1)


def main():
    shape, outdir = sys.argv[1], sys.argv[2]
    os.setpgrp()
    if shape != "nohandler":
        signal.signal(signal.SIGQUIT, lambda signum, frame: os.killpg(0, signal.SIGKILL))
    _write(outdir, "launcher.json", os.getpid())
    spawn = multiprocessing.get_context("spawn")
    child = spawn.Process(target=scheduler if shape == "dp1" else controller, args=(shape, outdir))
    child.start()
    while True:  # SGLang's launcher serves HTTP for ever
        time.sleep(1)


if __name__ == "__main__":
    main()
