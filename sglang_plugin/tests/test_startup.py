import enum
import sys
import types
import unittest
from unittest import mock

import sglang_watchdog_plugin
from sglang_watchdog_plugin import config, hook
from sglang_watchdog_plugin.identity import identify
from sglang_watchdog_plugin.monitor import Monitor

from . import harness, standins


class DisaggregationMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class ListenerPlacementTest(unittest.TestCase):
    def run_one_pass(self, scheduler, env):
        loop, monitor = harness.start_loop(scheduler, env)
        loop.stop()
        if monitor is not None:
            self.addCleanup(monitor.close)
        return monitor

    def test_port_mapping_dp2_pp2(self):
        base = harness.free_ports(4)
        env = harness.plugin_env(SGLANG_WATCHDOG_PLUGIN_PORT=str(base))
        expected = {(0, 0): base, (0, 1): base + 1, (1, 0): base + 2, (1, 1): base + 3}
        for (dp, pp), port in expected.items():
            s = standins.NewScheduler(mode=DisaggregationMode.PREFILL, dp_rank=dp, pp_rank=pp, pp_size=2,
                                      tp_rank=4 * dp + pp, attn_tp_rank=0)
            monitor = self.run_one_pass(s, env)
            self.assertEqual(monitor.listener.port, port, (dp, pp))
            status, listing = harness.Client(port).get_json()
            self.assertEqual((listing["server"]["dp_rank"], listing["server"]["pp_rank"]), (dp, pp))
            self.assertEqual(listing["server"]["tp_rank"], 4 * dp + pp)

    def test_old_layout_with_dp_rank_none(self):
        base = harness.free_ports(1)
        s = standins.OldScheduler(dp_rank=None, tp_rank=0, attn_tp_rank=0)
        s.disagg_prefill_inflight_queue = [standins.Req("r", 1, standins.MooncakeKVSender(standins.KVManager(), 1))]
        monitor = self.run_one_pass(s, harness.plugin_env(SGLANG_WATCHDOG_PLUGIN_PORT=str(base)))
        self.assertEqual(monitor.listener.port, base)

    def test_only_prefill_attention_tp_leaders_listen(self):
        idle = [
            standins.NewScheduler(mode=DisaggregationMode.DECODE),
            standins.NewScheduler(mode="null"),
            standins.NewScheduler(tp_rank=1, attn_tp_rank=1),
            standins.NewScheduler(attn_cp_rank=1),
            standins.OldScheduler(tp_rank=3, attn_tp_rank=1),
        ]
        for s in idle:
            s.disagg_prefill_inflight_queue = [standins.Req("r", 1, standins.NixlKVSender(standins.KVManager(), 1))]
            self.assertIsNone(self.run_one_pass(s, harness.plugin_env()), vars(s))
            self.assertEqual(s.num_transfer_failed_reqs, 0)
        # With DP attention, tp_rank 2 can lead its attention TP group.
        leader = standins.NewScheduler(tp_rank=2, dp_rank=1, attn_tp_rank=0)
        self.assertIsNotNone(self.run_one_pass(leader, harness.plugin_env()))

    def test_disable(self):
        s = standins.NewScheduler()
        self.assertIsNone(self.run_one_pass(s, harness.plugin_env(SGLANG_WATCHDOG_PLUGIN_DISABLE="1")))

    def test_port_in_use_leaves_the_scheduler_unhooked(self):
        base = harness.free_ports(1)
        first = self.run_one_pass(standins.NewScheduler(), harness.plugin_env(SGLANG_WATCHDOG_PLUGIN_PORT=str(base)))
        self.assertIsNotNone(first)
        s = standins.NewScheduler()
        s.disagg_prefill_inflight_queue = [standins.Req("r", 1, standins.NixlKVSender(standins.KVManager(), 1))]
        with self.assertLogs("sglang_watchdog_plugin", "ERROR") as logs:
            self.assertIsNone(self.run_one_pass(s, harness.plugin_env(SGLANG_WATCHDOG_PLUGIN_PORT=str(base))))
        # The line names the port, the rank and where to read about SGLang's ports.
        self.assertIn(f"cannot listen on 127.0.0.1 port {base}", logs.output[0])
        self.assertIn("dp_rank=0 pp_rank=0", logs.output[0])
        self.assertIn('docs/deployment.md, "Ports"', logs.output[0])

    def test_default_ports_stay_out_of_sglangs_own(self):
        # SGLang's ports with its default --port 30000 (docs/deployment.md,
        # "Ports"): NCCL at --port + 100..1000 (v0.4.6 to v0.5.3), the kernel's
        # ephemeral range and ZMQ's random ports (v0.5.10 on), DP attention's
        # --port + 233 and the ports after it, the bootstrap server, and 29500,
        # the torch.distributed port of SGLang's weight-cache daemon examples.
        taken = [range(30000, 31001), range(32768, 65536), range(8998, 8999), range(29500, 29501)]
        ranks = range(config.DEFAULT_BASE_PORT, config.DEFAULT_BASE_PORT + 256)  # dp_size * pp_size up to 256
        for r in taken:
            self.assertFalse(set(ranks) & set(r), r)
        self.assertGreater(config.DEFAULT_BASE_PORT, 1024)

    def test_bad_port_setting_leaves_the_scheduler_unhooked(self):
        for value in ("http", "70000"):
            with self.assertLogs("sglang_watchdog_plugin", "ERROR"):
                monitor = self.run_one_pass(standins.NewScheduler(),
                                            harness.plugin_env(SGLANG_WATCHDOG_PLUGIN_PORT=value))
            self.assertIsNone(monitor)


class IdentityTest(unittest.TestCase):
    def test_ps_layout_wins_over_plain_attributes(self):
        s = standins.NewScheduler(mode=DisaggregationMode.PREFILL, tp_rank=5, dp_rank=2, pp_rank=1, pp_size=4,
                                  attn_tp_rank=1)
        s.tp_rank = 99
        ident = identify(s)
        self.assertEqual((ident.tp_rank, ident.dp_rank, ident.pp_rank, ident.pp_size, ident.attn_tp_rank),
                         (5, 2, 1, 4, 1))
        self.assertEqual(ident.index, 9)
        self.assertEqual(ident.mode, "prefill")

    def test_mode_by_value_or_name(self):
        class IntMode(enum.IntEnum):
            NULL = 0
            PREFILL = 1

        for mode, name in ((DisaggregationMode.PREFILL, "prefill"), (IntMode.PREFILL, "prefill"),
                           ("PREFILL", "prefill"), (None, "null"), (DisaggregationMode.DECODE, "decode")):
            self.assertEqual(identify(standins.NewScheduler(mode=mode)).mode, name, mode)

    def test_backend_from_sender_class_without_server_args(self):
        s = standins.OldScheduler()
        del s.server_args
        mgr = standins.KVManager()
        s.disagg_prefill_inflight_queue = [
            standins.Req("HEALTH_CHECK_1", 0, standins.FakeKVSender(standins.FakeKVManager())),
            standins.Req("r", 1, standins.NixlKVSender(mgr, 1)),
        ]
        self.assertEqual(identify(s).backend, "nixl")
        s.disagg_prefill_inflight_queue = []
        self.assertEqual(identify(s).backend, "unknown")


class HookShapeTest(unittest.TestCase):
    def test_arguments_and_results_pass_through(self):
        calls = []

        def original(scheduler, *args, **kwargs):
            calls.append((args, kwargs))
            return ["released"]

        s = standins.NewScheduler(mode="decode")
        self.assertEqual(hook.around_inflight_pass(original, s, ["rid-1"]), ["released"])
        self.assertEqual(hook.around_inflight_pass(original, s, rids_to_check=None), ["released"])
        self.assertIsNone(hook.around_inflight_pass(lambda scheduler: None, s))
        self.assertEqual(calls, [((["rid-1"],), {}), ((), {"rids_to_check": None})])

    def test_exceptions_of_the_original_propagate_untouched(self):
        def original(scheduler):
            raise ValueError("from SGLang")

        with self.assertRaisesRegex(ValueError, "from SGLang"):
            hook.around_inflight_pass(original, standins.NewScheduler(mode="decode"))

    def test_plugin_failures_never_reach_the_scheduler(self):
        monitor = Monitor(identify(standins.NewScheduler()))

        class Broken(standins.NewScheduler):
            @property
            def disagg_prefill_inflight_queue(self):
                raise RuntimeError("plugin-visible breakage")

            @disagg_prefill_inflight_queue.setter
            def disagg_prefill_inflight_queue(self, value):
                pass

        with self.assertLogs("sglang_watchdog_plugin", "ERROR") as logs:
            for _ in range(50):
                monitor.before_pass(Broken())
                monitor.after_pass(Broken())
        self.assertEqual(len(logs.output), 1)  # rate-limited, not once per pass

    def test_install_is_idempotent(self):
        class Mixin:
            def process_disagg_prefill_inflight_queue(self):
                return "original"

        self.assertTrue(hook.install(Mixin))
        wrapped = Mixin.process_disagg_prefill_inflight_queue
        self.assertFalse(hook.install(Mixin))
        self.assertIs(Mixin.process_disagg_prefill_inflight_queue, wrapped)
        self.assertEqual(Mixin.process_disagg_prefill_inflight_queue.__name__, "process_disagg_prefill_inflight_queue")

    def test_register_uses_the_plugin_framework(self):
        registered = []

        class HookType(enum.Enum):
            AROUND = "around"

        class HookRegistry:
            @classmethod
            def register(cls, target, fn, hook_type):
                registered.append((target, fn, hook_type))

        module = types.ModuleType("sglang.srt.plugins.hook_registry")
        module.HookRegistry, module.HookType = HookRegistry, HookType
        with mock.patch.dict(sys.modules, {"sglang.srt.plugins.hook_registry": module}):
            sglang_watchdog_plugin.register()
        self.assertEqual(registered, [
            ("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin."
             "process_disagg_prefill_inflight_queue", hook.around_inflight_pass, HookType.AROUND),
            ("sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue",
             hook.around_decode_pass, HookType.AROUND),
            ("sglang.srt.managers.scheduler_pp_mixin.SchedulerPPMixin.process_prealloc_queue",
             hook.around_pp_prealloc_pass, HookType.AROUND),
            ("sglang.srt.managers.scheduler_pp_mixin.SchedulerPPMixin.process_decode_transfer_queue",
             hook.around_pp_transfer_pass, HookType.AROUND),
        ])

    def test_register_without_sglang_only_warns(self):
        with self.assertLogs("sglang_watchdog_plugin", "WARNING"):
            sglang_watchdog_plugin.register()


if __name__ == "__main__":
    unittest.main()
