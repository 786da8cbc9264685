// Package workload turns traces and generators into the requests a replay
// sends: token-id prompts with arrival times and output lengths, fully
// materialised before the run so that building them never delays a send.
package workload

import (
	"time"

	"github.com/kvrouter/kvrouter/lab/trace"
)

// Request is one request of a workload.
type Request struct {
	// At is the arrival time from the start of the workload, in the time of
	// the workload itself (before any arrival speedup).
	At     time.Duration
	Tokens []uint32
	// OSL is the number of output tokens to generate (sent as max_tokens
	// with ignore_eos, so the engine produces exactly this many).
	OSL int
	// Session names the multi-turn conversation the request belongs to; ""
	// for a request on its own.
	Session string
	// Think, when positive, makes the request wait for the one before it in
	// its Session (closed loop): a driver that can sends it Think after
	// that one's last token, as an agent sends its next call once the tool
	// has run on the previous answer. At is then the open-loop estimate,
	// which drivers without completions (bench replay) use.
	Think time.Duration
	// CacheSalt is the request's cache_salt: engines cache its blocks
	// apart from every other salt's. "" = none.
	CacheSalt string
}

// FromTrace materialises the first max requests of tr (all with max <= 0)
// in trace order: each hash id becomes its 512 deterministic tokens, the
// last block cut to the input length. Output lengths of 0 become 1: a
// request must produce a first token for its TTFT to exist.
func FromTrace(tr *trace.Trace, max int) []Request {
	reqs := tr.Requests
	if max > 0 && max < len(reqs) {
		reqs = reqs[:max]
	}
	out := make([]Request, len(reqs))
	for i := range reqs {
		out[i] = FromTraceRequest(&reqs[i])
	}
	return out
}

// FromTraceRequest materialises one trace request as FromTrace does, for
// runs that build each prompt only when it is sent: a whole trace's
// prompts take gigabytes. The prompt's slice has room for the output after
// it, so that a simulated engine can take it over instead of copying it
// (engine.Request.Owned).
func FromTraceRequest(r *trace.Request) Request { return FromTraceRequestInto(r, nil) }

// TraceRoom is the capacity of the prompt FromTraceRequest builds for r.
func TraceRoom(r *trace.Request) int {
	return max(len(r.HashIDs)*trace.BlockTokens, r.InputLength+max1(r.OutputLength))
}

// FromTraceRequestInto is FromTraceRequest building the prompt in buf
// when its capacity is at least TraceRoom(r): every token of the prompt
// is written, whatever buf held.
func FromTraceRequestInto(r *trace.Request, buf []uint32) Request {
	return FromTraceRequestFrom(r, buf, 0)
}

// FromTraceRequestFrom is FromTraceRequestInto writing the tokens of the
// prompt's blocks from block skip on only (trace.Request.AppendTokensFrom):
// the first skip blocks hold whatever buf held.
func FromTraceRequestFrom(r *trace.Request, buf []uint32, skip int) Request {
	if room := TraceRoom(r); cap(buf) < room {
		buf = make([]uint32, 0, room)
	}
	return Request{
		At:     time.Duration(r.Timestamp) * time.Millisecond,
		Tokens: r.AppendTokensFrom(buf[:0], 0, skip),
		OSL:    max1(r.OutputLength),
	}
}

func max1(n int) int {
	if n < 1 {
		return 1
	}
	return n
}

// Span is the arrival time of the last request.
func Span(reqs []Request) time.Duration {
	var s time.Duration
	for i := range reqs {
		s = max(s, reqs[i].At)
	}
	return s
}
