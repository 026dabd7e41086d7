// Package loopback guards the rule that the watchdog only talks to its own
// pod: every URL it is given must name a loopback host unless the operator
// opted out explicitly.
package loopback

import (
	"fmt"
	"net"
	"net/url"
	"strings"
)

// Check returns an error unless rawURL is an http(s) URL whose host is
// "localhost" or a loopback IP (127.0.0.0/8, ::1).
func Check(rawURL string) error {
	u, err := url.Parse(rawURL)
	if err != nil {
		return fmt.Errorf("invalid URL %q: %w", rawURL, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("URL %q: scheme must be http or https", rawURL)
	}
	host := u.Hostname()
	if host == "" {
		return fmt.Errorf("URL %q has no host", rawURL)
	}
	if strings.EqualFold(host, "localhost") {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	return fmt.Errorf("URL %q is not a loopback address; pass --plugin.allow-remote to allow it", rawURL)
}
