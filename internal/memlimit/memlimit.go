// Package memlimit sets the Go runtime's soft memory limit from the
// container's cgroup memory limit.
package memlimit

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
)

// Ratio of the cgroup limit given to the Go runtime. The rest is headroom
// for what the runtime does not count against its limit (goroutine stacks
// being grown, memory not yet returned, the binary's own pages): at 100%
// the kernel's OOM killer may strike before the collector works harder.
const Ratio = 0.9

// What the watchdog needs, from BENCHMARKS.md, Footprint (10 minutes, 8
// simulated ranks, wedges piling rooms up): 18-21 MiB of RSS with about
// 1,000-2,000 rooms tracked, of which 11 MiB are the binary's own pages,
// then about 1.6 KiB of RSS per room tracked (1.9 KiB at the high-water
// mark: 42.5 MiB at 13,772 rooms). BaseBytes and RoomBytes round those up,
// so that a container limit of ForRooms(--watchdog.max-rooms) holds the
// peak of a watchdog that tracks every room it may.
const (
	BaseBytes = 32 << 20
	RoomBytes = 2 << 10
)

// ForRooms is the container memory limit a watchdog that may track rooms
// rooms needs: BaseBytes + RoomBytes per room (64 MiB fits 16,384 rooms;
// the default 100,000 needs about 228 MiB).
func ForRooms(rooms int) int64 {
	return BaseBytes + int64(rooms)*RoomBytes
}

// RoomsFor is how many rooms a container limit of limit bytes fits, the
// inverse of ForRooms (0 below BaseBytes).
func RoomsFor(limit int64) int {
	return int(max(0, (limit-BaseBytes)/RoomBytes))
}

// cgroupFiles hold the memory limit: cgroup v2, then v1.
var cgroupFiles = []string{"memory.max", "memory/memory.limit_in_bytes"}

// Limit reads the cgroup memory limit under root (/sys/fs/cgroup), in
// bytes; false when there is none (no cgroup, "max", or v1's "no limit",
// which is near the largest int64).
func Limit(root string) (int64, bool) {
	for _, f := range cgroupFiles {
		b, err := os.ReadFile(filepath.Join(root, f))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return 0, false
		}
		s := strings.TrimSpace(string(b))
		if s == "max" {
			return 0, false
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n <= 0 || n >= math.MaxInt64/2 {
			return 0, false
		}
		return n, true
	}
	return 0, false
}

// Set gives the runtime Ratio of the cgroup limit under root, unless the
// operator set GOMEMLIMIT (the runtime applies that itself). It returns
// the limit set, 0 when none.
func Set(root string) int64 {
	if os.Getenv("GOMEMLIMIT") != "" {
		return 0
	}
	n, ok := Limit(root)
	if !ok {
		return 0
	}
	limit := int64(float64(n) * Ratio)
	debug.SetMemoryLimit(limit)
	return limit
}
