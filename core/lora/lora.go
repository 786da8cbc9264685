// Package lora places LoRA adapters on engines by rendezvous hashing
// (highest random weight): every engine gets a score for an adapter, and
// the adapter belongs on the engine with the highest. Adding or removing
// an engine moves only the adapters whose highest-scoring engine it is, so
// routers that agree on the engines agree on the placement without talking
// to each other.
//
// The score is XXH3-64 of the adapter's name followed by the engine id as
// 8 little-endian bytes, ties going to the lower id. Dynamo scores the
// same (name, worker id) shape with BLAKE3 and adds the data-parallel
// rank; kvrouter places per engine, since an engine loads an adapter for
// all its ranks at once.
package lora

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// Score is the engine's weight for the adapter.
func Score(adapter string, engine uint64) uint64 {
	buf := make([]byte, len(adapter)+8)
	copy(buf, adapter)
	binary.LittleEndian.PutUint64(buf[len(adapter):], engine)
	return xxh3.Hash(buf)
}

// Choose returns the engine, among engines, the adapter belongs on; ok is
// false when there are none.
func Choose(adapter string, engines []uint64) (best uint64, ok bool) {
	var bestScore uint64
	for _, e := range engines {
		s := Score(adapter, e)
		if !ok || s > bestScore || (s == bestScore && e < best) {
			best, bestScore, ok = e, s, true
		}
	}
	return best, ok
}
