// Command gen writes the sglang-watchdog Grafana dashboard JSON.
//
// From the repository root:
//
//	go generate ./dashboards/
//
// or equivalently:
//
//	go run ./dashboards/gen -out dashboards/sglang-watchdog.json
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/sglang-watchdog/sglang-watchdog/dashboards"
)

func main() {
	out := flag.String("out", dashboards.FileName, "file to write the dashboard JSON to (\"-\" for stdout)")
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
