package eventlog

import (
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
)

func chain(w kv.Worker, parent *uint64, hashes ...uint64) kv.Event {
	blocks := make([]kv.Block, len(hashes))
	for i, h := range hashes {
		blocks[i] = kv.Block{EngineHash: h, LocalHash: h * 31}
	}
	return kv.StoredEvent(w, 0, parent, blocks...)
}

func TestAppendNumbersPerRankAndRefusesOrphans(t *testing.T) {
	l := New(7, 4)
	r0, r1 := kv.Worker{ID: 99, DPRank: 0}, kv.Worker{ID: 7, DPRank: 1}
	ev, err := l.Append(chain(r0, nil, 1, 2))
	if err != nil || ev.EventID != 1 || ev.Worker.ID != 7 {
		t.Fatalf("first: %+v %v (want id 1, worker forced to 7)", ev, err)
	}
	if ev, _ := l.Append(chain(r1, nil, 5)); ev.EventID != 1 {
		t.Fatalf("rank 1 numbers on its own: got %d", ev.EventID)
	}
	if _, err := l.Append(chain(r0, kv.Ptr(404), 3)); err == nil {
		t.Fatal("orphan accepted")
	}
	if ev, _ := l.Append(chain(r0, kv.Ptr(2), 3)); ev.EventID != 2 {
		t.Fatalf("refused event consumed an id: next got %d", ev.EventID)
	}
	if l.Last(0) != 2 || l.Last(1) != 1 || l.Last(5) != 0 {
		t.Fatalf("lasts %d %d %d", l.Last(0), l.Last(1), l.Last(5))
	}
	if !slices.Equal(l.Ranks(), []uint32{0, 1}) {
		t.Fatalf("ranks %v", l.Ranks())
	}
}

func TestRangeWithinAndBeyondTheRing(t *testing.T) {
	l := New(1, 4)
	w := kv.Worker{ID: 1}
	var parent *uint64
	for h := uint64(1); h <= 10; h++ {
		if _, err := l.Append(chain(w, parent, h)); err != nil {
			t.Fatal(err)
		}
		parent = kv.Ptr(h)
	}
	tests := []struct {
		name     string
		from, to uint64
		ok       bool
	}{
		{"newest four", 7, 10, true},
		{"one", 9, 9, true},
		{"left the ring", 6, 10, false},
		{"not yet", 9, 11, false},
		{"zero", 0, 3, false},
		{"reversed", 9, 8, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			evs, ok := l.Range(0, tc.from, tc.to)
			if ok != tc.ok {
				t.Fatalf("ok %v, want %v", ok, tc.ok)
			}
			for i, ev := range evs {
				if ev.EventID != tc.from+uint64(i) || ev.Stored.Blocks[0].EngineHash != ev.EventID {
					t.Fatalf("event %d: %+v", i, ev)
				}
			}
		})
	}
	if _, ok := l.Range(3, 1, 1); ok {
		t.Fatal("unknown rank answered")
	}
}

// The dump must rebuild exactly the blocks the rank holds now: compare an
// index fed every event with one fed only the dump.
func TestDumpRebuildsTheRank(t *testing.T) {
	l := New(1, 2)
	w := kv.Worker{ID: 1}
	full := index.New(index.Config{})
	evs := []kv.Event{
		chain(w, nil, 1, 2, 3),
		chain(w, kv.Ptr(2), 4),
		kv.RemovedEvent(w, 0, 3),
		chain(w, nil, 9),
		kv.ClearedEvent(w, 0),
		chain(w, nil, 11, 12),
		chain(w, kv.Ptr(11), 13),
		kv.RemovedEvent(w, 0, 12),
	}
	for _, ev := range evs {
		got, err := l.Append(ev)
		if err != nil {
			t.Fatal(err)
		}
		if err := full.Apply(&got); err != nil {
			t.Fatal(err)
		}
	}
	dump, last := l.Dump(0)
	if last != uint64(len(evs)) {
		t.Fatalf("last %d", last)
	}
	rebuilt := index.New(index.Config{})
	for i := range dump {
		if err := rebuilt.Apply(&dump[i]); err != nil {
			t.Fatal(err)
		}
	}
	if a, b := full.Dump(), rebuilt.Dump(); !slices.EqualFunc(a, b, sameEvent) || len(a) != 2 {
		t.Fatalf("dump differs:\n%v\n%v", a, b)
	}
}

func sameEvent(a, b kv.Event) bool {
	return a.Worker == b.Worker && a.Kind == b.Kind &&
		slices.Equal(a.Stored.Blocks, b.Stored.Blocks) &&
		(a.Stored.Parent == nil) == (b.Stored.Parent == nil) &&
		(a.Stored.Parent == nil || *a.Stored.Parent == *b.Stored.Parent)
}

func TestCursorVerdicts(t *testing.T) {
	c := NewCursor()
	w := kv.Worker{ID: 3, DPRank: 1}
	if v := c.Check(w, 1); v != Unsynced {
		t.Fatalf("fresh rank: %v", v)
	}
	c.Set(w, 5)
	tests := []struct {
		id   uint64
		want Verdict
	}{{3, Duplicate}, {5, Duplicate}, {6, Apply}, {7, Gap}, {100, Gap}}
	for _, tc := range tests {
		if v := c.Check(w, tc.id); v != tc.want {
			t.Errorf("id %d: %v, want %v", tc.id, v, tc.want)
		}
	}
	if c.Next(w) != 6 || !c.Behind(w, 6) || c.Behind(w, 5) {
		t.Fatal("next/behind")
	}
	c.Forget(3)
	if c.Synced(w) || c.Behind(w, 9) {
		t.Fatal("forgotten rank still tracked")
	}
}

func BenchmarkAppend(b *testing.B) {
	l := New(1, DefaultRingSize)
	w := kv.Worker{ID: 1}
	blocks := make([]kv.Block, 16)
	var h uint64
	for b.Loop() {
		for i := range blocks {
			h++
			blocks[i] = kv.Block{EngineHash: h, LocalHash: h}
		}
		if _, err := l.Append(kv.StoredEvent(w, 0, nil, blocks...)); err != nil {
			b.Fatal(err)
		}
		if h%(1<<16) == 0 {
			_, _ = l.Append(kv.ClearedEvent(w, 0)) // keep the index bounded
		}
	}
}

func BenchmarkRange(b *testing.B) {
	l := New(1, DefaultRingSize)
	w := kv.Worker{ID: 1}
	for h := uint64(1); h <= 2*DefaultRingSize; h++ {
		_, _ = l.Append(kv.StoredEvent(w, 0, nil, kv.Block{EngineHash: h, LocalHash: h}))
	}
	for b.Loop() {
		if _, ok := l.Range(0, 2*DefaultRingSize-99, 2*DefaultRingSize); !ok {
			b.Fatal("range")
		}
	}
}
