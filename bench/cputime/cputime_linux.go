package cputime

import (
	"syscall"
	"time"
	"unsafe"
)

const clockProcessCPUTimeID = 2 // CLOCK_PROCESS_CPUTIME_ID

func process() time.Duration {
	var ts syscall.Timespec
	if _, _, e := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockProcessCPUTimeID, uintptr(unsafe.Pointer(&ts)), 0); e != 0 {
		return 0
	}
	return time.Duration(ts.Nano())
}
