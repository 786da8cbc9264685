package serve

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/internal/agent"
	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/mocker/fleet"
	"github.com/kvrouter/kvrouter/mocker/server"
)

// roleFleet starts one fast simulated engine playing role.
func roleFleet(t *testing.T, role server.Role) *fleet.Fleet {
	t.Helper()
	return engineFleetWith(t, func(cfg *fleet.Config) {
		cfg.SpeedupRatio = 100
		cfg.Server.Role = role
	})
}

func roleSpec(id uint64, f *fleet.Fleet) WorkerSpec {
	s := spec(id, f)
	s.Role = string(f.Engines()[0].Role)
	return s
}

// pdAnswer is what a client learns of a request's routing.
type pdAnswer struct {
	worker, prefill uint64
	text            string
}

// pdComplete sends a completion, streamed or not, with extra nvext fields.
func pdComplete(s *Server, p []int, stream bool, nvext map[string]any) (pdAnswer, error) {
	if nvext == nil {
		nvext = map[string]any{}
	}
	nvext["extra_fields"] = []string{"worker_id"}
	b, _ := json.Marshal(map[string]any{"model": "kvrouter-mock", "prompt": p, "max_tokens": 4, "stream": stream, "nvext": nvext})
	resp, err := http.Post(s.URL()+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		return pdAnswer{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(resp.Body)
		return pdAnswer{}, fmt.Errorf("%d %s", resp.StatusCode, body)
	}
	type chunk struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
		NVExt *struct {
			WorkerID        uint64 `json:"worker_id"`
			PrefillWorkerID uint64 `json:"prefill_worker_id"`
		} `json:"nvext"`
		Error json.RawMessage `json:"error"`
	}
	var out pdAnswer
	take := func(c chunk) error {
		if len(c.Error) > 0 {
			return fmt.Errorf("error chunk: %s", c.Error)
		}
		if c.NVExt != nil {
			out.worker, out.prefill = c.NVExt.WorkerID, c.NVExt.PrefillWorkerID
		}
		for _, ch := range c.Choices {
			out.text += ch.Text
		}
		return nil
	}
	if !stream {
		var c chunk
		if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
			return out, err
		}
		return out, take(c)
	}
	sc := bufio.NewScanner(resp.Body)
	done := false
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			done = true
			break
		}
		var c chunk
		if err := json.Unmarshal([]byte(line), &c); err != nil {
			return out, err
		}
		if err := take(c); err != nil {
			return out, err
		}
	}
	if !done {
		return out, fmt.Errorf("stream ended without [DONE]")
	}
	return out, nil
}

// metric sums a Prometheus series of the /metrics at url: one named with
// its labels, or every label set of a metric named alone.
func metric(t *testing.T, url, series string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	total := 0.0
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, series) {
			continue
		}
		// A series named in full, or a metric over all its label sets.
		if rest := line[len(series):]; strings.HasPrefix(rest, " ") || !strings.HasSuffix(series, "}") && strings.HasPrefix(rest, "{") {
			var v float64
			fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v)
			total += v
		}
	}
	return total
}

func loadsAreZero(s *Server) bool {
	for _, l := range s.Router().Loads() {
		if l.ActiveRequests != 0 || l.ActivePrefillTokens != 0 || l.ActiveDecodeBlocks != 0 {
			return false
		}
	}
	return true
}

func TestDisaggregatedFleetServesBothClientPaths(t *testing.T) {
	p1, p2 := roleFleet(t, server.RolePrefill), roleFleet(t, server.RolePrefill)
	d1, d2 := roleFleet(t, server.RoleDecode), roleFleet(t, server.RoleDecode)
	s := startServer(t, roleSpec(1, p1), roleSpec(2, p2), roleSpec(3, d1), roleSpec(4, d2))
	if p, d := s.Router().Pools("kvrouter-mock"); p != 2 || d != 2 {
		t.Fatalf("pools %d prefill, %d decode", p, d)
	}
	base := prompt(0, 5, 320) // 20 blocks
	for i, stream := range []bool{false, true, false, true} {
		a, err := pdComplete(s, append(base, prompt(0, 40+i, 32)...), stream, nil)
		if err != nil {
			t.Fatalf("stream=%v: %v", stream, err)
		}
		if a.prefill != 1 && a.prefill != 2 || a.worker != 3 && a.worker != 4 || a.text == "" {
			t.Fatalf("stream=%v: %+v: want a prefill engine (1, 2) and a decode engine (3, 4)", stream, a)
		}
	}
	// Pins: the prefill worker by nvext.prefill_worker_id, the decode
	// worker by backend_instance_id.
	for _, stream := range []bool{false, true} {
		a, err := pdComplete(s, prompt(0, 77, 160), stream, map[string]any{"prefill_worker_id": 2, "backend_instance_id": 3})
		if err != nil || a.prefill != 2 || a.worker != 3 {
			t.Fatalf("pinned stream=%v: %+v %v", stream, a, err)
		}
	}
	pulled := 0.0
	for _, f := range []*fleet.Fleet{d1, d2} {
		pulled += metric(t, f.Engines()[0].HTTPURL, "kvrouter_mocker_kv_transfer_blocks_pulled_total")
	}
	if pulled == 0 {
		t.Fatal("the decode engines pulled no blocks")
	}
	if got := metric(t, s.URL(), `kvrouter_frontend_prefill_decisions_total{model="kvrouter-mock",prefill="remote",reason="disaggregated"}`); got != 6 {
		t.Fatalf("remote prefills: %v, want 6", got)
	}
	testwait.Until(t, 5*time.Second, "loads back to zero in both pools", func() bool { return loadsAreZero(s) })
}

func TestDisaggregatedFallbackWhenEveryPrefillEngineDies(t *testing.T) {
	p1, p2 := roleFleet(t, server.RolePrefill), roleFleet(t, server.RolePrefill)
	d1, d2 := roleFleet(t, server.RoleDecode), roleFleet(t, server.RoleDecode)
	s := startServer(t, roleSpec(1, p1), roleSpec(2, p2), roleSpec(3, d1), roleSpec(4, d2))

	const clients, each = 4, 25
	var (
		done   atomic.Int64
		failed atomic.Int64
		first  error
		mu     sync.Mutex
		wg     sync.WaitGroup
	)
	killed := make(chan struct{})
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				if _, err := pdComplete(s, prompt(64, 1000*c+i, 256), i%2 == 0, nil); err != nil {
					failed.Add(1)
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
				}
				if done.Add(1) == clients*each/4 {
					p1.Close()
					p2.Close()
					close(killed)
				}
			}
		}()
	}
	wg.Wait()
	<-killed
	if n := failed.Load(); n > 0 {
		t.Fatalf("%d of %d requests failed when the prefill engines died; first: %v", n, clients*each, first)
	}
	remote := metric(t, s.URL(), `kvrouter_frontend_prefill_decisions_total{model="kvrouter-mock",prefill="remote",reason="disaggregated"}`)
	if remote == 0 || remote >= clients*each {
		t.Fatalf("remote prefills %v of %d: want some before the kill and none after", remote, clients*each)
	}
	// The dead engines leave routing: the model is aggregated again.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.WaitWorkers(ctx, func(live int) bool { return live == 2 }); err != nil {
		t.Fatal(err)
	}
	if p, _ := s.Router().Pools("kvrouter-mock"); p != 0 {
		t.Fatalf("%d prefill workers left in routing", p)
	}
	a, err := pdComplete(s, prompt(0, 9, 64), false, nil)
	if err != nil || a.prefill != 0 {
		t.Fatalf("after the prefill pool left: %+v %v: want an aggregated answer", a, err)
	}
	testwait.Until(t, 5*time.Second, "loads back to zero", func() bool { return loadsAreZero(s) })
}

func TestDisaggregationFollowsDiscovery(t *testing.T) {
	srv := natsServer(t, t.TempDir(), 0)
	defer srv.Shutdown()
	start := func(id uint64, f *fleet.Fleet) *agent.Agent {
		e := f.Engines()[0]
		a, err := agent.Start(context.Background(), natsConn(t, srv.URL()), agent.Config{
			Events: e.Ranks[0].Events, Replay: e.Ranks[0].Replay, LeaseTTL: testLease, ReportInterval: 100 * time.Millisecond,
			Instance: natsplane.Instance{WorkerID: id, Name: e.Name, Model: "kvrouter-mock", URL: e.HTTPURL, BlockSize: 16, DPSize: 1,
				TotalKVBlocks: 16384, MaxNumBatchedTokens: 8192, Role: string(e.Role)},
		})
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	prefill := start(1, roleFleet(t, server.RolePrefill))
	decode := start(2, roleFleet(t, server.RoleDecode))
	defer decode.Close()
	s := planeServer(t, srv.URL(), "r1", false, false)
	waitLive(t, s, 2)
	if a, err := pdComplete(s, prompt(0, 3, 128), true, nil); err != nil || a.prefill != 1 || a.worker != 2 {
		t.Fatalf("disaggregated: %+v %v", a, err)
	}
	prefill.Kill() // its lease ends: the model is served aggregated, no restart
	waitLive(t, s, 1)
	if a, err := pdComplete(s, prompt(0, 4, 128), true, nil); err != nil || a.prefill != 0 || a.worker != 2 {
		t.Fatalf("after the prefill worker left discovery: %+v %v", a, err)
	}
	// The client reads the stream's last bytes before the handler returns
	// and releases the booking, so the release is awaited, not assumed.
	testwait.Until(t, 5*time.Second, "loads back to zero", func() bool { return loadsAreZero(s) })
}
