package bench

import (
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
)

// opLog is one replay goroutine's index operations, recorded ahead of a
// pregenerated run (IndexConfig.Pregenerate) in the order it will play
// them: lookups with their sequence hashes, and the engines' events. Its
// slices are flat so that millions of operations cost a few allocations.
type opLog struct {
	ops     []loggedOp
	seqs    []uint64
	blocks  []kv.Block
	removed []uint64
}

type loggedOp struct {
	kind    uint8 // opFind, opStored, opRemoved
	parent  bool  // stored: the chain hangs below Parent
	worker  kv.Worker
	eventID uint64
	// off and n locate the op's data: sequence hashes for a lookup, blocks
	// for a stored event, engine ids for a removal.
	off, n int
	// want is a lookup's overlap on the engine the request went to, from
	// the engine's own cache; Parent a stored chain's parent.
	want   uint32
	Parent uint64
}

const (
	opFind uint8 = iota
	opStored
	opRemoved
)

// recordFind logs a lookup of seq that must find want blocks on worker w.
func (l *opLog) recordFind(seq []uint64, w kv.Worker, want int) {
	l.ops = append(l.ops, loggedOp{kind: opFind, worker: w, off: len(l.seqs), n: len(seq), want: uint32(want)})
	l.seqs = append(l.seqs, seq...)
}

func (l *opLog) recordEvent(ev *kv.Event) {
	op := loggedOp{worker: ev.Worker, eventID: ev.EventID}
	switch ev.Kind {
	case kv.KindStored:
		op.kind, op.off, op.n = opStored, len(l.blocks), len(ev.Stored.Blocks)
		if ev.Stored.Parent != nil {
			op.parent, op.Parent = true, *ev.Stored.Parent
		}
		l.blocks = append(l.blocks, ev.Stored.Blocks...)
	case kv.KindRemoved:
		op.kind, op.off, op.n = opRemoved, len(l.removed), len(ev.Removed.EngineHashes)
		l.removed = append(l.removed, ev.Removed.EngineHashes...)
	}
	l.ops = append(l.ops, op)
}

// play replays the goroutine's log against the index, timing each call as
// the live replay does, until the log ends or the run stops.
func (rp *replayer) play() {
	l := rp.log
	var lookups uint64
	for i := range l.ops {
		if rp.r.stop.Load() {
			return
		}
		op := &l.ops[i]
		switch op.kind {
		case opFind:
			seq := l.seqs[op.off : op.off+op.n]
			t0 := time.Now()
			ov := rp.ix.FindMatches(&rp.m, seq)
			rp.fm.record(uint64(time.Since(t0)))
			rp.findMatches++
			rp.lookedUp += uint64(op.n)
			lookups++
			got := uint32(0)
			for _, o := range ov {
				if o.Worker == op.worker {
					got = o.Blocks
				}
			}
			rp.hits += uint64(got)
			if got != op.want {
				rp.mismatches++
			}
			rp.cnt.requests.Add(1)
			rp.cnt.ops.Add(1)
			rp.cnt.blockOps.Add(uint64(op.n))
		case opStored:
			rp.ev = kv.Event{Worker: op.worker, Tier: kv.TierDevice, EventID: op.eventID, Kind: kv.KindStored,
				Stored: kv.Stored{Blocks: l.blocks[op.off : op.off+op.n]}}
			if op.parent {
				rp.parent = op.Parent
				rp.ev.Stored.Parent = &rp.parent
			}
			rp.applyEvent()
			rp.stored += uint64(op.n)
			rp.cnt.ops.Add(1)
			rp.cnt.blockOps.Add(uint64(op.n))
		case opRemoved:
			rp.ev = kv.Event{Worker: op.worker, Tier: kv.TierDevice, EventID: op.eventID, Kind: kv.KindRemoved,
				Removed: kv.Removed{EngineHashes: l.removed[op.off : op.off+op.n]}}
			rp.applyEvent()
			rp.removed += uint64(op.n)
			rp.cnt.ops.Add(1)
			rp.cnt.blockOps.Add(uint64(op.n))
		}
	}
}
