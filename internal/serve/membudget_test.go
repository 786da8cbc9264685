package serve

import (
	"os"
	"path/filepath"
	"testing"
)

func TestIndexBudgetIsAQuarterOfMemoryAt128BytesAPair(t *testing.T) {
	if got := IndexBudgetPairs(16 << 30); got != 32<<20 {
		t.Fatalf("16 GiB: %d pairs, want 32 Mi", got)
	}
	if got := IndexBudgetPairs(0); got != minIndexBudget {
		t.Fatalf("unknown memory: %d pairs, want the floor %d", got, minIndexBudget)
	}
}

func TestMemoryLimitFiles(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if got := memTotal(write("meminfo", "MemTotal:       16384000 kB\nMemFree: 1 kB\n")); got != 16384000<<10 {
		t.Fatalf("MemTotal: %d", got)
	}
	for content, want := range map[string]uint64{"max\n": 0, "9223372036854771712\n": 0, "2147483648\n": 2 << 30, "junk": 0} {
		if got := cgroupLimit(write("limit", content)); got != want {
			t.Fatalf("cgroup limit %q: %d, want %d", content, got, want)
		}
	}
	if got := cgroupLimit(filepath.Join(dir, "absent")); got != 0 {
		t.Fatalf("absent file: %d", got)
	}
}
