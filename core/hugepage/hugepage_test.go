package hugepage

import (
	"testing"
	"unsafe"
)

type slot struct{ k, v uint64 }

func TestMakeIsZeroedAlignedAndSized(t *testing.T) {
	for _, n := range []int{0, 1, 1000, 1 << 17, 1<<17 + 3, 1 << 20} {
		s := Make[slot](n)
		if len(s) != n || cap(s) != n {
			t.Fatalf("Make(%d): len %d cap %d", n, len(s), cap(s))
		}
		for i := range s {
			if s[i] != (slot{}) {
				t.Fatalf("Make(%d)[%d] = %v, want zero", n, i, s[i])
			}
			s[i] = slot{uint64(i), 1}
		}
		if supported && uintptr(n)*16 >= minBytes {
			if p := uintptr(unsafe.Pointer(unsafe.SliceData(s))); p%pageBytes != 0 {
				t.Fatalf("Make(%d) starts at %#x, not on a huge page", n, p)
			}
		}
	}
}

func TestMakeOfOddSizedElements(t *testing.T) {
	type odd struct {
		a uint64
		b [5]byte
	}
	s := Make[odd](1 << 18)
	if len(s) != 1<<18 {
		t.Fatalf("len %d", len(s))
	}
	s[len(s)-1] = odd{a: 1, b: [5]byte{4: 7}}
	if s[len(s)-1].a != 1 || s[0].a != 0 {
		t.Fatal("elements overlap")
	}
}
