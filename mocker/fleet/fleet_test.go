package fleet

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/hftokenizer"
	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/mocker/engine"
	"github.com/kvrouter/kvrouter/mocker/server"
)

func startFleet(t *testing.T, workers, dp int, enc vllmevents.Encoding) *Fleet {
	t.Helper()
	cfg := DefaultConfig()
	cfg.NumWorkers, cfg.DataParallelSize, cfg.SpeedupRatio, cfg.Encoding = workers, dp, 100, enc
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
	cfg.Engine.NumGPUBlocks = 1024
	f, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return f
}

func complete(t *testing.T, url string, prompt []uint32, rank int) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": 2, "data_parallel_rank": rank})
	resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
}

func prompt(n, salt int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(300 + (i*31+salt*977)%90000)
	}
	return out
}

// replayAll fetches every batch a rank published, decoded.
func replayAll(t *testing.T, r Rank) []*vllmevents.Batch {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	msgs, err := zmqevents.Replay(ctx, r.Replay, 0, zmqevents.ReplayConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var out []*vllmevents.Batch
	for i, m := range msgs {
		if m.Seq != uint64(i) {
			t.Fatalf("replay message %d has seq %d", i, m.Seq)
		}
		b, err := vllmevents.DecodeBatch(m.Payload)
		if err != nil {
			t.Fatal(err)
		}
		if len(b.Skipped) > 0 || b.DPRank == nil || *b.DPRank != r.Rank {
			t.Fatalf("batch %d: skipped %v, rank %v (want %d)", i, b.Skipped, b.DPRank, r.Rank)
		}
		out = append(out, b)
	}
	return out
}

func TestEventsOnTheWireFeedTheRouter(t *testing.T) {
	for _, enc := range []vllmevents.Encoding{vllmevents.EncodingArray, vllmevents.EncodingMap} {
		t.Run(enc.String(), func(t *testing.T) {
			f := startFleet(t, 2, 2, enc)
			var buf strings.Builder
			f.PrintTable(&buf)
			if strings.Count(buf.String(), "\n") != 5 || !strings.Contains(buf.String(), "engine-1") {
				t.Fatalf("table:\n%s", buf.String())
			}
			e := f.Engines()[1]
			p := prompt(160, 1) // ten blocks of 16
			complete(t, e.HTTPURL, p, 1)

			r, err := router.New(router.DefaultConfig())
			if err != nil {
				t.Fatal(err)
			}
			for i := range 2 {
				r.AddWorker(router.WorkerInfo{ID: uint64(i), DPSize: 2})
			}
			local := blockhash.New(16, "").LocalHashes(p)
			stored := 0
			for _, b := range replayAll(t, e.Ranks[1]) {
				for _, ev := range b.Events {
					st, ok := ev.(*vllmevents.BlockStored)
					if !ok {
						continue
					}
					if tier, _ := st.Medium.Tier(); st.BlockSize != 16 || len(st.TokenIDs) != 16*len(st.BlockHashes) || tier != kv.TierDevice {
						t.Fatalf("stored event %+v", st)
					}
					for _, h := range st.BlockHashes {
						for _, l := range local {
							if h == l {
								t.Fatal("engine block ids must be opaque, not the router's hashes")
							}
						}
					}
					stored += len(st.BlockHashes)
					err := r.ApplyEngineStored(&router.EngineStored{
						Worker: kv.Worker{ID: 1, DPRank: 1}, Parent: st.ParentBlockHash,
						EngineHashes: st.BlockHashes, Tokens: st.TokenIDs, BlockSize: st.BlockSize,
					})
					if err != nil {
						t.Fatal(err)
					}
				}
			}
			if stored < 10 {
				t.Fatalf("%d blocks stored for a 10-block prompt", stored)
			}
			d, err := r.BestWorker(context.Background(), &router.Request{Tokens: append(p, prompt(64, 2)...)})
			if err != nil {
				t.Fatal(err)
			}
			if d.Worker != (kv.Worker{ID: 1, DPRank: 1}) || d.OverlapBlocks != 10 {
				t.Fatalf("router learned from the wire: %+v, want worker 1 rank 1 with 10 blocks", d)
			}
			if other := replayAll(t, e.Ranks[0]); len(other) != 0 {
				t.Fatalf("rank 0 served nothing but published %d batches", len(other))
			}
			if err := f.PublishErr(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestLiveSubscriberSeesOneBatchPerStep(t *testing.T) {
	f := startFleet(t, 1, 1, vllmevents.EncodingArray)
	e := f.Engines()[0]
	sub, err := zmqevents.NewSubscriber(zmqevents.SubscriberConfig{Endpoint: e.Ranks[0].Events})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	// ZeroMQ drops what is published before the subscription is in place:
	// probe with requests until one arrives (bounded).
	deadline := time.After(10 * time.Second)
	var first zmqevents.Message
probe:
	for i := 0; ; i++ {
		complete(t, e.HTTPURL, prompt(32, 100+i), 0)
		select {
		case first = <-sub.Messages():
			break probe
		case <-time.After(50 * time.Millisecond):
		case <-deadline:
			t.Fatal("no event reached the subscriber")
		}
	}
	complete(t, e.HTTPURL, prompt(48, 7), 0)
	select {
	case m := <-sub.Messages():
		if m.Seq <= first.Seq || m.Missed != 0 {
			t.Fatalf("sequence %d after %d, missed %d", m.Seq, first.Seq, m.Missed)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("second batch never came")
	}
	if tm := f.Timing(); tm.Steps == 0 {
		t.Fatal("no steps timed")
	}
}

func TestStartRejectsBadConfigAndBusyPorts(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NumWorkers = 0
	if _, err := Start(context.Background(), cfg); err == nil {
		t.Fatal("zero workers accepted")
	}
	f := startFleet(t, 1, 1, vllmevents.EncodingArray)
	cfg = DefaultConfig()
	var port int
	fmt.Sscanf(f.Engines()[0].HTTPURL[strings.LastIndex(f.Engines()[0].HTTPURL, ":")+1:], "%d", &port)
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = port, 0, 0
	if _, err := Start(context.Background(), cfg); err == nil {
		t.Fatal("a port in use must be an error")
	}
}

// A rank's dump is its cache: the same blocks as replaying every batch it
// published before the dump's next sequence number.
func TestDumpEqualsTheReplayedEvents(t *testing.T) {
	f := startFleet(t, 1, 2, vllmevents.EncodingArray)
	e := f.Engines()[0]
	for i := range 6 {
		complete(t, e.HTTPURL, prompt(100+i*40, i%3), 1)
	}
	resp, err := http.Get(e.HTTPURL + "/kv_events/dump?dp_rank=1")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	next := resp.Header.Get(vllmevents.DumpNextSeqHeader)
	if resp.StatusCode != 200 || next == "" {
		t.Fatalf("dump: %d, next %q: %s", resp.StatusCode, next, body)
	}
	dump, err := vllmevents.DecodeBatch(body)
	if err != nil {
		t.Fatal(err)
	}
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	r.AddWorker(router.WorkerInfo{ID: 1})
	r.AddWorker(router.WorkerInfo{ID: 2})
	apply := func(id uint64, b *vllmevents.Batch) {
		for _, ev := range b.Events {
			switch e := ev.(type) {
			case *vllmevents.BlockStored:
				if err := r.ApplyEngineStored(&router.EngineStored{Worker: kv.Worker{ID: id}, Parent: e.ParentBlockHash, EngineHashes: e.BlockHashes, Tokens: e.TokenIDs, BlockSize: e.BlockSize}); err != nil {
					t.Fatal(err)
				}
			case *vllmevents.BlockRemoved:
				rm := kv.RemovedEvent(kv.Worker{ID: id}, 0, e.BlockHashes...)
				if err := r.ApplyEvent(&rm); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	apply(1, dump)
	batches := replayAll(t, e.Ranks[1])
	if fmt.Sprint(len(batches)) != next {
		t.Fatalf("dump says next %s after %d published batches", next, len(batches))
	}
	for _, b := range batches {
		apply(2, b)
	}
	fromDump, fromEvents := r.HeldBlocks(kv.Worker{ID: 1}), r.HeldBlocks(kv.Worker{ID: 2})
	slices.Sort(fromDump)
	slices.Sort(fromEvents)
	if len(fromDump) == 0 || !slices.Equal(fromDump, fromEvents) {
		t.Fatalf("dump holds %d blocks, the events %d; they must be the same", len(fromDump), len(fromEvents))
	}

	resp, err = http.Get(e.HTTPURL + "/kv_events/dump?dp_rank=2")
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), `"invalid_request_error"`) {
		t.Fatalf("dump of a rank the engine does not have: %d %s", resp.StatusCode, body)
	}
}

// An engine started without KV events caches as usual but publishes
// nothing, until it is turned on; its other ranks and engines are alike.
func TestSilentEnginePublishesFromWhenItIsTurnedOn(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NumWorkers, cfg.SpeedupRatio, cfg.NoKVEvents = 2, 100, true
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
	f, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	e := f.Engines()
	complete(t, e[0].HTTPURL, prompt(64, 1), 0)
	if _, next := f.Buffered(0, 0); next != 0 {
		t.Fatalf("a silent engine published %d batches", next)
	}
	var cached int
	if err := f.Inspect(context.Background(), 0, 0, func(_ uint64, blocks []engine.CachedBlock) { cached = len(blocks) }); err != nil || cached != 4 {
		t.Fatalf("the silent engine caches %d blocks (%v), want 4", cached, err)
	}

	f.SetKVEvents(0, true)
	complete(t, e[0].HTTPURL, prompt(64, 2), 0)
	complete(t, e[1].HTTPURL, prompt(64, 3), 0)
	stored := 0
	for _, b := range replayAll(t, e[0].Ranks[0]) {
		for _, ev := range b.Events {
			if st, ok := ev.(*vllmevents.BlockStored); ok {
				stored += len(st.BlockHashes)
			}
		}
	}
	if stored != 4 {
		t.Fatalf("turned on, the engine published %d stored blocks, want the second prompt's 4", stored)
	}
	if _, next := f.Buffered(1, 0); next != 0 {
		t.Fatalf("the other silent engine published %d batches", next)
	}
}

// TestPrefillAndDecodeEnginesInOneFleet: a fleet started with roles serves
// a disaggregated request across its engines, each rank of the prefill
// named apart (vLLM's "_dp<rank>"), and the decode rank publishes the
// pulled blocks as Stored.
func TestPrefillAndDecodeEnginesInOneFleet(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NumWorkers, cfg.DataParallelSize, cfg.SpeedupRatio = 3, 2, 100
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
	cfg.Engine.NumGPUBlocks = 1024
	cfg.Roles = []server.Role{server.RolePrefill, server.RoleDecode} // engine 2: Server.Role, both
	f, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	es := f.Engines()
	if es[0].Role != server.RolePrefill || es[1].Role != server.RoleDecode || es[2].Role != server.RoleBoth {
		t.Fatalf("roles %v %v %v", es[0].Role, es[1].Role, es[2].Role)
	}
	var table strings.Builder
	f.PrintTable(&table)
	if !strings.Contains(table.String(), "ROLE") || !strings.Contains(table.String(), "prefill") {
		t.Fatalf("table:\n%s", table.String())
	}
	var role struct {
		Role          string   `json:"role"`
		RankEngineIDs []string `json:"rank_engine_ids"`
	}
	getJSON(t, es[0].HTTPURL+"/role", &role)
	if role.Role != "prefill" || len(role.RankEngineIDs) != 2 || !strings.HasSuffix(role.RankEngineIDs[1], "_dp1") {
		t.Fatalf("role %+v", role)
	}

	p := prompt(100, 3) // 6 full blocks
	var pre struct {
		KV map[string]any `json:"kv_transfer_params"`
	}
	postJSON(t, es[0].HTTPURL+"/v1/completions", map[string]any{"prompt": p, "max_tokens": 1, "data_parallel_rank": 1,
		"kv_transfer_params": map[string]any{"do_remote_decode": true}}, &pre)
	if pre.KV["remote_engine_id"] != role.RankEngineIDs[1] || len(pre.KV["remote_block_ids"].([]any)) != 6 {
		t.Fatalf("kv_transfer_params %v", pre.KV)
	}
	var dec struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	postJSON(t, es[1].HTTPURL+"/v1/completions", map[string]any{"prompt": p, "max_tokens": 3, "data_parallel_rank": 0, "kv_transfer_params": pre.KV}, &dec)
	if dec.Usage.Details.Cached != 96 {
		t.Fatalf("the decode computed what it should have pulled: cached %d", dec.Usage.Details.Cached)
	}
	stored := 0
	for _, b := range replayAll(t, es[1].Ranks[0]) {
		for _, ev := range b.Events {
			if st, ok := ev.(*vllmevents.BlockStored); ok {
				stored += len(st.BlockHashes)
			}
		}
	}
	if stored != 6 {
		t.Fatalf("the decode stored %d blocks, want the 6 pulled", stored)
	}
	if m := es[0].Ranks[1].Runner.Metrics(); m.HeldBlocks != 0 || m.CachedBlocks != 6 {
		t.Fatalf("prefill rank after the pull: %+v", m)
	}
}

func TestFleetRefusesBadRoles(t *testing.T) {
	for _, tc := range []struct {
		name  string
		roles []server.Role
		want  string
	}{
		{"unknown role", []server.Role{"encode"}, "role must be"},
		{"more roles than engines", []server.Role{server.RolePrefill, server.RoleDecode}, "2 roles for 1 engines"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
			cfg.Roles = tc.roles
			f, err := Start(context.Background(), cfg)
			if err == nil {
				f.Close()
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Start: %v, want an error with %q", err, tc.want)
			}
		})
	}
}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatal(err)
	}
}

func postJSON(t *testing.T, url string, body, v any) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("%s: %d %s", url, resp.StatusCode, raw)
	}
	if err := json.Unmarshal(raw, v); err != nil {
		t.Fatalf("%s: %v: %s", url, err, raw)
	}
}

// TestTokenizerStoresTheRealIDs starts a fleet with Config.Tokenizer: the
// KV events of a text prompt carry the ids the tokenizer computes.
func TestTokenizerStoresTheRealIDs(t *testing.T) {
	const dir = "../../adapters/hftokenizer/testdata/llama3_1"
	cfg := DefaultConfig()
	cfg.SpeedupRatio, cfg.Tokenizer = 100, dir
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
	f, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	tok, err := hftokenizer.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Repeat("Blocks hash the ids the router computes. ", 10)
	want, _ := tok.Encode(text, true)
	b, _ := json.Marshal(map[string]any{"prompt": text, "max_tokens": 1})
	resp, err := http.Post(f.Engines()[0].HTTPURL+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	// The response comes after the step that stored the prompt's blocks.
	var stored []uint32
	for _, batch := range replayAll(t, f.Engines()[0].Ranks[0]) {
		for _, ev := range batch.Events {
			if st, ok := ev.(*vllmevents.BlockStored); ok {
				stored = append(stored, st.TokenIDs...)
			}
		}
	}
	full := len(want) / cfg.Engine.BlockSize * cfg.Engine.BlockSize
	if len(stored) < full || !slices.Equal(stored[:full], want[:full]) {
		t.Fatalf("stored blocks hold %v, want the prompt's full blocks %v", stored, want[:full])
	}
	cfg.Tokenizer = "/nonexistent/tokenizer.json"
	if _, err := Start(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), cfg.Tokenizer) {
		t.Fatalf("a missing tokenizer: error %v, want one naming it", err)
	}
}

// With a host tier the dump lists the host's blocks too, with medium CPU:
// the same ids as the host events published so far add up to.
func TestDumpListsTheHostTier(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NumWorkers, cfg.SpeedupRatio = 1, 100
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
	cfg.Engine.NumGPUBlocks, cfg.Engine.NumCPUBlocks = 64, 256
	f, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	e := f.Engines()[0]
	// 6 prompts of 30 blocks on 64 GPU blocks: the first ones are on the
	// host only by the end.
	for i := range 6 {
		complete(t, e.HTTPURL, prompt(30*16, 1000*i+1), 0)
	}
	resp, err := http.Get(e.HTTPURL + "/kv_events/dump?dp_rank=0")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("dump: %d %s", resp.StatusCode, body)
	}
	dump, err := vllmevents.DecodeBatch(body)
	if err != nil {
		t.Fatal(err)
	}
	dumped := map[vllmevents.Medium]map[uint64]bool{"GPU": {}, "CPU": {}}
	for _, ev := range dump.Events {
		st, ok := ev.(*vllmevents.BlockStored)
		if !ok || dumped[st.Medium] == nil {
			t.Fatalf("dump event %#v: want BlockStored on GPU or CPU", ev)
		}
		if len(st.TokenIDs) != 16 {
			t.Fatalf("dumped %s block with %d tokens, want its 16", st.Medium, len(st.TokenIDs))
		}
		for _, h := range st.BlockHashes {
			dumped[st.Medium][h] = true
		}
	}
	replayed := map[vllmevents.Medium]map[uint64]bool{"GPU": {}, "CPU": {}}
	for _, b := range replayAll(t, e.Ranks[0]) {
		for _, ev := range b.Events {
			switch ev := ev.(type) {
			case *vllmevents.BlockStored:
				for _, h := range ev.BlockHashes {
					replayed[ev.Medium][h] = true
				}
			case *vllmevents.BlockRemoved:
				for _, h := range ev.BlockHashes {
					delete(replayed[ev.Medium], h)
				}
			}
		}
	}
	onlyHost := 0
	for h := range replayed["CPU"] {
		if !replayed["GPU"][h] {
			onlyHost++
		}
	}
	if onlyHost == 0 {
		t.Fatal("no block left the GPU for the host: the test proves nothing")
	}
	for m := range replayed {
		if !maps.Equal(dumped[m], replayed[m]) {
			t.Errorf("medium %s: the dump lists %d blocks, the events add up to %d", m, len(dumped[m]), len(replayed[m]))
		}
	}
}
