// Package tokenfile reads bearer tokens from files, the only place tokens
// come from, and checks them on every read: a token that cannot travel in
// an Authorization header is refused with an error naming the file, never
// sent and retried.
package tokenfile

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/prometheus/common/config"
)

// Read returns the token held by the file at path, without the whitespace
// around it (a trailing newline is usual). It refuses an empty token and
// one with whitespace or control characters inside: such a token would
// make every request fail with an invalid header. Errors never quote the
// token.
func Read(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("reading token file: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if err := Check(tok); err != nil {
		return "", fmt.Errorf("token file %s: %w", path, err)
	}
	return tok, nil
}

// Check returns an error unless tok is a non-empty run of visible ASCII
// characters, which every bearer token is.
func Check(tok string) error {
	if tok == "" {
		return fmt.Errorf("the token is empty")
	}
	for i := 0; i < len(tok); i++ {
		if c := tok[i]; c <= ' ' || c >= 0x7f {
			return fmt.Errorf("byte %d of the token is %q: a bearer token has no whitespace, control or non-ASCII characters inside", i+1, c)
		}
	}
	return nil
}

// Secret is a config.SecretReader that reads the file on every request,
// so that a rotated Secret takes effect without a restart, and checks
// each read: a bad rotation fails the request with a clear error instead
// of sending a broken header.
type Secret struct{ Path string }

var _ config.SecretReader = Secret{}

// Fetch reads and checks the token.
func (s Secret) Fetch(context.Context) (string, error) { return Read(s.Path) }

// Description names the file, never the token.
func (s Secret) Description() string { return "token file " + s.Path }

// Immutable is false: the file is re-read on every request.
func (Secret) Immutable() bool { return false }
