// Package faults holds the watchdog's fault matrix: end-to-end tests that
// put the real watchdog, collector and plugin client against the SGLang
// simulator (sglangsim) over loopback HTTP, inject one fault at a time and
// check that the watchdog keeps running, reports the fault in its metrics
// and logs, and never force-fails a request that is still progressing
// (sglangsim's ground truth, Record.ProgressingWhenForced).
//
// The package has no code of its own: everything is in its tests.
//
//   - Faults are injected by a small HTTP handler wrapped around
//     sim.PluginHandler(rank) and sim.MetricsHandler(), served by its own
//     server on 127.0.0.1; a server can be taken down (connection refused)
//     and brought back on the same port. The simulator itself is never
//     changed.
//   - Most tests run on a clock.Fake shared by the simulator and the
//     watchdog: the simulator is stepped every 100 ms of simulated time, the
//     watchdog runs one RunCycle per simulated second and reads SGLang's
//     /metrics every 15 s, as in production. Tests about real time (slow
//     responses, timeouts, overlapping cycles) run the real Run loop on
//     clock.Real for a few seconds.
//   - Metrics are read the way Prometheus reads them: collector.NewExporter
//     over Watchdog.Snapshot, registered on a private registry and gathered.
//     Logs are captured from the project's go-kit logger.
//
// The load test (64 ranks × 1k rooms, listed every second) is behind the
// "load" build tag:
//
//	go test -tags load -run Load -timeout 10m -v ./faults/
//
// docs/hardening.md maps every fault to its test and records the fuzz and
// load figures.
package faults
