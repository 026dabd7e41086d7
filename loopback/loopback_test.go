package loopback

import "testing"

func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		url string
		ok  bool
	}{
		{"http://127.0.0.1:28100", true},
		{"http://127.3.4.5:1/metrics", true},
		{"http://localhost:30000/metrics", true},
		{"http://[::1]:28100", true},
		{"http://10.0.0.7:28100", false},
		{"http://example.invalid:28100", false},
		{"ftp://127.0.0.1/", false},
		{"127.0.0.1:28100", false},
		{"http://", false},
	} {
		err := Check(tc.url)
		if (err == nil) != tc.ok {
			t.Errorf("Check(%q) = %v, want ok=%v", tc.url, err, tc.ok)
		}
	}
}
