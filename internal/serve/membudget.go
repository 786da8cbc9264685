package serve

import (
	"bufio"
	"bytes"
	"os"
	"strconv"
	"strings"
)

// Sizing the index's default budget (--router-max-indexed-pairs 0): a
// quarter of the memory the process may use, at indexPairBytes a pair.
// A (block, worker) pair costs about 113 bytes of heap on a fleet-shaped
// index (a 10 M-block engine took 1.17 GB); 128 leaves room for the
// tables' growth. The other three quarters are for requests in flight,
// their bodies, the tokenizers and the Go runtime's own headroom (its heap
// grows to twice the live data between collections by default).
const (
	indexPairBytes    = 128
	indexMemoryShare  = 4 // the index gets 1/indexMemoryShare of memory
	minIndexBudget    = 1 << 20
	cgroupUnlimitedV1 = 1 << 62 // cgroup v1 writes a page-rounded 2^63-1 for no limit
)

// IndexBudgetPairs is the index's default budget in pairs for a process
// that may use memBytes bytes, at least minIndexBudget (1 Mi pairs, 128 MiB).
func IndexBudgetPairs(memBytes uint64) uint64 {
	return max(memBytes/indexMemoryShare/indexPairBytes, minIndexBudget)
}

// MemoryLimit is the memory this process may use: the machine's total
// (/proc/meminfo), or its cgroup's limit when lower (v2 memory.max, v1
// memory.limit_in_bytes). 0 when none can be read (not Linux).
func MemoryLimit() uint64 {
	limit := memTotal("/proc/meminfo")
	for _, p := range []string{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"} {
		if v := cgroupLimit(p); v > 0 && (limit == 0 || v < limit) {
			limit = v
		}
	}
	return limit
}

func memTotal(path string) uint64 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err != nil {
				return 0
			}
			return kb << 10
		}
	}
	return 0
}

// cgroupLimit reads a cgroup memory limit file: a byte count, or "max"
// (v2) or a near-2^63 value (v1) for none, which read as 0.
func cgroupLimit(path string) uint64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	v, err := strconv.ParseUint(string(bytes.TrimSpace(b)), 10, 64)
	if err != nil || v >= cgroupUnlimitedV1 {
		return 0
	}
	return v
}
