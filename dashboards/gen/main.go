// Command gen writes the sglang-watchdog Grafana dashboard JSON: the mixin's
// base dashboard, which the mixin renders into dashboards/sglang-watchdog.json.
//
// From the repository root, `go generate ./mixin/` runs it and then renders
// the mixin; by hand:
//
//	go run ./dashboards/gen -out mixin/dashboards/sglang-watchdog.json
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/sglang-watchdog/sglang-watchdog/dashboards"
)

func main() {
	out := flag.String("out", "-", "file to write the dashboard JSON to (\"-\" for stdout)")
	flag.Parse()
	if err := run(*out); err != nil {
		fmt.Fprintln(os.Stderr, "gen:", err)
		os.Exit(1)
	}
}

func run(out string) error {
	data, err := dashboards.JSON()
	if err != nil {
		return err
	}
	if out == "-" {
		_, err = os.Stdout.Write(data)
		return err
	}
	return os.WriteFile(out, data, 0o644)
}
