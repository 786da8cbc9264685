package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// sharedPrefixPrompt is one of eight 4-block prefixes followed by two
// blocks and a few tokens of its own.
func sharedPrefixPrompt(prefix, salt int) []int {
	p := prompt(64, 0, 64)
	for i := range p {
		p[i] += prefix * 1009
	}
	return append(p, prompt(0, 1000+salt, 37)...)
}

func sendCompletion(url string, p []int) error {
	b, _ := json.Marshal(map[string]any{"model": "kvrouter-mock", "prompt": p, "max_tokens": 2})
	resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("completion: %s", resp.Status)
	}
	return nil
}

// burst sends four requests at once to url and waits for them.
func burst(t *testing.T, url string, n *int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		*n++
		p := sharedPrefixPrompt(*n%8, *n)
		wg.Go(func() { errs <- sendCompletion(url, p) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

// dumpSet reads a dump (single-block Stored events, parents first) as the
// set of its blocks' sequence hashes.
func dumpSet(t *testing.T, payload []byte) map[uint64]bool {
	t.Helper()
	b, err := vllmevents.DecodeBatch(payload)
	if err != nil {
		t.Fatal(err)
	}
	h := blockhash.New(16, "")
	seqOf := map[uint64]uint64{}
	out := map[uint64]bool{}
	for _, ev := range b.Events {
		st := ev.(*vllmevents.BlockStored)
		seq := h.LocalHash(st.TokenIDs)
		if st.ParentBlockHash != nil {
			seq = blockhash.Chain(seqOf[*st.ParentBlockHash], seq)
		}
		seqOf[st.BlockHashes[0]] = seq
		out[seq] = true
	}
	return out
}

// A router started after the engine's replay ring wrapped must end up
// holding exactly the engine's cache under continued traffic: at once from
// the engine's dump when it has one, from the traffic it routes when it has
// none (vLLM); also when the router's block size is not the engine's.
func TestRouterStartedAfterTheRingWrappedConverges(t *testing.T) {
	for _, tc := range []struct {
		name            string
		dump            bool
		maxBursts       int
		routerBlockSize int
	}{{"dump", true, 2, 16}, {"traffic only", false, 80, 16}, {"dump, router block size 64", true, 2, 64}, {"traffic only, router block size 64", false, 80, 64}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := fleet.DefaultConfig()
			cfg.SpeedupRatio = 100
			cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
			cfg.Engine.NumGPUBlocks = 256
			cfg.ReplayBufferSize = 16
			f, err := fleet.Start(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(f.Close)
			e := f.Engines()[0]

			// Traffic nobody routes, until the ring no longer starts at 0.
			n := 0
			for wrapped := false; !wrapped; {
				burst(t, e.HTTPURL, &n)
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				msgs, err := zmqevents.Replay(ctx, e.Ranks[0].Replay, 0, zmqevents.ReplayConfig{})
				cancel()
				if err != nil {
					t.Fatal(err)
				}
				wrapped = len(msgs) > 0 && msgs[0].Seq > 0
			}

			w := FleetWorkers(f, cfg)[0]
			if !tc.dump {
				w.Dump = ""
			}
			rcfg := router.DefaultConfig()
			rcfg.BlockSize = tc.routerBlockSize
			s := startServerWith(t, Config{Router: rcfg, Workers: []WorkerSpec{w}, HealthInterval: 50 * time.Millisecond})
			worker := kv.Worker{ID: w.ID}
			src := s.Sources(w.ID)[0]
			routerURL := "http://" + s.Addr()
			for i := 1; ; i++ {
				burst(t, routerURL, &n)
				// Between bursts the engine is idle: its dump is its final
				// state, and the router has it once it applied every
				// batch the dump covers.
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				next, payload, err := enginesource.FetchDump(ctx, http.DefaultClient, e.HTTPURL+"/kv_events/dump")
				if err != nil {
					cancel()
					t.Fatal(err)
				}
				if next > 0 {
					err = src.WaitSeq(ctx, next-1)
				}
				cancel()
				if err != nil && i < tc.maxBursts {
					// The burst's last batch was lost on the way: only the
					// next burst's batches show the gap, and replay
					// closes it.
					t.Logf("burst %d: the router did not reach seq %d: %v", i, next-1, err)
					continue
				}
				if err != nil {
					t.Fatal(err)
				}
				want, got := dumpSet(t, payload), map[uint64]bool{}
				for _, seq := range s.Router().HeldBlocks(worker) {
					got[seq] = true
				}
				missing, extra := 0, 0
				for k := range want {
					if !got[k] {
						missing++
					}
				}
				for k := range got {
					if !want[k] {
						extra++
					}
				}
				if extra > 0 {
					t.Fatalf("burst %d: the router claims %d blocks the engine does not hold", i, extra)
				}
				if missing == 0 {
					t.Logf("router holds the engine's %d blocks after %d bursts (source %+v)", len(want), i, src.Stats())
					break
				}
				if i == tc.maxBursts {
					t.Fatalf("after %d bursts the router misses %d of the engine's %d blocks (index %+v)", i, missing, len(want), s.Router().Stats().Index)
				}
			}
			if st := src.Stats(); tc.dump != (st.Dumps > 0) || tc.dump == (st.HistoryLost > 0) {
				t.Fatalf("source stats %+v: want a dump loaded = %v and history lost = %v", st, tc.dump, !tc.dump)
			}
			if !tc.dump {
				get := func(path string) string {
					resp, err := http.Get(routerURL + path)
					if err != nil {
						t.Fatal(err)
					}
					defer resp.Body.Close()
					body, _ := io.ReadAll(resp.Body)
					return string(body)
				}
				if h := get("/health"); !strings.Contains(h, `"degraded"`) || !strings.Contains(h, `"kv_index":"recovering`) {
					t.Fatalf("/health does not report the recovering rank: %s", h)
				}
				if want := `kvrouter_worker_kv_index_recovering{dp_rank="0",worker_id="1"} 1`; !strings.Contains(get("/metrics"), want) {
					t.Fatalf("/metrics lacks %s", want)
				}
			}
		})
	}
}
