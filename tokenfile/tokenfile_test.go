package tokenfile

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func write(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestReadTrimsAndChecks(t *testing.T) {
	if tok, err := Read(write(t, "  SeCrEt-Tok_987.~+/=\n")); err != nil || tok != "SeCrEt-Tok_987.~+/=" {
		t.Errorf("good token: %q %v", tok, err)
	}
	for name, content := range map[string]string{
		"empty":           "\n",
		"newline inside":  "SeCrEt\nTok-987\n",
		"space inside":    "SeCrEt Tok-987",
		"tab inside":      "SeCrEt\tTok-987",
		"carriage return": "SeCrEt\rTok-987",
		"NUL":             "SeCrEt\x00Tok",
		"escape":          "SeCrEt\x1b[0m",
		"non-ASCII":       "SeCrEt\u00e9Tok",
		"DEL":             "SeCrEt\x7fTok",
	} {
		_, err := Read(write(t, content))
		if err == nil {
			t.Errorf("%s: accepted", name)
			continue
		}
		if strings.Contains(err.Error(), "SeCrEt") {
			t.Errorf("%s: the error quotes the token: %v", name, err)
		}
		if !strings.Contains(err.Error(), "token file ") {
			t.Errorf("%s: the error does not name the file: %v", name, err)
		}
	}
	if _, err := Read(filepath.Join(t.TempDir(), "missing")); err == nil || !strings.Contains(err.Error(), "reading token file") {
		t.Errorf("missing file: %v", err)
	}
}

func TestSecretRereadsTheFile(t *testing.T) {
	p := write(t, "first\n")
	s := Secret{Path: p}
	if tok, err := s.Fetch(context.Background()); err != nil || tok != "first" {
		t.Fatalf("%q %v", tok, err)
	}
	if err := os.WriteFile(p, []byte("second\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if tok, err := s.Fetch(context.Background()); err != nil || tok != "second" {
		t.Fatalf("after rotation: %q %v", tok, err)
	}
	if err := os.WriteFile(p, []byte("bad\ntoken\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Fetch(context.Background()); err == nil {
		t.Fatal("a bad rotation was accepted")
	}
	if s.Immutable() || strings.Contains(s.Description(), "second") {
		t.Errorf("description %q immutable %v", s.Description(), s.Immutable())
	}
}
