"""Decode's ABORT frame against a prefill bootstrap thread that cannot read it: refused, and proven by the aftermath.

SGLang's decode receiver ``abort()`` tells its prefill peers with an ``ABORT``
frame (``CommonKVReceiver._send_abort_notification``, ``disaggregation/common/conn.py``,
v0.5.18). Between v0.5.11 (no frame) and v0.5.18 (NIXL's
``_handle_abort_notification``) SGLang shipped the frame with a NIXL prefill
bootstrap thread that has no branch for it: the thread asserts ("First message
should be b'NixlMsgGuard'. Foreign traffic?") and dies, and no request
bootstraps on that prefill rank again.

That release range is not at hand; its shape is derived here from the
release's own code, as test_decode.py derives v0.5.14's: the manager's
``_start_bootstrap_thread`` without its ABORT branch (the ``if`` whose test
compares with the frame or calls a method that does), everything else
SGLang's. On releases whose receiver sends no frame there is no such shape.

Played with SGLang's own managers, bootstrap server and threads:
* SGLang's own abort (what ``abort_request`` does on decode) kills the
  prefill bootstrap thread there: the aftermath check sees it, and the
  prefill plugin lists the thread dead;
* the plugin refuses a decode release that would send the frame (``501``)
  for a transfer-queue request with ``prefill_stopped`` and for a prealloc
  request waiting for memory, and SGLang serves afterwards;
* a broken plugin copy that releases anyway is caught by the aftermath check;
* on the release's own code (the frame read) the same releases are done and
  SGLang serves afterwards.
"""

import ast
import inspect
import linecache
import textwrap
import time
import unittest

from sglang_watchdog_plugin import decode_capabilities, decode_orders, kv_threads
from sglang_watchdog_plugin.conformance import aftermath, decode_bench, transports
from sglang_watchdog_plugin.conformance import bench as bench_module
from sglang_watchdog_plugin.conformance.scheduler import _until

from . import test_decode, test_prefill

_rooms = iter(range(400000, 500000))


def setUpModule():
    test_prefill.setUpModule()
    if test_decode._RT is None:
        test_decode.setUpModule()


class _FrameBranchOut(ast.NodeTransformer):
    """Takes out of a bootstrap thread every ``if`` that reads the ABORT frame."""

    def __init__(self, cls):
        self.cls, self.removed = cls, 0

    def visit_If(self, node):
        self.generic_visit(node)
        if _reads_frame(node.test, self.cls):
            self.removed += 1
            return node.orelse or ast.Pass()
        return node


def _reads_frame(test, cls):
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and any(isinstance(s, ast.Constant) and s.value in (b"ABORT", "ABORT")
                                                 for s in (node.left, *node.comparators)):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
            if decode_capabilities._reaches_frame(cls, getattr(cls, node.func.attr, None), compared=True):
                return True
    return False


def frameless_bootstrap(manager_cls):
    """{method name: the method without its ABORT branch} for the manager's methods that start its bootstrap thread;
    empty where none has such a branch."""
    shaped = {}
    for fn in decode_capabilities.bootstrap_starters(manager_cls):
        fn = inspect.unwrap(fn)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError):
            continue
        shaper = _FrameBranchOut(manager_cls)
        tree = ast.fix_missing_locations(shaper.visit(tree))
        if not shaper.removed:
            continue
        source = ast.unparse(tree) + "\n"
        filename = f"<ABORT-less shape of {manager_cls.__name__}.{fn.__name__} from {inspect.getsourcefile(fn)}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        namespace = {}
        exec(compile(source, filename, "exec"), fn.__globals__, namespace)
        shaped[fn.__name__] = namespace[fn.__name__]
    return shaped


def install_frameless_shape(case, backend):
    """Puts the ABORT-less bootstrap thread on the backend's manager class for the test's duration (put back by
    the test's clean-up); skips the test where the receiver sends no frame or no such branch exists."""
    rt = test_prefill._RT
    conn = rt.conns.get(backend)
    if conn is None:
        case.skipTest(f"no {backend} backend in this release")
    manager_cls = bench_module.sch.runtime_module._class_named(conn, f"{backend}kvmanager")
    receiver_cls = bench_module.sch.runtime_module._class_named(conn, f"{backend}kvreceiver")
    if decode_capabilities._reaches_frame(receiver_cls, getattr(receiver_cls, "abort", None),
                                          compared=False) is not True:
        case.skipTest(f"{receiver_cls.__name__}.abort() sends prefill no ABORT frame in this release: "
                      "nothing can be killed by it")
    shaped = frameless_bootstrap(manager_cls)
    if not shaped:
        case.skipTest(f"{manager_cls.__name__}'s bootstrap thread has no ABORT branch to take out")
    for name, fn in shaped.items():
        # Set on the manager class itself, over whichever class of its MRO defined it, and put back.
        had = name in vars(manager_cls)
        original = vars(manager_cls).get(name)
        setattr(manager_cls, name, fn)
        case.addCleanup(setattr, manager_cls, name, original) if had else case.addCleanup(delattr, manager_cls, name)
    decode_capabilities._abort_frame_problems.clear()
    case.addCleanup(decode_capabilities._abort_frame_problems.clear)


class _Shaped(aftermath.Checked):
    """A bench whose managers run the release's bootstrap thread without its ABORT branch."""

    backend = None
    shaped = True

    def setUp(self):
        rt = test_prefill._RT
        self.rt = rt
        if self.shaped:
            install_frameless_shape(self, self.backend)
        elif rt.conns.get(self.backend) is None:
            self.skipTest(f"no {self.backend} backend in this release")
        else:
            receiver_cls = bench_module.sch.runtime_module._class_named(rt.conns[self.backend],
                                                                        f"{self.backend}kvreceiver")
            if decode_capabilities._reaches_frame(receiver_cls, getattr(receiver_cls, "abort", None),
                                                  compared=False) is not True:
                self.skipTest(f"{receiver_cls.__name__}.abort() sends prefill no ABORT frame in this release")
        self.bench = self.make_bench(rt)
        self.bench.start()
        self.addCleanup(self.bench.stop)
        self.watch_aftermath(self.bench)

    def tearDown(self):
        self.check_aftermath()

    def room(self):
        return next(_rooms)


class _OwnAbort(_Shaped):
    """SGLang's own abort on the shape: the control, and the plugin's listing of the dead thread."""

    def make_bench(self, rt):
        return bench_module.Bench(rt, self.backend)

    def test_sglangs_own_abort_kills_the_prefill_bootstrap_thread(self):
        req = self.bench.admit(self.room(), transports.HANG)
        receiver = self.bench.links[req.rid].receiver
        self.assertIsNotNone(getattr(receiver, "bootstrap_infos", None), "the receiver knows no prefill peer")
        receiver.abort()  # what Scheduler.abort_request calls on decode
        bootstrap = [t for manager, t in self._aftermath.threads
                     if t.role == kv_threads.BOOTSTRAP and manager == type(self.bench.prefill_mgr).__name__]
        self.assertTrue(bootstrap, "no prefill bootstrap thread was found")
        _until(lambda: not bootstrap[0].thread.is_alive(), 10, "the prefill bootstrap thread to die of the frame")
        listed = self.bench.listing()["kv_threads"]
        self.assertIn({"role": "bootstrap", "function": bootstrap[0].function, "alive": False}, listed)
        problems = aftermath.check(self._aftermath, serve=True)
        text = "; ".join(problems)
        for what in ("died: ", "bootstrap thread", "an exception escaped", "could not be bootstrapped"):
            self.assertIn(what, text)
        self.sglang_breaks_itself("SGLang's own abort_request kills the prefill bootstrap thread on this shape")


class _Release(_Shaped):
    """The plugin's decode release on a decode bench whose prefill peer runs the shape (or the release's code)."""

    def make_bench(self, rt):
        return decode_bench.DecodeBench(rt, self.backend)

    def setUp(self):
        super().setUp()
        self.levers = self.bench.listing()["server"]["levers"]
        if not self.levers:
            self.skipTest(f"no decode lever here: {self.bench.listing()['server']['lever_note']}")

    def transfer_request(self):
        req = self.bench.admit(self.room(), transports.HANG)
        time.sleep(0.2)
        self.assertEqual(self.bench.queue_of(req.rid), "transfer")
        return req

    def prealloc_request(self):
        req = self.bench.admit_prealloc(self.room())
        _until(lambda: (self.bench.listed(req.rid) or {}).get("poll") == "WaitingForInput", 10, "the handshake")
        decode_req = next(d for d in self.bench.scheduler.disagg_decode_prealloc_queue.queue if d.req.rid == req.rid)
        self.assertIsNotNone(getattr(decode_req.kv_receiver, "bootstrap_infos", None))
        return req

    def release(self, req, queue):
        return self.bench.force_fail(req, prefill_stopped=True) if queue == "transfer" else self.bench.force_fail(req)

    def requests(self):
        """A transfer-queue request (prefill may be writing: released with prefill_stopped) and a prealloc one
        waiting for memory, both knowing their prefill peer."""
        return (("transfer", self.transfer_request()), ("prealloc", self.prealloc_request()))


class _RefusedOnShape(_Release):
    def test_release_that_would_send_the_frame_is_refused_and_sglang_serves(self):
        for queue, req in self.requests():
            status, body = self.release(req, queue)
            self.assertEqual((status, body["result"]), (501, "unsupported"), (queue, body))
            self.assertIn("ABORT frame", body["error"])
            time.sleep(0.2)
            self.assertEqual(self.bench.queue_of(req.rid), queue, "a refused order changed something")
            status, body = self.bench.force_fail(req, dry_run=True, prefill_stopped=True)
            self.assertEqual((status, body["result"]), (501, "unsupported"), "a dry run promised a release")

    def test_broken_plugin_copy_that_releases_anyway_is_caught(self):
        """The aftermath check's own proof: a plugin without the refusal flips, and SGLang stops serving."""
        real = decode_orders.abort_frame_problem
        decode_orders.abort_frame_problem = lambda receiver_cls, manager_cls: ""
        self.addCleanup(setattr, decode_orders, "abort_frame_problem", real)
        req = self.prealloc_request()
        status, body = self.bench.force_fail(req)
        self.assertEqual((status, body["result"]), (200, "flipped"), body)
        problems = aftermath.check(self._aftermath, serve=True)
        text = "; ".join(problems)
        for what in ("could not be bootstrapped", "bootstrap thread", "an exception escaped"):
            self.assertIn(what, text, "the aftermath check missed what the frame did to prefill")
        self.sglang_breaks_itself("the broken plugin copy's frame killed the prefill bootstrap thread")


class _DoneOnRelease(_Release):
    shaped = False

    def test_release_is_done_and_sglang_serves(self):
        for queue, req in self.requests():
            status, body = self.release(req, queue)
            self.assertEqual((status, body["result"]), (200, "flipped"), (queue, body))
            _until(lambda: not self.bench.queued(req.rid), 10, "SGLang's pass to let the request go")


class _DecodeScenesOnShape:
    """test_decode.py's scenes, every one, with prefill's bootstrap thread in the ABORT-less shape: what they
    expect there follows from the plugin's reading of the frame (test_decode's frame_problem)."""

    def setUp(self):
        install_frameless_shape(self, self.backend)
        super().setUp()
        self.assertTrue(self.frame_problem, "the plugin does not see the shape's hazard")


def _classes():
    for backend in ("nixl", "mooncake"):
        for base in (_OwnAbort, _RefusedOnShape, _DoneOnRelease):
            name = f"{base.__name__.strip('_')}{backend.capitalize()}"
            yield name, type(backend.capitalize(), (base, unittest.TestCase), {"backend": backend,
                                                                              "__qualname__": name})


def _decode_scenes():
    # NIXL: the backend whose prefill shipped without the branch. Named as test_decode's, so that the suite's
    # runner picks it for its backend.
    base = test_decode.Nixl
    yield "DecodeScenesOnShapeNixl", type("Nixl", (_DecodeScenesOnShape, base), {"__qualname__": "DecodeScenesOnShapeNixl"})


for _name, _cls in [*_classes(), *_decode_scenes()]:
    globals()[_name] = _cls
del _name, _cls
