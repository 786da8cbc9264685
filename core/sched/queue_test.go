package sched

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

var t0 = time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)

func mustQueue(t *testing.T, p QueuePolicy) *Queue {
	t.Helper()
	q, err := NewQueue(p)
	if err != nil {
		t.Fatal(err)
	}
	return q
}

func drain(q *Queue) []string {
	var ids []string
	for {
		it, ok := q.Pop()
		if !ok {
			return ids
		}
		ids = append(ids, it.ID)
	}
}

// referenceKey restates the documented keys independently of Queue.
func referenceKey(p QueuePolicy, it QueueItem) float64 {
	jump := math.Max(0, it.Priority)
	offset := it.Arrival.Sub(t0).Seconds()
	switch p {
	case FCFS:
		return jump - offset
	case LCFS:
		return jump + offset
	}
	return (1 + jump) / math.Max(1, float64(it.UncachedTokens))
}

func TestQueueOrder(t *testing.T) {
	for _, p := range []QueuePolicy{FCFS, LCFS, WSPT} {
		t.Run(string(p), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(13, 14))
			for trial := range 50 {
				q := mustQueue(t, p)
				items := make([]QueueItem, 1+rng.IntN(200))
				total := 0
				for i := range items {
					items[i] = QueueItem{
						ID: fmt.Sprint(i),
						// Whole milliseconds, shuffled, with repeats: ties happen.
						Arrival:        t0.Add(time.Duration(rng.IntN(50)) * time.Millisecond),
						Priority:       float64(rng.IntN(4)-1) * 0.01, // −0.01 .. 0.02 s
						UncachedTokens: rng.IntN(40) - 2,              // ≤ 0 floors to 1
					}
					total += max(0, items[i].UncachedTokens)
				}
				items[0].Arrival = t0 // the reference measures offsets from t0
				for _, it := range items {
					if err := q.Push(it); err != nil {
						t.Fatal(err)
					}
				}
				if q.Len() != len(items) || q.PendingTokens() != total {
					t.Fatalf("Len %d, PendingTokens %d; want %d, %d", q.Len(), q.PendingTokens(), len(items), total)
				}
				want := slices.Clone(items)
				slices.SortStableFunc(want, func(a, b QueueItem) int {
					return cmp.Compare(referenceKey(p, b), referenceKey(p, a))
				})
				if head, _ := q.Peek(); head.ID != want[0].ID {
					t.Fatalf("Peek = %s, want %s", head.ID, want[0].ID)
				}
				got := drain(q)
				for i := range want {
					if got[i] != want[i].ID {
						t.Fatalf("trial %d: position %d is %s, want %s", trial, i, got[i], want[i].ID)
					}
				}
				if q.PendingTokens() != 0 {
					t.Fatalf("PendingTokens %d after drain", q.PendingTokens())
				}
			}
		})
	}
}

func TestQueuePriorityJump(t *testing.T) {
	for _, tc := range []struct {
		policy QueuePolicy
		items  []QueueItem
		want   []string
	}{
		{FCFS, []QueueItem{
			{ID: "old", Arrival: t0},
			{ID: "vip", Arrival: t0.Add(5 * time.Second), Priority: 10},
			{ID: "late-vip", Arrival: t0.Add(20 * time.Second), Priority: 10},
			{ID: "negative", Arrival: t0.Add(time.Second), Priority: -100},
		}, []string{"vip", "old", "negative", "late-vip"}},
		{LCFS, []QueueItem{
			{ID: "a", Arrival: t0},
			{ID: "b", Arrival: t0.Add(time.Second)},
			{ID: "vip", Arrival: t0, Priority: 2},
		}, []string{"vip", "b", "a"}},
		{WSPT, []QueueItem{
			{ID: "long", Arrival: t0, UncachedTokens: 1000},
			{ID: "short", Arrival: t0, UncachedTokens: 100},
			{ID: "long-vip", Arrival: t0, UncachedTokens: 1000, Priority: 19}, // 20/1000 > 1/100
			{ID: "nan", Arrival: t0, UncachedTokens: 1000, Priority: math.NaN()},
		}, []string{"long-vip", "short", "long", "nan"}},
	} {
		q := mustQueue(t, tc.policy)
		for _, it := range tc.items {
			if err := q.Push(it); err != nil {
				t.Fatal(err)
			}
		}
		if got := drain(q); !slices.Equal(got, tc.want) {
			t.Errorf("%s: order %v, want %v", tc.policy, got, tc.want)
		}
	}
}

// A higher strict-priority tier goes first whatever the policy would say:
// an old, short, high-priority request of a lower tier waits behind a new,
// long one of a higher tier.
func TestQueueStrictPriorityTiersPrecedeThePolicy(t *testing.T) {
	items := []QueueItem{
		{ID: "old-short-vip", Arrival: t0, UncachedTokens: 10, Priority: 100},
		{ID: "tier2-late-long", Arrival: t0.Add(30 * time.Second), UncachedTokens: 5000, Tier: 2},
		{ID: "tier1", Arrival: t0.Add(10 * time.Second), UncachedTokens: 100, Tier: 1},
		{ID: "tier2-early-long", Arrival: t0.Add(20 * time.Second), UncachedTokens: 6000, Tier: 2},
		{ID: "plain", Arrival: t0.Add(time.Second), UncachedTokens: 50},
	}
	for _, tc := range []struct {
		policy QueuePolicy
		want   []string
	}{
		{FCFS, []string{"tier2-early-long", "tier2-late-long", "tier1", "old-short-vip", "plain"}},
		{LCFS, []string{"tier2-late-long", "tier2-early-long", "tier1", "old-short-vip", "plain"}},
		{WSPT, []string{"tier2-late-long", "tier2-early-long", "tier1", "old-short-vip", "plain"}},
	} {
		q := mustQueue(t, tc.policy)
		for _, it := range items {
			if err := q.Push(it); err != nil {
				t.Fatal(err)
			}
		}
		// A newcomer of the top tier still goes ahead of lower tiers.
		if err := q.Push(QueueItem{ID: "tier2-newest", Arrival: t0.Add(time.Minute), UncachedTokens: 1 << 20, Tier: 2}); err != nil {
			t.Fatal(err)
		}
		got := drain(q)
		if i := slices.Index(got, "tier2-newest"); i > 2 {
			t.Errorf("%s: a top-tier newcomer served at position %d, behind lower tiers: %v", tc.policy, i, got)
		}
		got = slices.DeleteFunc(got, func(id string) bool { return id == "tier2-newest" })
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: order %v, want %v", tc.policy, got, tc.want)
		}
	}
}

func TestQueueRemove(t *testing.T) {
	q := mustQueue(t, FCFS)
	for i := range 10 {
		if err := q.Push(QueueItem{ID: fmt.Sprint(i), Arrival: t0.Add(time.Duration(i) * time.Second), UncachedTokens: 10, Payload: i}); err != nil {
			t.Fatal(err)
		}
	}
	if err := q.Push(QueueItem{ID: "3"}); !errors.Is(err, ErrDuplicateID) {
		t.Errorf("duplicate push: %v", err)
	}
	for _, id := range []string{"0", "5", "9", "3"} {
		if !q.Remove(id) {
			t.Errorf("Remove(%s) = false", id)
		}
	}
	if q.Remove("5") || q.Remove("nope") {
		t.Error("Remove of an absent id reported true")
	}
	if q.Len() != 6 || q.PendingTokens() != 60 {
		t.Errorf("Len %d, PendingTokens %d; want 6, 60", q.Len(), q.PendingTokens())
	}
	head, _ := q.Peek()
	if head.Payload != 1 {
		t.Errorf("payload %v, want 1", head.Payload)
	}
	if got, want := drain(q), []string{"1", "2", "4", "6", "7", "8"}; !slices.Equal(got, want) {
		t.Errorf("order after removals %v, want %v", got, want)
	}
	if _, ok := q.Pop(); ok {
		t.Error("Pop on empty queue")
	}
	if _, ok := q.Peek(); ok {
		t.Error("Peek on empty queue")
	}
	if err := q.Push(QueueItem{ID: "3"}); err != nil {
		t.Errorf("re-push after removal: %v", err)
	}
}

func TestParseQueue(t *testing.T) {
	if _, err := NewQueue("lifo"); err == nil {
		t.Error("NewQueue accepted lifo")
	}
	for in, want := range map[string]QueuePolicy{"fcfs": FCFS, "LCFS": LCFS, " wspt": WSPT} {
		if got, err := ParseQueuePolicy(in); err != nil || got != want {
			t.Errorf("ParseQueuePolicy(%q) = %q, %v", in, got, err)
		}
	}
	for _, tc := range []struct {
		in   string
		want float64 // 0: disabled, -1: error
	}{
		{"16", 16}, {"0.5", 0.5}, {"none", 0}, {"None", 0}, {"0", -1}, {"-1", -1}, {"NaN", -1}, {"Inf", -1}, {"x", -1},
	} {
		got, err := ParseQueueThreshold(tc.in)
		switch {
		case tc.want < 0 && err == nil, tc.want >= 0 && err != nil:
			t.Errorf("ParseQueueThreshold(%q): %v, %v", tc.in, got, err)
		case tc.want == 0 && got != nil, tc.want > 0 && (got == nil || *got != tc.want):
			t.Errorf("ParseQueueThreshold(%q) = %v", tc.in, got)
		}
	}
}

func TestShouldQueue(t *testing.T) {
	sat := Candidate{ActivePrefillTokens: 2001, MaxNumBatchedTokens: 1000}
	edge := Candidate{ActivePrefillTokens: 2000, MaxNumBatchedTokens: 1000}
	unknown := Candidate{ActivePrefillTokens: 1 << 30}
	two := 2.0
	for _, tc := range []struct {
		name  string
		cands []Candidate
		thr   *float64
		want  bool
	}{
		{"all saturated", []Candidate{sat, sat}, &two, true},
		{"disabled", []Candidate{sat, sat}, nil, false},
		{"no workers", nil, &two, false},
		{"one at the threshold", []Candidate{sat, edge}, &two, false},
		{"unknown budget never saturated", []Candidate{sat, unknown}, &two, false},
		{"default threshold", []Candidate{{ActivePrefillTokens: 16*8192 + 1, MaxNumBatchedTokens: 8192}}, f(DefaultQueueThreshold), true},
	} {
		if got := ShouldQueue(tc.cands, tc.thr); got != tc.want {
			t.Errorf("%s: ShouldQueue = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestNeedsRefresh(t *testing.T) {
	for _, tc := range []struct {
		waited, after time.Duration
		want          bool
	}{
		{9 * time.Second, DefaultRefreshAfter, false},
		{10 * time.Second, DefaultRefreshAfter, true},
		{time.Hour, 0, false},
		{time.Second, time.Second, true},
	} {
		if got := NeedsRefresh(t0, t0.Add(tc.waited), tc.after); got != tc.want {
			t.Errorf("waited %v, refresh after %v: %v, want %v", tc.waited, tc.after, got, tc.want)
		}
	}
}
