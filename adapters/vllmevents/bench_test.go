package vllmevents

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkDecodeStored8192 decodes what an engine publishes for an
// 8,192-token prompt: 512 new 16-token blocks with their token ids, which
// are most of the bytes of a router's KV event stream.
func BenchmarkDecodeStored8192(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 2))
	ev := &BlockStored{BlockHashes: make([]uint64, 512), TokenIDs: make([]uint32, 8192), BlockSize: 16}
	for i := range ev.BlockHashes {
		ev.BlockHashes[i] = rng.Uint64()
	}
	for i := range ev.TokenIDs {
		ev.TokenIDs[i] = rng.Uint32N(150000) // a real vocabulary's range
	}
	for _, enc := range []Encoding{EncodingArray, EncodingMap} {
		p, err := EncodeBatch(&Batch{TS: 1, Events: []Event{ev}}, enc)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(enc.String(), func(b *testing.B) {
			b.SetBytes(int64(len(p)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := DecodeBatch(p); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// Token ids of every encoded width decode exactly, and a payload cut
// anywhere inside them is refused, not misread.
func TestTokenWidths(t *testing.T) {
	ids := []uint32{0, 127, 128, 255, 256, 65535, 65536, 1 << 31, 0xffffffff}
	for _, enc := range []Encoding{EncodingArray, EncodingMap} {
		b := &Batch{TS: 1, Events: []Event{&BlockStored{BlockHashes: []uint64{1}, TokenIDs: ids, BlockSize: len(ids)}}}
		p, err := EncodeBatch(b, enc)
		if err != nil {
			t.Fatal(err)
		}
		got, err := DecodeBatch(p)
		if err != nil {
			t.Fatal(err)
		}
		checkBatch(t, got, b)
		for cut := range len(p) {
			if got, err := DecodeBatch(p[:cut]); err == nil && len(got.Events) > 0 {
				if ev := got.Events[0].(*BlockStored); len(ev.TokenIDs) == len(ids) && ev.TokenIDs[len(ids)-1] != ids[len(ids)-1] {
					t.Fatalf("%v cut at %d: misread tokens %v", enc, cut, ev.TokenIDs)
				}
			}
		}
	}
}
