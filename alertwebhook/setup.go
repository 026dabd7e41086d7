package alertwebhook

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/go-kit/log"
	"go.yaml.in/yaml/v2"
)

// Setup are the webhook's settings as the operator gives them.
type Setup struct {
	Enabled   bool
	TokenFile string
	// MatchLabels are NAME=VALUE pairs.
	MatchLabels []string
	// WebConfigFile is the main listener's --web.config.file, whose
	// authentication also guards the webhook.
	WebConfigFile string
}

// FromSetup checks the settings and builds the receiver, or nil when the
// webhook is off. Its errors name the flags.
func FromSetup(t Trigger, logger log.Logger, s Setup) (*Receiver, error) {
	if !s.Enabled {
		if s.TokenFile != "" || len(s.MatchLabels) > 0 {
			return nil, errors.New("--alertmanager.webhook.token-file and --alertmanager.webhook.match-label need --alertmanager.webhook")
		}
		return nil, nil
	}
	if s.TokenFile == "" {
		return nil, errors.New("--alertmanager.webhook needs --alertmanager.webhook.token-file: the webhook can turn a dry run into force-fails, so it has its own credential")
	}
	if len(s.MatchLabels) == 0 {
		return nil, errors.New("--alertmanager.webhook needs at least one --alertmanager.webhook.match-label (e.g. pod=$(POD_NAME)) naming this watchdog, so that an alert about another pod is never acted on here")
	}
	match := map[string]string{}
	for _, m := range s.MatchLabels {
		k, v, ok := strings.Cut(m, "=")
		if !ok || k == "" || v == "" {
			return nil, fmt.Errorf("--alertmanager.webhook.match-label %q: want NAME=VALUE", m)
		}
		if prev, dup := match[k]; dup && prev != v {
			return nil, fmt.Errorf("--alertmanager.webhook.match-label gives %s twice (%q and %q)", k, prev, v)
		}
		match[k] = v
	}
	if path := s.WebConfigFile; path != "" {
		users, err := webConfigUsers(path)
		if err != nil {
			return nil, err
		}
		if users > 0 {
			return nil, fmt.Errorf("--web.config.file %s sets basic_auth_users, which also guard the webhook, and Alertmanager cannot send basic auth and the webhook's bearer token together; guard scrapers with TLS client certificates (client_ca_file) instead", path)
		}
	}
	return New(t, logger, Options{TokenFile: s.TokenFile, Match: match})
}

// webConfigUsers counts the basic-auth users of a web config file.
func webConfigUsers(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("reading --web.config.file: %w", err)
	}
	var c struct {
		Users map[string]string `yaml:"basic_auth_users"`
	}
	if err := yaml.Unmarshal(b, &c); err != nil {
		return 0, fmt.Errorf("--web.config.file %s: %w", path, err)
	}
	return len(c.Users), nil
}
