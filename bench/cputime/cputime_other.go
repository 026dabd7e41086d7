//go:build !linux

package cputime

import "time"

func process() time.Duration { return 0 }
