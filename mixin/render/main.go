// Command render writes the files of the sglang-watchdog mixin: the rule files
// (alerts/*.rules.yml) and the dashboard (dashboards/*.json), under -out.
//
// From the repository root:
//
//	go run ./mixin/render -config my-config.libsonnet -out rendered/
//
// where my-config.libsonnet holds _config overrides, for example
// { scrapeInterval: '30s', watchdogSelector: 'job="llm/sglang-watchdog"' }.
// Without -config it renders the defaults, which `go generate ./mixin/` writes
// into the repository.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/sglang-watchdog/sglang-watchdog/mixin"
)

func main() {
	config := flag.String("config", "", "jsonnet file with _config overrides (an object); empty for the defaults")
	out := flag.String("out", ".", "directory to write alerts/ and dashboards/ into")
	flag.Parse()
	written, err := mixin.Write(*config, *out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "render:", err)
		os.Exit(1)
	}
	for _, p := range written {
		fmt.Println(p)
	}
}
