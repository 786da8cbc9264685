package sim

import (
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/lab/trace"
)

func traceAt(t *testing.T, stamps ...int64) *Trace {
	t.Helper()
	tr := &trace.Trace{}
	for _, ms := range stamps {
		tr.Requests = append(tr.Requests, trace.Request{Timestamp: ms, InputLength: 16, OutputLength: 1})
	}
	w, err := FromTrace(tr, 0)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func arrivals(w *Trace) []time.Duration {
	out := make([]time.Duration, w.Len())
	for i := range out {
		out[i] = w.At(i)
	}
	return out
}

func TestSpreadBatches(t *testing.T) {
	ms := time.Millisecond
	for _, tc := range []struct {
		name   string
		stamps []int64
		want   []time.Duration
	}{
		{"batches over the gap to the next timestamp", []int64{0, 0, 0, 3000, 3000, 6000},
			[]time.Duration{0, 1000 * ms, 2000 * ms, 3000 * ms, 4500 * ms, 6000 * ms}},
		{"the last batch over the mean gap", []int64{0, 4000, 4000},
			[]time.Duration{0, 4000 * ms, 6000 * ms}},
		{"distinct timestamps unchanged", []int64{5, 7, 100},
			[]time.Duration{5 * ms, 7 * ms, 100 * ms}},
		{"one batch alone stays at its instant", []int64{10, 10},
			[]time.Duration{10 * ms, 10 * ms}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := traceAt(t, tc.stamps...)
			w.SpreadBatches()
			if got := arrivals(w); !slices.Equal(got, tc.want) {
				t.Fatalf("arrivals %v, want %v", got, tc.want)
			}
		})
	}
}
