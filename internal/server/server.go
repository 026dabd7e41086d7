// Package server is the watchdog's own HTTP side: the metrics, health,
// verdict and webhook routes behind --web.config.file on the listeners of
// exporter-toolkit's ListenAndServe (TCP, vsock or systemd sockets), and an
// optional plain-HTTP listener for kubelet probes.
package server

import (
	"context"
	"errors"
	"fmt"
	stdlog "log"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/go-kit/log"
	"github.com/go-kit/log/level"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	versioncollector "github.com/prometheus/client_golang/prometheus/collectors/version"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web"

	"github.com/sglang-watchdog/sglang-watchdog/alertwebhook"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/internal/liveness"
	"github.com/sglang-watchdog/sglang-watchdog/logging"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// Fixed routes of the main listener; the telemetry path may be none of
// them nor fall under a subtree among them.
const (
	PathHealthy = "/-/healthy"
	PathReady   = "/-/ready"
)

// Routes are the patterns the main listener serves besides the telemetry
// path and the landing page.
var Routes = []string{PathHealthy, PathReady, pluginapi.PathRoomVerdict, alertwebhook.Path}

// Options say what to serve and where.
type Options struct {
	Watchdog *watchdog.Watchdog
	// Receiver is the Alertmanager webhook; nil serves a refusal that is
	// counted.
	Receiver *alertwebhook.Receiver
	Live     *liveness.Liveness
	// TelemetryPath is where the metrics are served ("/" drops the landing
	// page).
	TelemetryPath string
	// MaxRequests bounds the scrapes served at once; beyond it a scrape
	// gets 503. Zero or below: no bound.
	MaxRequests int
	// Web holds the listen addresses (TCP, or vsock://:port), the systemd
	// socket switch and the web config file, as exporter-toolkit reads them.
	Web *web.FlagConfig
	// ProbeAddress, if set, is a TCP address for a listener serving only
	// the health routes, in plain HTTP without the web config's
	// authentication.
	ProbeAddress string
	Logger       log.Logger
}

// Server is the HTTP side of one watchdog.
type Server struct {
	handler       http.Handler
	probes        http.Handler
	probeListener net.Listener
	web           *web.FlagConfig
	logger        log.Logger

	listening chan struct{} // closed once a main listener serves
	once      sync.Once
	addr      net.Addr
	stopped   chan struct{} // closed when Serve returns
}

// CheckTelemetryPath refuses a metrics path that the HTTP mux would panic
// on or that would take over, wholly or in part, another route.
func CheckTelemetryPath(p string) error {
	switch {
	case !strings.HasPrefix(p, "/"):
		return fmt.Errorf("--web.telemetry-path %q must start with /", p)
	case strings.IndexFunc(p, func(r rune) bool { return r <= ' ' || r == 0x7f || strings.ContainsRune("{}?#%", r) }) >= 0:
		return fmt.Errorf("--web.telemetry-path %q may not contain spaces, control characters, braces, ?, # or %%", p)
	}
	for _, r := range Routes {
		if p == r || (strings.HasSuffix(r, "/") && strings.HasPrefix(p, r)) {
			return fmt.Errorf("--web.telemetry-path %q is taken by another endpoint (%s)", p, r)
		}
	}
	return nil
}

// handle registers a route, turning the mux's panic on a pattern it
// cannot take (or takes already) into an error.
func handle(mux *http.ServeMux, pattern string, h http.Handler) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("route %q: %v", pattern, r)
		}
	}()
	mux.Handle(pattern, h)
	return nil
}

// healthHandlers registers /-/healthy (the watch loop cycles) and /-/ready
// (the first SGLang read succeeded) on mux.
func healthHandlers(mux *http.ServeMux, wd *watchdog.Watchdog, live *liveness.Liveness) {
	mux.HandleFunc(PathHealthy, func(w http.ResponseWriter, _ *http.Request) {
		if why := live.Check(); why != "" {
			http.Error(w, "Unhealthy: "+why, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "Healthy")
	})
	mux.HandleFunc(PathReady, func(w http.ResponseWriter, _ *http.Request) {
		if !wd.Ready() {
			http.Error(w, "Not ready: SGLang has not been read successfully yet", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "Ready")
	})
}

// routes builds the main listener's handler.
func routes(o Options) (http.Handler, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collector.NewExporter(o.Watchdog.Snapshot),
		versioncollector.NewCollector("sglang_watchdog"),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	if o.Receiver != nil {
		reg.MustRegister(o.Receiver)
	}
	mux := http.NewServeMux()
	metrics := promhttp.InstrumentMetricHandler(reg, promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog:            stdlog.New(log.NewStdlibAdapter(level.Error(o.Logger)), "", 0),
		ErrorHandling:       promhttp.ContinueOnError,
		MaxRequestsInFlight: max(o.MaxRequests, 0),
	}))
	healthHandlers(mux, o.Watchdog, o.Live)
	// Read-only, behind the same web config as the metrics: decode-side
	// watchdogs ask it whether prefill stopped sending for a room.
	mux.Handle(pluginapi.PathRoomVerdict, o.Watchdog.VerdictHandler())
	if o.Receiver != nil {
		mux.Handle(alertwebhook.Path, o.Receiver)
	} else {
		// Count deliveries to a disabled receiver: they mean Alertmanager
		// routes to a watchdog that will not act.
		mux.HandleFunc(alertwebhook.Path, func(w http.ResponseWriter, _ *http.Request) {
			o.Watchdog.CountWebhook(watchdog.WebhookDisabled)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusForbidden)
			fmt.Fprintln(w, `{"result":"disabled","error":"start the watchdog with --alertmanager.webhook"}`)
		})
	}
	// The telemetry path is the operator's: registered after the fixed
	// routes, so that a conflict CheckTelemetryPath missed is an error
	// here, never a panic.
	if err := handle(mux, o.TelemetryPath, metrics); err != nil {
		return nil, fmt.Errorf("--web.telemetry-path: %w", err)
	}
	if o.TelemetryPath != "/" {
		landing, err := web.NewLandingPage(web.LandingConfig{
			Name:        "SGLang watchdog",
			Description: "Prometheus exporter and stuck-request watchdog for SGLang prefill/decode disaggregation",
			Version:     version.Info(),
			// No profiling endpoint is served (docs/hardening.md: the
			// sidecar's surface is its metrics, health, verdict and webhook
			// routes), so the page links none.
			Profiling: "false",
			Links: []web.LandingLinks{
				{Address: o.TelemetryPath, Text: "Metrics"},
				{Address: PathHealthy, Text: "Health"},
				{Address: PathReady, Text: "Readiness"},
			},
		})
		if err != nil {
			return nil, err
		}
		mux.Handle("/", landing)
	}
	return mux, nil
}

// New builds the handlers and opens the probe listener; the main listeners
// are opened by Serve.
func New(o Options) (*Server, error) {
	if err := CheckTelemetryPath(o.TelemetryPath); err != nil {
		return nil, err
	}
	handler, err := routes(o)
	if err != nil {
		return nil, err
	}
	s := &Server{handler: handler, web: o.Web, logger: o.Logger, listening: make(chan struct{}), stopped: make(chan struct{})}
	if o.ProbeAddress != "" {
		// kubelet probes speak TCP: the probe listener takes neither vsock
		// nor a systemd socket.
		if strings.HasPrefix(o.ProbeAddress, "vsock://") {
			return nil, fmt.Errorf("--web.probe-listen-address %s: the probe listener is TCP only (kubelet probes); vsock and systemd sockets are for --web.listen-address", o.ProbeAddress)
		}
		probes := http.NewServeMux()
		healthHandlers(probes, o.Watchdog, o.Live)
		s.probes = probes
		l, err := net.Listen("tcp", o.ProbeAddress)
		if err != nil {
			return nil, fmt.Errorf("listening on --web.probe-listen-address %s: %w", o.ProbeAddress, err)
		}
		s.probeListener = l
	}
	return s, nil
}

// Handler is the main listener's handler, without the web config.
func (s *Server) Handler() http.Handler { return s.handler }

// Probes is the probe listener's handler, nil without one.
func (s *Server) Probes() http.Handler { return s.probes }

// ProbeAddr is the probe listener's address, nil without one.
func (s *Server) ProbeAddr() net.Addr {
	if s.probeListener == nil {
		return nil
	}
	return s.probeListener.Addr()
}

// Addr waits until a main listener serves and returns its address (with
// port 0 in the flags, the port the system chose), or nil if Serve ended
// or ctx ends first.
func (s *Server) Addr(ctx context.Context) net.Addr {
	select {
	case <-s.listening:
		return s.addr
	case <-s.stopped:
		return nil
	case <-ctx.Done():
		return nil
	}
}

// Close closes the probe listener of a server that will not serve.
func (s *Server) Close() {
	if s.probeListener != nil {
		s.probeListener.Close()
	}
}

func newHTTPServer(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 15 * time.Second,
		WriteTimeout: 30 * time.Second, IdleTimeout: 30 * time.Second}
}

// Serve opens the main listeners through exporter-toolkit and serves them
// and the probe listener until ctx ends or one fails.
func (s *Server) Serve(ctx context.Context) error {
	defer close(s.stopped)
	srv := newHTTPServer(s.handler)
	// The toolkit opens the listeners; each one's address is seen here,
	// when http.Server starts serving it.
	srv.BaseContext = func(l net.Listener) context.Context {
		s.once.Do(func() {
			s.addr = l.Addr()
			close(s.listening)
		})
		return context.Background()
	}
	errc := make(chan error, 2)
	go func() { errc <- web.ListenAndServe(srv, s.web, logging.Slog(s.logger)) }()
	var probeSrv *http.Server
	if s.probeListener != nil {
		probeSrv = newHTTPServer(s.probes)
		level.Info(s.logger).Log("msg", "serving probes without authentication", "address", s.probeListener.Addr(), "paths", PathHealthy+","+PathReady)
		go func() { errc <- probeSrv.Serve(s.probeListener) }()
	}
	select {
	case err := <-errc:
		if probeSrv != nil {
			_ = probeSrv.Close()
		}
		_ = srv.Close()
		if errors.Is(err, http.ErrServerClosed) {
			return nil
		}
		return err
	case <-ctx.Done():
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
		if probeSrv != nil {
			_ = probeSrv.Shutdown(shutdown)
		}
		return nil
	}
}
