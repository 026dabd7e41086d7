package memlimit

import (
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"testing"
)

func write(t *testing.T, root, file, content string) {
	t.Helper()
	p := filepath.Join(root, file)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestLimit(t *testing.T) {
	for _, tc := range []struct {
		name, file, content string
		want                int64
		ok                  bool
	}{
		{"v2", "memory.max", "134217728\n", 134217728, true},
		{"v2 unlimited", "memory.max", "max\n", 0, false},
		{"v1", "memory/memory.limit_in_bytes", "67108864\n", 67108864, true},
		{"v1 unlimited", "memory/memory.limit_in_bytes", "9223372036854771712\n", 0, false},
		{"garbage", "memory.max", "lots", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			write(t, root, tc.file, tc.content)
			if n, ok := Limit(root); n != tc.want || ok != tc.ok {
				t.Fatalf("Limit = %d, %v; want %d, %v", n, ok, tc.want, tc.ok)
			}
		})
	}
	if _, ok := Limit(t.TempDir()); ok {
		t.Fatal("a limit without a cgroup")
	}
}

// 90% of the container's limit, and GOMEMLIMIT wins when given.
func TestSet(t *testing.T) {
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(-1))
	root := t.TempDir()
	write(t, root, "memory.max", "100000000\n")
	t.Setenv("GOMEMLIMIT", "")
	if got := Set(root); got != 90000000 || debug.SetMemoryLimit(-1) != 90000000 {
		t.Fatalf("Set = %d, runtime limit %d; want 90000000", got, debug.SetMemoryLimit(-1))
	}
	debug.SetMemoryLimit(math.MaxInt64)
	t.Setenv("GOMEMLIMIT", "50MiB")
	if got := Set(root); got != 0 || debug.SetMemoryLimit(-1) != math.MaxInt64 {
		t.Fatalf("with GOMEMLIMIT: Set = %d, want 0 and the limit untouched", got)
	}
}

// The sizing rule holds the footprint measured in BENCHMARKS.md: 42.5 MiB
// at the peak with 13,772 rooms tracked, 21.0 MiB with about 2,000.
func TestForRoomsHoldsTheMeasuredFootprint(t *testing.T) {
	for _, m := range []struct {
		rooms int
		peak  float64 // MiB
	}{{2009, 21.0}, {13772, 42.5}} {
		if got := float64(ForRooms(m.rooms)) / (1 << 20); got < m.peak {
			t.Errorf("ForRooms(%d) = %.1f MiB, below the measured peak of %.1f MiB", m.rooms, got, m.peak)
		}
	}
	if got := RoomsFor(64 << 20); got != 16384 {
		t.Errorf("RoomsFor(64 MiB) = %d, want 16384", got)
	}
	if got := RoomsFor(ForRooms(100000)); got != 100000 {
		t.Errorf("RoomsFor(ForRooms(100000)) = %d", got)
	}
	if got := RoomsFor(16 << 20); got != 0 {
		t.Errorf("RoomsFor(16 MiB) = %d, want 0", got)
	}
}
