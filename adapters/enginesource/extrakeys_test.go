package enginesource

import (
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

func extraKeys(t *testing.T, blocks ...[]any) []byte {
	t.Helper()
	v := make([]any, len(blocks))
	for i, b := range blocks {
		if b != nil {
			v[i] = b
		}
	}
	raw, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

// The same prompt cached on three ranks: by tenant A over two events (the
// second continuing the first, with no salt of its own, as vLLM publishes
// a request's next chunk), by tenant B, and from prompt embeddings. Each
// salted request is credited with its own tenant's rank only, an unsalted
// one with none, and the embeddings' blocks match nothing.
func TestSaltsFromExtraKeysFollowTheChain(t *testing.T) {
	p := newTestPub(t, pubOpts{})
	r := newRouter(t, router.WorkerInfo{ID: 1, DPSize: 3})
	s := start(t, Config{Worker: kv.Worker{ID: 1}, Events: p.events(), Replay: p.replay()}, r)
	warmUp(t, p, s)
	a := toks(4, 3)
	r0, r1, r2 := 0, 1, 2
	batch := func(rank *int, e *vllmevents.BlockStored) []byte {
		e.BlockSize, e.Medium = bs, "GPU"
		return encode(t, &vllmevents.Batch{TS: 1, DPRank: rank, Events: []vllmevents.Event{e}})
	}
	p.publish(t, batch(&r0, &vllmevents.BlockStored{BlockHashes: []uint64{100, 101}, TokenIDs: a[:2*bs],
		ExtraKeys: extraKeys(t, []any{"tenant-a"}, nil)}), true)
	p.publish(t, batch(&r0, &vllmevents.BlockStored{BlockHashes: []uint64{102, 103}, ParentBlockHash: kv.Ptr(uint64(101)), TokenIDs: a[2*bs:]}), true)
	p.publish(t, batch(&r1, &vllmevents.BlockStored{BlockHashes: []uint64{200, 201, 202, 203}, TokenIDs: a,
		ExtraKeys: extraKeys(t, []any{"tenant-b"}, nil, nil, nil)}), true)
	seq := p.publish(t, batch(&r2, &vllmevents.BlockStored{BlockHashes: []uint64{300, 301, 302, 303}, TokenIDs: a,
		ExtraKeys: extraKeys(t, []any{[]byte{1}}, []any{[]byte{2}}, []any{[]byte{3}}, []any{[]byte{4}})}), true)
	wait(t, s, seq)
	want := map[string][3]int{"tenant-a": {4, 0, 0}, "tenant-b": {0, 4, 0}, "": {0, 0, 0}}
	for salt, per := range want {
		for _, l := range r.PotentialLoadsFor(&router.Request{Tokens: a, CacheSalt: salt}) {
			if got := l.OverlapBlocks; got != per[l.Worker.DPRank] {
				t.Errorf("salt %q: rank %d credited %d blocks, want %d", salt, l.Worker.DPRank, got, per[l.Worker.DPRank])
			}
		}
	}
	if n := s.Stats().Unsupported["extra_keys=prompt_embeds"]; n != 4 {
		t.Errorf("prompt-embedding blocks counted %d times, want 4", n)
	}
	// A clear forgets the rank's salts: a continuation naming an old
	// parent is not salted any more.
	p.publish(t, encode(t, &vllmevents.Batch{TS: 1, DPRank: &r0, Events: []vllmevents.Event{&vllmevents.AllBlocksCleared{}}}), true)
	wait(t, s, p.publish(t, empty(t), true))
	if s.salts[0].Len() != 0 || s.salts[1].Len() != 4 {
		t.Errorf("salted blocks remembered after rank 0's clear: %d and %d, want 0 and 4", s.salts[0].Len(), s.salts[1].Len())
	}
}
