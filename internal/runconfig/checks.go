package runconfig

import (
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/sglang-watchdog/sglang-watchdog/loopback"
)

// canonicalURL is the form under which two URLs of one endpoint compare
// equal: scheme and host in lower case, IP addresses in one spelling
// (::1 and 0:0:0:0:0:0:0:1, ::ffff:127.0.0.1 and 127.0.0.1), the port
// written out (default ports included, no leading zeros), no trailing
// slash.
func canonicalURL(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("invalid URL %q: %w", raw, err)
	}
	scheme := strings.ToLower(u.Scheme)
	host := strings.ToLower(u.Hostname())
	if ip := net.ParseIP(host); ip != nil {
		host = ip.String()
	}
	port := u.Port()
	switch {
	case port == "" && scheme == "https":
		port = "443"
	case port == "":
		port = "80"
	default:
		n, err := strconv.ParseUint(port, 10, 16)
		if err != nil {
			return "", fmt.Errorf("URL %q: invalid port %q", raw, port)
		}
		port = strconv.FormatUint(n, 10)
	}
	return scheme + "://" + net.JoinHostPort(host, port) + strings.TrimRight(u.EscapedPath(), "/"), nil
}

// CheckDistinct refuses two plugin URLs that name the same endpoint: one
// rank watched twice means two admin calls for one room and a /metrics
// that fails on duplicate series.
func CheckDistinct(urls []string) error {
	seen := map[string]string{}
	for _, u := range urls {
		c, err := canonicalURL(u)
		if err != nil {
			return err
		}
		if first, ok := seen[c]; ok {
			return fmt.Errorf("--plugin.url %q and %q name the same plugin (%s); give each rank once", first, u, c)
		}
		seen[c] = u
	}
	return nil
}

// CheckTimeout refuses a timeout of zero or below, which would mean "no
// timeout": one source that never answers would stop the watchdog.
func CheckTimeout(flag string, d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("%s (%s) must be above zero: without a timeout, one source that never answers stops the watchdog", flag, d)
	}
	return nil
}

// CheckAdminTimeout also refuses a timeout the plugin's own wait fills.
func CheckAdminTimeout(flag string, d time.Duration) error {
	if err := CheckTimeout(flag, d); err != nil {
		return err
	}
	if d <= pluginWait {
		return fmt.Errorf("%s (%s) must be longer than the %s the plugin waits for its scheduler, or a busy scheduler's answer is always lost", flag, d, pluginWait)
	}
	return nil
}

// CheckURLs refuses URLs that are not loopback addresses, unless
// allowRemote; then it still wants http or https and a host.
func CheckURLs(allowRemote bool, urls ...string) error {
	for _, u := range urls {
		if allowRemote {
			parsed, err := url.Parse(u)
			if err != nil {
				return fmt.Errorf("invalid URL %q: %w", u, err)
			}
			if parsed.Scheme != "http" && parsed.Scheme != "https" {
				return fmt.Errorf("URL %q: scheme must be http or https", u)
			}
			if parsed.Hostname() == "" {
				return fmt.Errorf("URL %q has no host", u)
			}
			continue
		}
		if err := loopback.Check(u); err != nil {
			return err
		}
	}
	return nil
}
