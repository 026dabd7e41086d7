"""SGLang's own PD code, run on CPU with the plugin loaded: the conformance suite's harness and the user check.

Nothing here is imported by the plugin itself; it loads SGLang (from
SGLANG_SRC or the installed package) with fake transport libraries below it.
"""
