//go:build !linux

package router

import "time"

// threadCPU reads no thread CPU time outside Linux.
func threadCPU() (time.Duration, bool) { return 0, false }
