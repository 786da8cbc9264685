package engine

import "syscall"

// mapAnon maps size bytes of zeroed, private memory that the kernel backs
// only where it is written (no swap or commit reserved for the rest), or
// returns nil.
func mapAnon(size int) []byte {
	b, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE,
		syscall.MAP_PRIVATE|syscall.MAP_ANON|syscall.MAP_NORESERVE)
	if err != nil {
		return nil
	}
	return b
}

func unmap(b []byte) { _ = syscall.Munmap(b) }

// adviseHuge marks b (on huge page boundaries) for transparent huge pages,
// which a kernel in "madvise" mode otherwise never uses. A refusal changes
// nothing but speed.
func adviseHuge(b []byte) {
	const madvHugepage = 14
	_ = syscall.Madvise(b, madvHugepage)
}

// collapse asks the kernel to gather b's pages into huge pages now
// (MADV_COLLAPSE, Linux 6.1 on) rather than some time later.
func collapse(b []byte) {
	const madvCollapse = 25
	_ = syscall.Madvise(b, madvCollapse)
}
