package sglangsim

import (
	"bufio"
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
)

var t0 = time.Date(2025, 11, 29, 8, 0, 0, 0, time.UTC)

func newSim(t testing.TB, o Options) (*Sim, *clock.Fake) {
	t.Helper()
	c := clock.NewFake(t0)
	o.Clock = c
	s, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	return s, c
}

// run advances the clock by d in steps of every, with a Step after each.
func run(s *Sim, c *clock.Fake, d, every time.Duration) {
	for el := time.Duration(0); el < d; el += every {
		c.Advance(every)
		s.Step()
	}
}

func room(l pluginapi.Listing, rid string) (pluginapi.Room, bool) {
	for _, r := range l.Inflight {
		if r.RID == rid {
			return r, true
		}
	}
	return pluginapi.Room{}, false
}

func recordOf(t testing.TB, s *Sim, rid string) Record {
	t.Helper()
	for _, r := range s.Records() {
		if r.RID == rid {
			return r
		}
	}
	t.Fatalf("no record for %s", rid)
	return Record{}
}

type sample struct {
	name   string
	labels map[string]string
	raw    string // the label block as written
	value  float64
	vtext  string
}

// parseSamples is a small strict reader of the exposition lines this
// package writes (the expfmt-based test checks the same output with
// prometheus/common).
func parseSamples(t testing.TB, body []byte) []sample {
	t.Helper()
	var out []sample
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		smp := parseLine(t, line)
		out = append(out, smp)
	}
	return out
}

func parseLine(t testing.TB, line string) sample {
	t.Helper()
	sp := strings.LastIndexByte(line, ' ')
	if sp < 0 {
		t.Fatalf("bad line %q", line)
	}
	head, vtext := line[:sp], line[sp+1:]
	v, err := strconv.ParseFloat(vtext, 64)
	if err != nil {
		t.Fatalf("bad value in %q: %v", line, err)
	}
	smp := sample{labels: map[string]string{}, value: v, vtext: vtext}
	if i := strings.IndexByte(head, '{'); i >= 0 {
		smp.name = head[:i]
		smp.raw = head[i+1 : len(head)-1]
		for _, kv := range splitLabels(smp.raw) {
			k, val, _ := strings.Cut(kv, "=")
			smp.labels[k] = strings.Trim(val, `"`)
		}
	} else {
		smp.name = head
	}
	return smp
}

func splitLabels(raw string) []string {
	var parts []string
	inQ, start := false, 0
	for i := 0; i < len(raw); i++ {
		switch raw[i] {
		case '\\':
			i++
		case '"':
			inQ = !inQ
		case ',':
			if !inQ {
				parts = append(parts, raw[start:i])
				start = i + 1
			}
		}
	}
	if start < len(raw) {
		parts = append(parts, raw[start:])
	}
	return parts
}

// metric returns the value of the first series of name whose labels include want.
func metric(t testing.TB, s *Sim, name string, want map[string]string) (float64, bool) {
	t.Helper()
	for _, smp := range parseSamples(t, s.MetricsText()) {
		if smp.name != name {
			continue
		}
		ok := true
		for k, v := range want {
			if smp.labels[k] != v {
				ok = false
				break
			}
		}
		if ok {
			return smp.value, true
		}
	}
	return 0, false
}

func mustMetric(t testing.TB, s *Sim, name string, want map[string]string) float64 {
	t.Helper()
	v, ok := metric(t, s, name, want)
	if !ok {
		t.Fatalf("no series %s%v", name, want)
	}
	return v
}

func ptr[T any](v T) *T { return &v }

func jsonUnmarshal(raw []byte, v any) error { return json.Unmarshal(raw, v) }
