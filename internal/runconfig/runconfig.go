// Package runconfig checks the run command's settings and builds the
// watchdog's configuration from them: timeouts, URLs, the plugin's
// transports and the client of the prefill watchdogs' verdicts. Its errors
// name the flags, which main declares.
package runconfig

import (
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/go-kit/log"
	"github.com/go-kit/log/level"
	"github.com/prometheus/common/config"
	"go.yaml.in/yaml/v2"

	"github.com/sglang-watchdog/sglang-watchdog/clock"
	"github.com/sglang-watchdog/sglang-watchdog/collector"
	"github.com/sglang-watchdog/sglang-watchdog/pluginapi"
	"github.com/sglang-watchdog/sglang-watchdog/tokenfile"
	"github.com/sglang-watchdog/sglang-watchdog/watchdog"
)

// Watch are the settings of the watchdog proper.
type Watch struct {
	Interval, Deadline, StallWindow, PinWindow time.Duration
	DecodeDeadline                             time.Duration
	MaxRooms                                   int
	Mode                                       string
	MaxPerMinute                               int
	ConfirmTimeout, AdminTimeout               time.Duration
	// Fail-fast behind a transfer wedge and restart escalation.
	FailFast           bool
	FailFastPerMinute  int
	FailFastMinAge     time.Duration
	LinkMargin         float64
	LinkIdle           time.Duration
	RestartMode        string
	RestartMinInterval time.Duration
	RestartStateFile   string
	// ModeFile overrides Mode at run time (watchdog.Config.ModeFile).
	ModeFile string
}

// Decode say how a decode-side watchdog asks the watchdogs of the prefill
// peers for their verdicts (docs/decode.md).
type Decode struct {
	PrefillURL        string
	PrefillNetworks   []string
	PrefillHTTPConfig string
	PrefillTimeout    time.Duration
	MaxPerMinute      int
}

// Options are the run command's settings.
type Options struct {
	Watch  Watch
	Decode Decode
	// MetricsURL is SGLang's /metrics URL; empty turns the gauge watch off.
	MetricsURL      string
	MetricsInterval time.Duration
	// MetricsTimeout and PluginTimeout are nil when not given: then a
	// third of MetricsInterval and 80% of Watch.Interval.
	MetricsTimeout *time.Duration
	PluginTimeout  *time.Duration
	PluginURLs     []string
	TokenFile      string
	PluginTLSFile  string
	AllowRemote    bool
}

// pluginWait is how long the plugin holds an admin call while it waits for
// its scheduler thread (docs/plugin-api.md); an admin timeout must be
// longer, or every answer from a busy scheduler is lost.
const pluginWait = 5 * time.Second

// verdictCacheTTL keeps a prefill verdict other than "stopped", so that a
// held decode request costs its prefill peer a lookup every few cycles,
// not every cycle.
const verdictCacheTTL = 5 * time.Second

func or(d *time.Duration, def time.Duration) time.Duration {
	if d != nil {
		return *d
	}
	return def
}

// Watchdog validates o and builds the watchdog's config.
func Watchdog(o Options, logger log.Logger) (watchdog.Config, error) {
	w := o.Watch
	mode, err := watchdog.ParseMode(w.Mode)
	if err != nil {
		return watchdog.Config{}, err
	}
	pluginTimeout := or(o.PluginTimeout, w.Interval*4/5)
	metricsTimeout := or(o.MetricsTimeout, o.MetricsInterval/3)
	checks := []error{
		CheckTimeout("--watchdog.interval", w.Interval),
		CheckTimeout("--plugin.timeout", pluginTimeout),
		CheckAdminTimeout("--force-fail.timeout", w.AdminTimeout),
	}
	if o.MetricsURL != "" {
		checks = append(checks, CheckTimeout("--sglang.metrics-interval", o.MetricsInterval), CheckTimeout("--sglang.timeout", metricsTimeout))
	}
	if err := errors.Join(checks...); err != nil {
		return watchdog.Config{}, err
	}
	if pluginTimeout >= w.Interval {
		return watchdog.Config{}, fmt.Errorf("--plugin.timeout (%s) must be shorter than --watchdog.interval (%s), so that cycles never overlap; leave it unset to use 80%% of the interval", pluginTimeout, w.Interval)
	}
	if o.MetricsURL != "" && metricsTimeout >= o.MetricsInterval {
		return watchdog.Config{}, fmt.Errorf("--sglang.timeout (%s) must be shorter than --sglang.metrics-interval (%s); leave it unset to use a third of the interval", metricsTimeout, o.MetricsInterval)
	}
	if o.MetricsURL != "" && o.MetricsInterval < w.PinWindow/20 {
		level.Warn(logger).Log("msg", "SGLang /metrics is read very often; each read costs SGLang tens of milliseconds of CPU", "interval", o.MetricsInterval)
	}
	urls := append([]string(nil), o.PluginURLs...)
	if o.MetricsURL != "" {
		urls = append(urls, o.MetricsURL)
	}
	if err := CheckURLs(o.AllowRemote, urls...); err != nil {
		return watchdog.Config{}, err
	}
	if err := CheckDistinct(o.PluginURLs); err != nil {
		return watchdog.Config{}, err
	}
	listingRT, adminRT, err := PluginTransports(o.PluginTLSFile, o.TokenFile)
	if err != nil {
		return watchdog.Config{}, err
	}
	cfg := watchdog.Config{
		Clock:           clock.Real{},
		Logger:          logger,
		Interval:        w.Interval,
		MetricsInterval: o.MetricsInterval,
		Deadline:        w.Deadline,
		DecodeDeadline:  w.DecodeDeadline,
		StallWindow:     w.StallWindow,
		PinWindow:       w.PinWindow,
		MaxRooms:        w.MaxRooms,
		Mode:            mode,
		ModeFile:        w.ModeFile,
		MaxPerMinute:    w.MaxPerMinute,
		ConfirmTimeout:  w.ConfirmTimeout,

		FailFast:           w.FailFast,
		FailFastPerMinute:  w.FailFastPerMinute,
		FailFastMinAge:     w.FailFastMinAge,
		LinkMargin:         w.LinkMargin,
		LinkIdle:           w.LinkIdle,
		DecodePerMinute:    o.Decode.MaxPerMinute,
		RestartMode:        watchdog.Mode(w.RestartMode),
		RestartMinInterval: w.RestartMinInterval,
		RestartStateFile:   w.RestartStateFile,
	}
	if o.MetricsURL != "" {
		cfg.Metrics = collector.NewMetricsScraper(o.MetricsURL, metricsTimeout)
	}
	if o.Decode.MaxPerMinute <= 0 {
		return watchdog.Config{}, fmt.Errorf("--decode.max-per-minute must be positive, got %d; to release no decode request, run the decode pod's watchdog with --force-fail.mode=off or dry-run", o.Decode.MaxPerMinute)
	}
	if !(w.LinkMargin >= 1) || math.IsInf(w.LinkMargin, 1) {
		return watchdog.Config{}, fmt.Errorf("--watchdog.link-margin must be a finite number of at least 1, got %v", w.LinkMargin)
	}
	if w.LinkIdle <= 0 {
		return watchdog.Config{}, fmt.Errorf("--watchdog.link-idle must be positive, got %s", w.LinkIdle)
	}
	if w.FailFastMinAge <= 0 {
		return watchdog.Config{}, fmt.Errorf("--watchdog.fail-fast-min-age must be positive, got %s", w.FailFastMinAge)
	}
	if w.DecodeDeadline <= 0 {
		return watchdog.Config{}, fmt.Errorf("--watchdog.decode-deadline must be positive, got %s", w.DecodeDeadline)
	}
	verdicts, err := VerdictClient(o.Decode)
	if err != nil {
		return watchdog.Config{}, err
	}
	if verdicts != nil {
		cfg.Verdicts = verdicts
	}
	for _, u := range o.PluginURLs {
		cfg.Plugins = append(cfg.Plugins, pluginapi.NewClient(u, pluginapi.ClientOptions{Timeout: pluginTimeout, AdminTimeout: w.AdminTimeout,
			Transport: listingRT, AdminTransport: adminRT}))
	}
	return cfg, nil
}

// VerdictClient builds the client of the prefill watchdogs' verdict API, or
// nil without a prefill watchdog URL.
func VerdictClient(d Decode) (*pluginapi.VerdictClient, error) {
	if d.PrefillURL == "" {
		if d.PrefillHTTPConfig != "" {
			return nil, errors.New("--decode.prefill-watchdog-http-config-file needs --decode.prefill-watchdog-url")
		}
		return nil, nil
	}
	if d.PrefillTimeout <= 0 {
		return nil, fmt.Errorf("--decode.prefill-watchdog-timeout must be positive, got %s", d.PrefillTimeout)
	}
	var nets []netip.Prefix
	for _, n := range d.PrefillNetworks {
		p, err := netip.ParsePrefix(n)
		if err != nil {
			return nil, fmt.Errorf("--decode.prefill-networks %q: %w", n, err)
		}
		nets = append(nets, p.Masked())
	}
	cfg := config.HTTPClientConfig{}
	if d.PrefillHTTPConfig != "" {
		c, _, err := config.LoadHTTPConfigFile(d.PrefillHTTPConfig)
		if err != nil {
			return nil, fmt.Errorf("--decode.prefill-watchdog-http-config-file %s: %w", d.PrefillHTTPConfig, err)
		}
		cfg = *c
	}
	// The prefill watchdog's address comes from listing data: never through
	// a proxy, never redirected.
	cfg.ProxyConfig = config.ProxyConfig{}
	client, err := config.NewClientFromConfig(cfg, "prefill_watchdog", config.WithIdleConnTimeout(30*time.Second))
	if err != nil {
		return nil, fmt.Errorf("--decode.prefill-watchdog-http-config-file %s: %w", d.PrefillHTTPConfig, err)
	}
	return pluginapi.NewVerdictClient(pluginapi.VerdictClientOptions{URLTemplate: d.PrefillURL, Networks: nets, Client: client,
		Timeout: d.PrefillTimeout, CacheTTL: verdictCacheTTL})
}

// PluginTransports returns the round trippers of listing reads (TLS only:
// a listing needs no token) and of admin calls (TLS and the bearer token,
// re-read from its file on every call, so that a rotated Secret needs no
// restart). Neither uses a proxy from the environment.
func PluginTransports(tlsFile, tokenFile string) (listing, admin http.RoundTripper, err error) {
	var cfg config.HTTPClientConfig
	if tlsFile != "" {
		b, err := os.ReadFile(tlsFile)
		if err != nil {
			return nil, nil, fmt.Errorf("reading --plugin.tls-config-file: %w", err)
		}
		if err := yaml.UnmarshalStrict(b, &cfg.TLSConfig); err != nil {
			return nil, nil, fmt.Errorf("--plugin.tls-config-file %s: %w", tlsFile, err)
		}
		cfg.TLSConfig.SetDirectory(filepath.Dir(tlsFile))
		if _, err := config.NewTLSConfig(&cfg.TLSConfig); err != nil {
			return nil, nil, fmt.Errorf("--plugin.tls-config-file %s: %w", tlsFile, err)
		}
	}
	listing, err = config.NewRoundTripperFromConfig(cfg, "plugin", config.WithIdleConnTimeout(30*time.Second))
	if err != nil {
		return nil, nil, err
	}
	admin = listing
	if tokenFile != "" {
		if _, err := tokenfile.Read(tokenFile); err != nil {
			return nil, nil, err
		}
		admin = config.NewAuthorizationCredentialsRoundTripper("Bearer", tokenfile.Secret{Path: tokenFile}, listing)
	}
	return listing, admin, nil
}
