package fleet

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/mocker/engine"
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
					if st.BlockSize != 16 || len(st.TokenIDs) != 16*len(st.BlockHashes) || st.Medium.Tier() != kv.TierDevice {
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
