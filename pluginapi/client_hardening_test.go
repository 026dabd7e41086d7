package pluginapi

import (
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

const hardToken = "tok-9c1e5a7b3d2f4e60"

// hardRecorder is a loopback server that records who called it with what.
type hardRecorder struct {
	*httptest.Server
	mu    sync.Mutex
	reqs  []string // "METHOD path auth"
	reply http.HandlerFunc
}

func newHardRecorder(t *testing.T, reply http.HandlerFunc) *hardRecorder {
	t.Helper()
	r := &hardRecorder{reply: reply}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		r.reqs = append(r.reqs, req.Method+" "+req.URL.Path+" "+req.Header.Get("Authorization"))
		r.mu.Unlock()
		if r.reply != nil {
			r.reply(w, req)
		}
	}))
	t.Cleanup(r.Close)
	return r
}

func (r *hardRecorder) requests() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.reqs...)
}

func hardOrder() ForceFailRequest {
	room := uint64(42)
	return ForceFailRequest{RID: "rid-1", BootstrapRoom: &room, Reason: "test"}
}

// TestClientNeverFollowsRedirects: a plugin URL that redirects (any of the
// four redirect codes, on the listing and on the admin call) never makes
// the client call the redirect target, so the bearer token cannot be
// carried to another host, and the redirect is reported as a failure.
func TestClientNeverFollowsRedirects(t *testing.T) {
	target := newHardRecorder(t, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, exampleListing)
	})
	for _, code := range []int{http.StatusMovedPermanently, http.StatusFound, http.StatusTemporaryRedirect, http.StatusPermanentRedirect} {
		t.Run(fmt.Sprint(code), func(t *testing.T) {
			redirector := newHardRecorder(t, func(w http.ResponseWriter, req *http.Request) {
				http.Redirect(w, req, target.URL+req.URL.Path, code)
			})
			c := NewClient(redirector.URL, ClientOptions{Timeout: time.Second, AdminTimeout: time.Second, Token: hardToken})
			if _, err := c.Inflight(context.Background()); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("HTTP %d", code)) {
				t.Errorf("listing redirected with %d: err = %v, want the redirect reported", code, err)
			}
			status, resp, err := c.ForceFail(context.Background(), hardOrder())
			if err == nil && resp != nil && resp.Result == ResultFlipped {
				t.Errorf("admin call redirected with %d counted as flipped", code)
			}
			if status != code {
				t.Errorf("admin call: status %d, want the redirect's %d", status, code)
			}
			if got := len(redirector.requests()); got != 2 {
				t.Errorf("the configured URL got %d requests, want 2", got)
			}
		})
	}
	if reqs := target.requests(); len(reqs) != 0 {
		t.Fatalf("the redirect target was called: %q", reqs)
	}
}

// TestTokenOnlyOnAdminCalls: the bearer token goes with the admin call and
// never with a listing read.
func TestTokenOnlyOnAdminCalls(t *testing.T) {
	srv := newHardRecorder(t, func(w http.ResponseWriter, req *http.Request) {
		if req.Method == http.MethodGet {
			_, _ = io.WriteString(w, exampleListing)
			return
		}
		_, _ = io.WriteString(w, `{"result":"would_flip","rid":"rid-1","bootstrap_room":42,"lever":"_send_failed","applied_unix":1}`)
	})
	c := NewClient(srv.URL, ClientOptions{Timeout: time.Second, AdminTimeout: time.Second, Token: hardToken})
	if _, err := c.Inflight(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.ForceFail(context.Background(), hardOrder()); err != nil {
		t.Fatal(err)
	}
	reqs := srv.requests()
	if len(reqs) != 2 || reqs[0] != "GET "+PathInflight+" " || reqs[1] != "POST "+PathForceFail+" Bearer "+hardToken {
		t.Fatalf("requests %q: want the listing without a token and the admin call with it", reqs)
	}
}

// TestErrorsNeverCarryTheToken: a server in front of the plugin that echoes
// the request's headers in an error page (a debugging proxy, a misconfigured
// ingress) puts the token in the answer. The client quotes the start of an
// unusable body in its error, and the actuator logs that error: the token
// ends up in the watchdog's logs. The client should redact its own token
// from anything it quotes.
func TestErrorsNeverCarryTheToken(t *testing.T) {
	for _, status := range []int{http.StatusOK, http.StatusBadGateway} {
		srv := newHardRecorder(t, func(w http.ResponseWriter, req *http.Request) {
			w.WriteHeader(status)
			fmt.Fprintf(w, "<html>upstream error; request headers: Authorization: %s</html>", req.Header.Get("Authorization"))
		})
		c := NewClient(srv.URL, ClientOptions{AdminTimeout: time.Second, Token: hardToken})
		_, _, err := c.ForceFail(context.Background(), hardOrder())
		if err == nil {
			t.Fatalf("HTTP %d with an HTML body: no error", status)
		}
		if strings.Contains(err.Error(), hardToken) {
			t.Errorf("HTTP %d: the error quotes the token: %v", status, err)
		}
	}
}

// TestClientIgnoresProxyEnvironment: the token must reach only the
// configured plugin URL. The client uses http.DefaultTransport, which
// honours HTTP_PROXY/HTTPS_PROXY: with --plugin.allow-remote and a proxy in
// the environment (common in clusters), every admin call, bearer token
// included, would go to the proxy. (Loopback URLs are never proxied by Go.)
// The check asks the client's transport where it would send an admin call
// to a remote plugin, without sending anything, in a child process so that
// the proxy variables are read fresh.
func TestClientIgnoresProxyEnvironment(t *testing.T) {
	if os.Getenv("HARD_PROXY_CHILD") == "1" {
		c := NewClient("http://192.0.2.1:28100", ClientOptions{Token: hardToken})
		req, _ := http.NewRequest(http.MethodPost, "http://192.0.2.1:28100"+PathForceFail, nil)
		if tr, ok := c.http.Transport.(*http.Transport); ok && tr.Proxy != nil {
			if u, err := tr.Proxy(req); err == nil && u != nil {
				fmt.Println("ADMIN-CALL-VIA-PROXY", u.Host)
			}
		}
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestClientIgnoresProxyEnvironment$", "-test.v")
	cmd.Env = append(os.Environ(), "HARD_PROXY_CHILD=1", "HTTP_PROXY=http://127.0.0.1:3128", "HTTPS_PROXY=http://127.0.0.1:3128", "NO_PROXY=")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	if bytes.Contains(out, []byte("ADMIN-CALL-VIA-PROXY")) {
		t.Error("with HTTP_PROXY set, the admin call (and its bearer token) to a remote plugin would go to the proxy, not the configured URL")
	}
}

// TestBodyLimits: a listing or an admin answer larger than MaxBodyBytes is
// refused, not truncated (a cut listing would hide rooms), whether it comes
// plain, without an end, or as a gzip bomb; the limit counts decompressed
// bytes.
func TestBodyLimits(t *testing.T) {
	const limit = 4 << 10
	var bomb bytes.Buffer
	zw := gzip.NewWriter(&bomb)
	_, _ = zw.Write(make([]byte, 8<<20))
	_ = zw.Close()
	for _, tc := range []struct {
		name  string
		serve http.HandlerFunc
	}{
		{"one byte over", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(bytes.Repeat([]byte(" "), limit+1)) }},
		{"endless", func(w http.ResponseWriter, r *http.Request) {
			for r.Context().Err() == nil {
				if _, err := w.Write(bytes.Repeat([]byte(" "), 1<<10)); err != nil {
					return
				}
			}
		}},
		{"gzip bomb", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Encoding", "gzip")
			_, _ = w.Write(bomb.Bytes())
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := newHardRecorder(t, tc.serve)
			c := NewClient(srv.URL, ClientOptions{Timeout: 2 * time.Second, AdminTimeout: 2 * time.Second, MaxBodyBytes: limit})
			if _, err := c.Inflight(context.Background()); err == nil || !strings.Contains(err.Error(), "body exceeds 4096 bytes") {
				t.Errorf("listing: err = %v", err)
			}
			if _, _, err := c.ForceFail(context.Background(), hardOrder()); err == nil || !strings.Contains(err.Error(), "body exceeds 4096 bytes") {
				t.Errorf("admin call: err = %v", err)
			}
		})
	}
	srv := newHardRecorder(t, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, exampleListing)
	})
	c := NewClient(srv.URL, ClientOptions{Timeout: time.Second, MaxBodyBytes: int64(len(exampleListing))})
	if _, err := c.Inflight(context.Background()); err != nil {
		t.Errorf("a listing of exactly MaxBodyBytes was refused: %v", err)
	}
}

// bearerTransport sets the Authorization header itself, as the watchdog's
// token-file transport does, so the client never sees the token.
type bearerTransport struct{ token string }

func (b bearerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	req.Header.Set("Authorization", "Bearer "+b.token)
	return directTransport.RoundTrip(req)
}

// TestErrorsNeverCarryATransportsToken: when the admin transport adds the
// token (a token file re-read on every call), an echoed header is still
// redacted, and listing reads do not go through that transport.
func TestErrorsNeverCarryATransportsToken(t *testing.T) {
	var listingAuth []string
	srv := newHardRecorder(t, func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path == PathInflight {
			listingAuth = append(listingAuth, req.Header.Get("Authorization"))
			fmt.Fprint(w, `{"api_version":1,"server":{},"loop":{"iterations":1},"queues":{},"inflight":[]}`)
			return
		}
		w.WriteHeader(http.StatusBadGateway)
		fmt.Fprintf(w, "<html>upstream error; request headers: Authorization: %s</html>", req.Header.Get("Authorization"))
	})
	c := NewClient(srv.URL, ClientOptions{Timeout: time.Second, AdminTimeout: time.Second, AdminTransport: bearerTransport{hardToken}})
	if _, err := c.Inflight(context.Background()); err != nil {
		t.Fatal(err)
	}
	_, _, err := c.ForceFail(context.Background(), hardOrder())
	if err == nil || !strings.Contains(err.Error(), "[REDACTED]") || strings.Contains(err.Error(), hardToken) {
		t.Errorf("err = %v, want the echoed token redacted", err)
	}
	if len(listingAuth) != 1 || listingAuth[0] != "" {
		t.Errorf("listing reads carried Authorization %q", listingAuth)
	}
}
