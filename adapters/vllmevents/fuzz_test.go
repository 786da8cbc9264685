package vllmevents

import (
	"errors"
	"math"
	"testing"
)

// FuzzDecodeBatch: no input panics, and whatever decodes re-encodes and
// decodes to the same batch in every encoding.
func FuzzDecodeBatch(f *testing.F) {
	for _, src := range []string{fixArray3, fixArray2Neg, fixBin, fixMapBatch, fixSGLang, fixTrailingMissing, fixExtraTrailing, fixUnknown} {
		f.Add(hx(f, src))
	}
	for _, name := range []string{"sglang/positional-metadata.hx", "sglang/tagged-map.hx", "vllm/v0.26-map-events.hx"} {
		f.Add(readFixture(f, name))
	}
	for _, b := range []*Batch{smallBatch(), fullBatch()} {
		for _, enc := range []Encoding{EncodingArray, EncodingMap, EncodingMapBatch} {
			p, err := EncodeBatch(b, enc)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(p)
		}
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		for _, opts := range []DecodeOptions{{}, {HashBytes: HashFirst8}} {
			b, err := DecodeBatchWith(payload, opts)
			if err != nil {
				if b != nil || !isMalformedBatch(err) {
					t.Fatalf("error %v with batch %v", err, b)
				}
				continue
			}
			for _, s := range b.Skipped {
				if s.Unknown() == isMalformedEvent(s) {
					t.Fatalf("skipped event neither unknown nor malformed, or both: %v", s)
				}
			}
			b.Skipped = nil
			ts := b.TS
			for _, enc := range []Encoding{EncodingArray, EncodingMap, EncodingMapBatch} {
				p, err := EncodeBatch(b, enc)
				if enc == EncodingArray && errors.Is(err, ErrNoPosition) {
					continue
				}
				if err != nil {
					t.Fatalf("re-encode %v: %v", enc, err)
				}
				again, err := DecodeBatch(p)
				if err != nil {
					t.Fatalf("re-decode %v: %v", enc, err)
				}
				if len(again.Skipped) != 0 {
					t.Fatalf("re-decode %v skipped %v", enc, again.Skipped)
				}
				if math.Float64bits(again.TS) != math.Float64bits(b.TS) {
					t.Fatalf("ts %v != %v", again.TS, b.TS)
				}
				again.TS, b.TS = 0, 0
				checkBatch(t, again, b)
				b.TS = ts
			}
		}
	})
}
