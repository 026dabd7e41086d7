// Package cputime reads the CPU time of this process, so that benchmarks can
// report CPU per operation next to wall time (a watch cycle reads its ranks
// in parallel goroutines, so the two differ on a multi-core machine).
package cputime

import "time"

// Process returns the CPU time (user + system, every thread) this process
// has used, or 0 where it cannot be read.
func Process() time.Duration { return process() }
