package main

import (
	"bytes"
	"reflect"
	"strings"
	"testing"

	"github.com/go-kit/log"
)

func TestNodePluginURLs(t *testing.T) {
	var logs bytes.Buffer
	logger := log.NewLogfmtLogger(&logs)
	for _, c := range []struct {
		name string
		args []string
		want []string
		log  bool
	}{
		{"no topology: --plugin.url as given", []string{"--plugin.url=http://127.0.0.1:1"}, []string{"http://127.0.0.1:1"}, false},
		{"DP-attention node 1 of 2", []string{"--sglang.nnodes=2", "--sglang.node-rank=1", "--sglang.tp-size=4", "--sglang.dp-size=4",
			"--sglang.enable-dp-attention", "--plugin.base-port=28200", "--plugin.host=127.0.0.2"},
			[]string{"http://127.0.0.2:28202", "http://127.0.0.2:28203"}, false},
		{"PP stage 1 on node 1", []string{"--sglang.nnodes=2", "--sglang.node-rank=1", "--sglang.tp-size=8", "--sglang.pp-size=2"},
			[]string{"http://127.0.0.1:28101"}, false},
		{"IPv6 host", []string{"--sglang.tp-size=8", "--plugin.host=::1"}, []string{"http://[::1]:28100"}, false},
		{"plain TP worker node", []string{"--sglang.nnodes=2", "--sglang.node-rank=1", "--sglang.tp-size=16"}, nil, true},
	} {
		logs.Reset()
		got, err := nodePluginURLs(parseRun(t, c.args...), logger)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: got %v, want %v", c.name, got, c.want)
		}
		if logged := strings.Contains(logs.String(), "watching its /metrics only"); logged != c.log {
			t.Errorf("%s: logged %q", c.name, logs.String())
		}
	}
}

func TestNodePluginURLsRefusals(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--sglang.tp-size=8", "--plugin.url=http://127.0.0.1:28100"}, "--plugin.url and --sglang.tp-size both given"},
		{[]string{"--sglang.nnodes=2"}, "need --sglang.tp-size"},
		{[]string{"--sglang.enable-dp-attention"}, "need --sglang.tp-size"},
		{[]string{"--sglang.nnodes=2", "--sglang.node-rank=2", "--sglang.tp-size=8"}, "--sglang.* flags: node_rank 2"},
		{[]string{"--sglang.tp-size=8", "--plugin.base-port=0"}, "--plugin.base-port 0"},
		{[]string{"--sglang.tp-size=8", "--sglang.dp-size=8", "--sglang.enable-dp-attention", "--plugin.base-port=65530"}, "past port 65535"},
		{[]string{"--sglang.tp-size=8", "--plugin.host="}, "--plugin.host is empty"},
	} {
		_, err := nodePluginURLs(parseRun(t, c.args...), log.NewNopLogger())
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: got %v, want an error containing %q", c.args, err, c.want)
		}
	}
}

// TestRunRefusesBothURLSources checks that the refusal stops the sidecar at
// startup, before it watches anything.
func TestRunRefusesBothURLSources(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run([]string{"run", "--sglang.tp-size=8", "--plugin.url=http://127.0.0.1:28100", "--web.listen-address=127.0.0.1:0"}, &stdout, &stderr)
	if code != 2 || !strings.Contains(stderr.String(), "both given") {
		t.Fatalf("exit %d, stderr %s", code, stderr.String())
	}
}
