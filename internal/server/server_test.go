package server

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-kit/log"
	"github.com/prometheus/exporter-toolkit/web"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/internal/liveness"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

func options(t *testing.T, telemetryPath string, maxRequests int) Options {
	t.Helper()
	wd, err := watchdog.New(watchdog.Config{Clock: clock.Real{}, Interval: time.Second, Deadline: time.Minute, StallWindow: 30 * time.Second,
		PinWindow: 2 * time.Minute, MaxRooms: 10, Mode: watchdog.ModeOff, ConfirmTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	listen := []string{"127.0.0.1:0"}
	return Options{Watchdog: wd, Live: liveness.New(wd, time.Second, 7*time.Second, time.Now), TelemetryPath: telemetryPath,
		MaxRequests: maxRequests, Web: &web.FlagConfig{WebListenAddresses: &listen, WebSystemdSocket: new(bool), WebConfigFile: new(string)},
		Logger: log.NewNopLogger()}
}

// No telemetry path takes over another route, wholly or in part, and none
// makes the mux panic: every conflict is a configuration error.
func TestTelemetryPathConflictsAreRefused(t *testing.T) {
	var bad []string
	for _, r := range Routes {
		bad = append(bad, r)
		if strings.HasSuffix(r, "/") {
			bad = append(bad, r+"7", r+"x/y")
		}
	}
	for _, p := range append(bad, "metrics", "/a b", "/{x}") {
		if err := CheckTelemetryPath(p); err == nil {
			t.Errorf("CheckTelemetryPath(%q) accepted", p)
		}
		if _, err := New(options(t, p, 0)); err == nil {
			t.Errorf("New with telemetry path %q accepted", p)
		}
	}
	for _, p := range []string{"/metrics", "/", "/api/v1/rooms", "/api/", "/-/", "/prometheus/metrics"} {
		s, err := New(options(t, p, 0))
		if err != nil {
			t.Errorf("telemetry path %q refused: %v", p, err)
			continue
		}
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, p, nil))
		if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), "sglang_watchdog_") {
			t.Errorf("telemetry path %q: %d, no metrics", p, rec.Code)
		}
	}
}

// blockedWriter holds a scrape in flight until released.
type blockedWriter struct {
	*httptest.ResponseRecorder
	once    sync.Once
	writing chan struct{}
	release chan struct{}
}

func (b *blockedWriter) Write(p []byte) (int, error) {
	b.once.Do(func() { close(b.writing) })
	<-b.release
	return b.ResponseRecorder.Write(p)
}

// --web.max-requests: scrapes beyond the limit get 503 while one is in
// flight; 0 is no limit.
func TestMaxRequests(t *testing.T) {
	for _, tc := range []struct {
		max  int
		want int
	}{{1, http.StatusServiceUnavailable}, {0, http.StatusOK}} {
		s, err := New(options(t, "/metrics", tc.max))
		if err != nil {
			t.Fatal(err)
		}
		held := &blockedWriter{ResponseRecorder: httptest.NewRecorder(), writing: make(chan struct{}), release: make(chan struct{})}
		done := make(chan struct{})
		go func() {
			defer close(done)
			s.Handler().ServeHTTP(held, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		}()
		<-held.writing
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		close(held.release)
		<-done
		if rec.Code != tc.want {
			t.Errorf("max %d: second scrape %d, want %d", tc.max, rec.Code, tc.want)
		}
	}
}

// The probe listener is TCP only.
func TestProbeListenerRefusesVsock(t *testing.T) {
	o := options(t, "/metrics", 0)
	o.ProbeAddress = "vsock://:9434"
	if _, err := New(o); err == nil || !strings.Contains(err.Error(), "TCP only") {
		t.Fatalf("New: %v, want the probe listener's vsock address refused", err)
	}
}

// A vsock:// listen address goes to exporter-toolkit's vsock listener, not
// to TCP. A bad port shows it without opening a socket off loopback.
func TestVsockAddressGoesToVsock(t *testing.T) {
	o := options(t, "/metrics", 0)
	*o.Web.WebListenAddresses = []string{"vsock://:not-a-port"}
	s, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	err = s.Serve(context.Background())
	if err == nil || strings.Contains(err.Error(), "tcp") || !strings.Contains(err.Error(), "not-a-port") {
		t.Fatalf("Serve: %v; want the vsock port refused, not a TCP error", err)
	}
}

// Serve opens the listeners and Addr tells where; after ctx ends Serve
// returns nil.
func TestServeAndAddr(t *testing.T) {
	s, err := New(options(t, "/metrics", 0))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.Serve(ctx) }()
	addr := s.Addr(ctx)
	if addr == nil {
		t.Fatal("no address")
	}
	resp, err := http.Get("http://" + addr.String() + PathHealthy)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %d", PathHealthy, resp.StatusCode)
	}
	cancel()
	if err := <-errc; err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

// Every link of the landing page answers 200 once the watchdog has run a
// cycle; none points at an endpoint that is not served (pprof).
func TestLandingPageLinksAnswer(t *testing.T) {
	o := options(t, "/metrics", 0)
	o.Watchdog.RunCycle(context.Background())
	s, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	links := regexp.MustCompile(`href="([^"]+)"`).FindAllStringSubmatch(rec.Body.String(), -1)
	if rec.Code != http.StatusOK || len(links) < 3 {
		t.Fatalf("landing page: %d, links %v", rec.Code, links)
	}
	for _, l := range links {
		u, err := url.Parse(l[1])
		if err != nil || u.IsAbs() {
			continue // the page's own references off this server
		}
		rec := httptest.NewRecorder()
		s.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/"+strings.TrimPrefix(u.RequestURI(), "/"), nil))
		if rec.Code != http.StatusOK {
			t.Errorf("landing page link %s answers %d", l[1], rec.Code)
		}
	}
}
