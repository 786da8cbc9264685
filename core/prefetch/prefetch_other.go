//go:build !amd64

// Package prefetch asks the CPU for cache lines ahead of their use; where
// there is no prefetch instruction it does nothing.
package prefetch

import "unsafe"

// Line does nothing without a prefetch instruction: the callers' warm
// passes then only cost their loops.
func Line(p unsafe.Pointer) {}
