package enginesource

import (
	"bytes"
	"encoding/json"
	"net/http"
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

// A router that starts after the engine cached a salted conversation
// learns it from the engine's dump (one event per block, each naming its
// parent, the salt in the extra keys of the conversation's first block
// only): the salt reaches every block, and only the tenant is credited.
func TestSaltedBlocksFromTheEnginesDump(t *testing.T) {
	e := startFleet(t, 1, vllmevents.EncodingArray)
	p := toks(10, 4)
	for _, n := range []int{6, 10} {
		b, _ := json.Marshal(map[string]any{"prompt": p[:n*bs], "max_tokens": 2, "cache_salt": "tenant-a"})
		resp, err := http.Post(e.HTTPURL+"/v1/completions", "application/json", bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	r := newRouter(t, router.WorkerInfo{ID: 4})
	s := start(t, Config{Worker: kv.Worker{ID: 4}, Events: e.Ranks[0].Events, Dump: e.HTTPURL + "/kv_events/dump"}, r)
	waitFor(t, s, "the dump", func(st Stats) bool { return st.Dumps >= 1 })
	for salt, want := range map[string]int{"tenant-a": 10, "tenant-b": 0, "": 0} {
		for _, l := range r.PotentialLoadsFor(&router.Request{Tokens: p, CacheSalt: salt}) {
			if l.OverlapBlocks != want {
				t.Errorf("salt %q: %d blocks credited, want %d", salt, l.OverlapBlocks, want)
			}
		}
	}
}
