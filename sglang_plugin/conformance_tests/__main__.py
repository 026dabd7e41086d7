"""Runs the suite on the SGLang that SGLANG_SRC (or the installed package) names, then exits hard.

SGLang's NIXL bootstrap thread is not a daemon thread and never ends, so a
normal interpreter exit would wait for it for ever.
"""

import os
import sys
import unittest

if __name__ == "__main__":
    program = unittest.main(module=None, argv=[sys.argv[0], "discover", "-s", os.path.dirname(__file__),
                                               "-t", os.path.dirname(os.path.dirname(__file__))], exit=False)
    for reason in sorted({reason for _, reason in program.result.skipped}):
        print(f"conformance: skipped: {reason}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if program.result.wasSuccessful() else 1)
