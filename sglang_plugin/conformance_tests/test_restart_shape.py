"""What the plugin's restart relies on, read from this SGLang's own source (no import needed).

POST /admin/restart signals the first ancestor not started by
multiprocessing (process_tree.serving_top), if it catches SIGQUIT. That is
right only while SGLang's launcher (entrypoints/engine.py) starts its
processes with the spawn method and installs a SIGQUIT handler that kills
its process tree, and the DataParallelController, which starts the
schedulers under DP, installs none. tests/test_process_tree.py runs process
trees of that shape; this suite checks the shape on each release.
"""

import ast
import os
import unittest

from sglang_watchdog_plugin.conformance import loader


def _tree(folder, *parts):
    path = os.path.join(folder, *parts)
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read()), path


def _calls(tree, name):
    """Calls whose function is spelled ...name (an attribute or a plain name)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            if (isinstance(fn, ast.Attribute) and fn.attr == name) or (isinstance(fn, ast.Name) and fn.id == name):
                yield node


def _is_sigquit(node):
    return isinstance(node, ast.Attribute) and node.attr == "SIGQUIT"


class LauncherShape(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        try:
            cls.folder = loader.use_source()
        except (FileNotFoundError, ModuleNotFoundError) as e:
            raise unittest.SkipTest(f"no SGLang source to read: {e}")
        cls.engine, cls.engine_path = _tree(cls.folder, "srt", "entrypoints", "engine.py")

    def test_the_launcher_spawns_its_processes(self):
        methods = [c.args[0].value for c in _calls(self.engine, "set_start_method")
                   if c.args and isinstance(c.args[0], ast.Constant)]
        self.assertIn("spawn", methods, f"{self.engine_path}: no set_start_method('spawn')")

    def test_the_launcher_kills_its_tree_on_sigquit(self):
        handlers = {c.args[1].id for c in _calls(self.engine, "signal")
                    if len(c.args) == 2 and _is_sigquit(c.args[0]) and isinstance(c.args[1], ast.Name)}
        self.assertTrue(handlers, f"{self.engine_path}: no SIGQUIT handler installed")
        killing = [fn.name for fn in ast.walk(self.engine) if isinstance(fn, ast.FunctionDef) and fn.name in handlers
                   and any(True for _ in _calls(fn, "kill_process_tree"))]
        self.assertTrue(killing, f"{self.engine_path}: the SIGQUIT handler ({handlers}) does not kill the tree")

    def test_the_data_parallel_controller_has_no_sigquit_handler_and_starts_the_schedulers(self):
        tree, path = _tree(self.folder, "srt", "managers", "data_parallel_controller.py")
        installed = [c for c in _calls(tree, "signal") if len(c.args) == 2 and _is_sigquit(c.args[0])]
        self.assertEqual(installed, [], f"{path} installs a SIGQUIT handler now: signalling it may end the tree; "
                                        "revisit process_tree")
        self.assertTrue(any(True for _ in _calls(tree, "Process")), f"{path}: starts no process")


if __name__ == "__main__":
    unittest.main()
