package enginesource

import (
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"log/slog"
	"os"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// golden are block hashes vLLM's own hashing computes (sha256_cbor over
// parent, tokens and extra keys), written by testdata/vllm_block_hashes.py,
// which follows vLLM's kv_cache_utils.py of the 0.19 series and
// vllm/utils/hashing.py at commit ac621345a4eb18058bb24b242b457f634d476b40.
type golden struct {
	BlockSize int `json:"block_size"`
	Requests  []struct {
		Name   string   `json:"name"`
		Tokens []uint32 `json:"tokens"`
		LoRA   string   `json:"lora"`
		Salt   string   `json:"salt"`
		MM     []struct {
			Identifier string `json:"identifier"`
		} `json:"mm"`
		EngineHashes []string `json:"engine_hashes"`
		ExtraKeys    []any    `json:"extra_keys"`
	} `json:"requests"`
}

// eventSide hashes a request's blocks as the router does from the engine's
// events: the blocks published in two events (the second continuing the
// first, so it carries no salt), extra keys encoded as vLLM's msgspec
// encodes them and read back by this source. Multimodal identifiers enter
// as the (identifier, offset) pairs name them.
func eventSide(t *testing.T, bs int, lora string, tokens []uint32, engine []uint64, extra []any) []uint64 {
	t.Helper()
	s := &Source{log: slog.New(slog.DiscardHandler)}
	var local []uint64
	for _, span := range [][2]int{{0, 1}, {1, len(engine)}} {
		from, to := span[0], span[1]
		raw, err := msgpack.Marshal(extra[from:to])
		if err != nil {
			t.Fatal(err)
		}
		e := &vllmevents.BlockStored{BlockHashes: engine[from:to], TokenIDs: tokens[from*bs : to*bs], BlockSize: bs, LoRAName: lora, ExtraKeys: raw}
		if from > 0 {
			e.ParentBlockHash = kv.Ptr(engine[from-1])
		}
		keys, kerr := vllmevents.ParseExtraKeys(raw)
		if kerr != nil {
			t.Fatal(kerr)
		}
		mm := make([][]uint64, len(keys))
		for i, block := range keys {
			for _, k := range block {
				if k.Kind == vllmevents.ExtraIdentifierOffset {
					id, _ := blockhash.HashMMIdentifier(k.Str)
					mm[i] = append(mm[i], id)
				}
			}
		}
		es := router.EngineStored{Parent: e.ParentBlockHash, EngineHashes: e.BlockHashes, Tokens: e.TokenIDs, BlockSize: bs, LoRA: lora,
			Salt: s.storedSalt(0, e, keys), MM: withMarks(mm, s.apartMarks(e, keys, false))}
		ev, _, err := router.HashEngineStored(&es, bs)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range ev.Stored.Blocks {
			local = append(local, b.LocalHash)
		}
	}
	return blockhash.SequenceHashes(local)
}

// For every pair of requests and every block position, vLLM gives the two
// blocks the same hash exactly when the router's hash of them from the
// engine's events is the same, and, for requests without images (whose
// request-side identity another part of the router computes), exactly
// when the router's hash of the requests is: the router credits a cached
// block to a request exactly when the engine would reuse it.
func TestRouterHashesAgreeWithVLLMsBlockIdentity(t *testing.T) {
	raw, err := os.ReadFile("testdata/vllm_block_hashes.json")
	if err != nil {
		t.Fatal(err)
	}
	var g golden
	if err := json.Unmarshal(raw, &g); err != nil {
		t.Fatal(err)
	}
	n := len(g.Requests)
	vllm, events, requests := make([][]string, n), make([][]uint64, n), make([][]uint64, n)
	for r, req := range g.Requests {
		engine := make([]uint64, len(req.EngineHashes))
		for i, h := range req.EngineHashes {
			b, err := hex.DecodeString(h)
			if err != nil || len(b) != 32 {
				t.Fatalf("%s: engine hash %q", req.Name, h)
			}
			engine[i] = binary.BigEndian.Uint64(b[24:]) // as vLLM's int block hashes keep the low 64 bits
		}
		vllm[r] = req.EngineHashes
		events[r] = eventSide(t, g.BlockSize, req.LoRA, req.Tokens, engine, req.ExtraKeys)
		if len(req.MM) == 0 {
			_, requests[r] = blockhash.NewKeyed(g.BlockSize, req.LoRA, req.Salt).Hashes(req.Tokens)
			for i := range requests[r] {
				if requests[r][i] != events[r][i] {
					t.Errorf("%s, block %d: the request hashes to %x, the engine's event to %x", req.Name, i, requests[r][i], events[r][i])
				}
			}
		}
	}
	for a := range n {
		for b := range n {
			for i := 0; i < len(vllm[a]) && i < len(vllm[b]); i++ {
				same := vllm[a][i] == vllm[b][i]
				if got := events[a][i] == events[b][i]; got != same {
					t.Errorf("%q and %q, block %d: vLLM same %v, router's event hashes same %v", g.Requests[a].Name, g.Requests[b].Name, i, same, got)
				}
				if requests[a] != nil && requests[b] != nil {
					if got := requests[a][i] == requests[b][i]; got != same {
						t.Errorf("%q and %q, block %d: vLLM same %v, router's request hashes same %v", g.Requests[a].Name, g.Requests[b].Name, i, same, got)
					}
				}
			}
		}
	}
}
