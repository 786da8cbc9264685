package hugepage

import "syscall"

const supported = true

// advise marks the whole huge pages inside [p, p+size) for transparent
// huge pages (MADV_HUGEPAGE), which a kernel in "madvise" mode otherwise
// never uses for the Go heap. A refusal changes nothing but speed.
func advise(p, size uintptr) {
	lo := (p + pageBytes - 1) &^ (pageBytes - 1)
	hi := (p + size) &^ (pageBytes - 1)
	if hi <= lo {
		return
	}
	const madvHugepage = 14
	_, _, _ = syscall.Syscall(syscall.SYS_MADVISE, lo, hi-lo, madvHugepage)
}
