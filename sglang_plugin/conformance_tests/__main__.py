"""Runs the suite on the SGLang that SGLANG_SRC (or the installed package) names, then exits hard.

    python3 -m conformance_tests [nixl|mooncake|other]

With an argument, only that backend's test classes run (``other``: the ones
of no backend). scripts/conformance.sh runs each in a process of its own:
SGLang keeps sockets and threads in class-level state (the receivers'
socket caches, the managers' bootstrap threads), and on the oldest releases
one backend's leftovers stop the other's handshakes in the same process.

SGLang's NIXL bootstrap thread is not a daemon thread and never ends, so a
normal interpreter exit would wait for it for ever.
"""

import os
import sys
import unittest

BACKENDS = ("nixl", "mooncake", "ascend")


def _tests(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _tests(item)
        else:
            yield item


def _selected(suite, which):
    def backend_of(test):
        name = type(test).__name__.lower()
        return name if name in BACKENDS else "other"

    # Failed imports surface as _FailedTest: keep them, so that they fail the run.
    return unittest.TestSuite(t for t in _tests(suite)
                              if which is None or backend_of(t) == which or type(t).__name__ == "_FailedTest")


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else None
    if which not in (None, "other") + BACKENDS:
        sys.exit(f"usage: python3 -m conformance_tests [{'|'.join(BACKENDS)}|other]")
    here = os.path.dirname(os.path.abspath(__file__))
    suite = unittest.defaultTestLoader.discover(here, top_level_dir=os.path.dirname(here))
    result = unittest.TextTestRunner(verbosity=1).run(_selected(suite, which))
    for reason in sorted({reason for _, reason in result.skipped}):
        print(f"conformance: skipped: {reason}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result.wasSuccessful() else 1)
