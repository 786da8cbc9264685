package frontend

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// indexRanks registers ranks workers (ids from 100) and gives each a chain
// of blocks blocks.
func indexRanks(t *testing.T, e *env, ranks, blocks int) {
	t.Helper()
	for r := range ranks {
		id := uint64(100 + r)
		e.router.AddWorker(router.WorkerInfo{ID: id, Model: mockModel, TotalKVBlocks: blocks})
		bs := make([]kv.Block, blocks)
		for i := range bs {
			bs[i] = kv.Block{EngineHash: uint64(r)<<32 | uint64(i+1), LocalHash: uint64(r)<<20 | uint64(i+1)}
		}
		ev := kv.StoredEvent(kv.Worker{ID: id}, 0, nil, bs...)
		if err := e.router.ApplyEvent(&ev); err != nil {
			t.Fatal(err)
		}
	}
}

func (e *env) dumpRequest(token string) *http.Response {
	e.t.Helper()
	req, _ := http.NewRequest("GET", e.srv.URL+"/router/dump_events", nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	return resp
}

// replayDump is the index the streamed dump rebuilds.
func (e *env) replayDump() *index.Index {
	e.t.Helper()
	resp := e.dumpRequest("")
	var evs []kv.Event
	if err := json.NewDecoder(resp.Body).Decode(&evs); err != nil || resp.StatusCode != 200 {
		e.t.Fatalf("%d %v", resp.StatusCode, err)
	}
	resp.Body.Close()
	replay := index.New(index.Config{})
	for i := range evs {
		if err := replay.Apply(&evs[i]); err != nil {
			e.t.Fatalf("event %d: %v", i, err)
		}
	}
	return replay
}

func TestDumpEventsNeedsTheAdminToken(t *testing.T) {
	e := newEnv(t, envOpts{adminToken: testAdmin})
	indexRanks(t, e, 2, 10)
	for _, tok := range []string{"", "wrong"} {
		resp, body := e.do("GET", "/router/dump_events", tok, nil)
		if code := openAIError(t, resp, body, 401); code != "invalid_admin_token" {
			t.Fatalf("token %q: %s", tok, code)
		}
	}
	if resp, body := e.do("GET", "/router/dump_events", testAdmin, nil); resp.StatusCode != 200 {
		t.Fatalf("with the token: %d %.200s", resp.StatusCode, body)
	}
}

// The streamed dump decodes to exactly the index, and serving it allocates
// a small part of what it sends: batches are encoded and flushed one after
// the other instead of the whole list being built.
func TestDumpEventsStreamsTheIndex(t *testing.T) {
	e := newEnv(t, envOpts{})
	const ranks, blocks = 100, 400
	indexRanks(t, e, ranks, blocks)

	replay := e.replayDump()
	for r := range ranks {
		w := kv.Worker{ID: uint64(100 + r)}
		got, want := replay.Held(w), e.router.HeldBlocks(w)
		slices.Sort(got)
		slices.Sort(want)
		if len(want) != blocks || !slices.Equal(got, want) {
			t.Fatalf("rank %v: the dump holds %d blocks, the index %d (want %d)", w, len(got), len(want), blocks)
		}
	}

	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	resp := e.dumpRequest("")
	sent, err := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	runtime.ReadMemStats(&after)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("%d %v", resp.StatusCode, err)
	}
	allocated := after.TotalAlloc - before.TotalAlloc
	t.Logf("dump of %d blocks: %d bytes sent, %d allocated", ranks*blocks, sent, allocated)
	if allocated > uint64(sent)/4 {
		t.Fatalf("serving a dump of %d bytes allocated %d bytes", sent, allocated)
	}
}

func TestDumpEventsOneAtATime(t *testing.T) {
	e := newEnv(t, envOpts{})
	// 21 MB, far more than the sockets buffer: the first dump waits on its
	// reader.
	const ranks, blocks = 100, 1000
	indexRanks(t, e, ranks, blocks)
	first := e.dumpRequest("")
	defer first.Body.Close()
	testwait.Until(t, 10*time.Second, "the first dump to be under way", e.fe.dumping.Load)

	resp, body := e.get("/router/dump_events")
	if code := openAIError(t, resp, body, 429); code != "dump_in_progress" || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("a second dump meanwhile: %s, Retry-After %q", code, resp.Header.Get("Retry-After"))
	}
	whole, err := io.ReadAll(first.Body)
	if err != nil || first.StatusCode != 200 {
		t.Fatalf("the first dump: %d %v", first.StatusCode, err)
	}
	if n := bytes.Count(whole, []byte(`"worker_id"`)); n != ranks*blocks || !bytes.HasSuffix(whole, []byte("]\n")) {
		t.Fatalf("the first dump has %d events of %d", n, ranks*blocks)
	}
	testwait.Until(t, 10*time.Second, "the first dump to end", func() bool { return !e.fe.dumping.Load() })
	if resp, body := e.get("/router/dump_events"); resp.StatusCode != 200 {
		t.Fatalf("a dump after the first: %d %.200s", resp.StatusCode, body)
	}
	if got := testutil.ToFloat64(e.fe.m.dumpsRefused); got != 1 {
		t.Fatalf("%v dumps counted as refused, want 1", got)
	}
}

// The streamed dump carries each block's storage tier: replayed, it
// holds every block on the tiers the router has it on.
func TestDumpEventsCarryTheTier(t *testing.T) {
	e := newEnv(t, envOpts{})
	indexRanks(t, e, 2, 6)
	tiers := []kv.StorageTier{kv.TierDevice, kv.TierHostPinned, kv.TierDisk, kv.TierExternal}
	for r := range 2 {
		w := kv.Worker{ID: uint64(100 + r)}
		for i, tier := range tiers[1:] {
			// Offloaded: the rank's blocks 3.. also on a lower tier,
			// below the parent it holds on the device.
			bs := []kv.Block{{EngineHash: uint64(r)<<32 | uint64(4+i), LocalHash: uint64(r)<<20 | uint64(4+i)}}
			ev := kv.StoredEvent(w, 0, kv.Ptr(uint64(r)<<32|uint64(3+i)), bs...)
			ev.Tier = tier
			if err := e.router.ApplyEvent(&ev); err != nil {
				t.Fatal(err)
			}
		}
	}
	replay := e.replayDump()
	for r := range 2 {
		w := kv.Worker{ID: uint64(100 + r)}
		for _, tier := range tiers {
			got, _ := replay.HeldOn(w, tier)
			want := e.router.HeldBlocksOn(w, tier)
			slices.Sort(got)
			slices.Sort(want)
			if len(want) == 0 || !slices.Equal(got, want) {
				t.Fatalf("rank %v, %s: the dump holds %d blocks, the router %d", w, tier, len(got), len(want))
			}
		}
	}
}
