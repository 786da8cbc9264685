package sim

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/lab/bench"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

func pdConfig(prefill, decode int) Config {
	cfg := smallConfig()
	cfg.Workers = 0
	cfg.Disagg.PrefillWorkers, cfg.Disagg.DecodeWorkers = prefill, decode
	return cfg
}

// runSim runs w to its end and fails the test on a loop error.
func runSim(t *testing.T, cfg Config, mode string, w Workload, speedup float64) *sim {
	t.Helper()
	cfg.listsBlocks = true
	s, err := newSim(cfg, mode, w, speedup)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.run(); err != nil {
		t.Fatal(err)
	}
	return s
}

// On a disaggregated fleet every request ends once, no booking, queued
// request or held block is left behind in either pool, and each engine's
// cache is what the router's index says it is.
func TestDisaggConservation(t *testing.T) {
	tight := 0.01
	busy := 1500
	cases := []struct {
		name    string
		mode    string
		speedup float64
		edit    func(*Config)
		agentic bool
		check   func(t *testing.T, s *sim, d *DisaggStats)
	}{
		{"kv, events at once", "kv", 1, func(c *Config) { c.KVEventDelay = 0 }, false, nil},
		{"kv, delayed events", "kv", 2, nil, false, nil},
		{"admission queue in both pools", "kv", 16, func(c *Config) { c.Router.QueueThreshold = &tight }, false,
			func(t *testing.T, s *sim, d *DisaggStats) {
				if s.queuedBy[dispPrefill] == 0 {
					t.Fatalf("queued: %d prefills, %d decodes: the prefill pool's queue held nothing", s.queuedBy[dispPrefill], s.queuedBy[dispDecode])
				}
				// Each pool has its own queue: a decode never waits behind a
				// prefill waiting for prefill engines full of blocks held
				// for that decode, so no prefill runs into its timeout.
				if d.LocalPrefills.PrefillTimeout != 0 {
					t.Fatalf("%d prefills given up after %v: decodes waited behind prefills", d.LocalPrefills.PrefillTimeout, DefaultPrefillTimeout)
				}
			}},
		{"conditional", "kv", 2, func(c *Config) { c.Disagg.MinUncachedTokens = 512 }, false,
			func(t *testing.T, _ *sim, d *DisaggStats) {
				if d.LocalPrefills.ShortUncached == 0 || d.RemotePrefills == 0 {
					t.Fatalf("conditional disaggregation kept everything in one place: %+v", d)
				}
			}},
		{"prefill engine busy", "kv", 4, func(c *Config) {
			c.Disagg.PrefillWorkers, c.Disagg.DecodeWorkers = 1, 3
			c.Router.Busy.ActivePrefillTokens = &busy
		}, false, func(t *testing.T, _ *sim, d *DisaggStats) {
			if d.LocalPrefills.PrefillBusy == 0 || d.RemotePrefills == 0 {
				t.Fatalf("no local prefill for a busy prefill engine: %+v", d)
			}
		}},
		{"Dynamo's decode routing", "kv", 2, func(c *Config) { c.Disagg.NoAssumeKVReuse = true }, false, nil},
		{"round-robin", "round-robin", 2, nil, false, nil},
		{"llm-d-precise reads engine load", "llm-d-precise", 2, nil, false, nil},
		{"data-parallel ranks", "kv", 2, func(c *Config) { c.DPSize = 2; c.Disagg.PrefillWorkers, c.Disagg.DecodeWorkers = 1, 1 }, false, nil},
		{"closed-loop agent sessions", "kv", 8, nil, true, nil},
	}
	syn := synthetic(t, 240)
	ac := workload.DefaultAgenticConfig()
	ac.Requests, ac.SystemTokens, ac.ToolResultTokens = 240, 1024, 256
	reqs, err := workload.Agentic(ac)
	if err != nil {
		t.Fatal(err)
	}
	agent := FromRequests(reqs)
	for _, tc := range cases {
		w := syn
		if tc.agentic {
			w = agent
		}
		t.Run(tc.name, func(t *testing.T) {
			cfg := pdConfig(2, 2)
			if tc.edit != nil {
				tc.edit(&cfg)
			}
			s := runSim(t, cfg, tc.mode, w, tc.speedup)
			for i, rs := range s.reqs {
				if !rs.finished || rs.failed || rs.first < rs.arrival || rs.done < rs.first {
					t.Fatalf("request %d: %+v", i, rs)
				}
				if pd := s.pd[i]; pd.how == howUnknown || pd.how == howRemote && (pd.pfirst < rs.arrival || pd.pfirst+pd.transfer > rs.first) {
					t.Fatalf("request %d: %+v, %+v", i, rs, pd)
				}
			}
			if s.errors != 0 || len(s.held) != 0 {
				t.Fatalf("%d errors (%v), %d prompts still kept", s.errors, s.firstErr, len(s.held))
			}
			for _, l := range s.r.Loads() {
				if l.ActiveRequests != 0 || l.ActiveDecodeBlocks != 0 || l.ActivePrefillTokens != 0 {
					t.Fatalf("load left on %v: %+v", l.Worker, l)
				}
			}
			if st := s.r.Stats(); st.QueuePending != 0 {
				t.Fatalf("%d requests left in the queue", st.QueuePending)
			}
			d := s.point().Disagg
			if d == nil || d.RemotePrefills+d.LocalPrefills.Total() != len(s.reqs) {
				t.Fatalf("prefills %+v for %d requests", d, len(s.reqs))
			}
			if d.RemotePrefills == 0 {
				t.Fatal("nothing was prefilled remotely")
			}
			pools := map[bool]int{}
			for i := range s.engines {
				se := &s.engines[i]
				m := se.eng.Metrics()
				if m.HeldBlocks != 0 || m.ActiveBlocks != 0 {
					t.Fatalf("engine %d (prefill %v): %d blocks held, %d active at the end", i, se.prefill, m.HeldBlocks, m.ActiveBlocks)
				}
				pools[se.prefill] += int(m.RequestsFinished)
				want := bench.EngineSeqs(blockhash.New(cfg.Engine.BlockSize, ""), se.eng.CachedBlocks())
				got := map[uint64]bool{}
				for _, h := range s.r.HeldBlocks(se.w) {
					got[h] = true
				}
				if len(want) == 0 {
					t.Fatalf("engine %d (prefill %v) caches nothing", i, se.prefill)
				}
				if len(got) != len(want) {
					t.Fatalf("engine %d (prefill %v): index holds %d blocks, engine %d", i, se.prefill, len(got), len(want))
				}
				for h := range want {
					if !got[h] {
						t.Fatalf("engine %d: block %x missing from the index", i, h)
					}
				}
			}
			// Every request decoded once; the remote ones prefilled once,
			// and a prefill given up may have finished anyway.
			if lp := d.LocalPrefills; pools[false] != len(s.reqs) || pools[true] < d.RemotePrefills || pools[true] > d.RemotePrefills+lp.PrefillTimeout {
				t.Fatalf("engines finished %d decodes and %d prefills, want %d and %d (+ up to %d timed out)", pools[false], pools[true], len(s.reqs), d.RemotePrefills, lp.PrefillTimeout)
			}
			if tc.check != nil {
				tc.check(t, s, d)
			}
		})
	}
}

func seqPrompt(from, n int) []uint32 {
	toks := make([]uint32, n)
	for i := range toks {
		toks[i] = uint32(from + i)
	}
	return toks
}

// One request on one prefill and one decode engine, by hand: the prefill
// engine computes the whole prompt in one step, the decode engine pulls
// every full block (it caches none) and computes the last prompt token
// (and a partial block's) before its first token.
func TestDisaggTTFTByHand(t *testing.T) {
	const bs = 16
	for _, tc := range []struct {
		name   string
		tokens int
	}{
		{"whole blocks", 4 * bs},
		{"a partial block", 4*bs + 6},
		{"under one block", 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := pdConfig(1, 1)
			cfg.Engine.BlockSize, cfg.Router.BlockSize = bs, bs
			w := Requests{{Tokens: seqPrompt(1, tc.tokens), OSL: 3}}
			s := runSim(t, cfg, "kv", w, 1)
			rs, pd := s.reqs[0], s.pd[0]
			full := tc.tokens / bs
			computed := tc.tokens - full*bs // what the decode engine computes
			if full > 0 && computed == 0 {
				computed = 1 // the last prompt token, always
			}
			transfer := time.Duration(float64(full*bs*DefaultKVBytesPerToken) / DefaultKVTransferBandwidth * 1e9)
			wantPrefill := engine.PrefillTime(tc.tokens)
			want := wantPrefill + transfer + engine.StepTime(computed, 0, 0)
			if pd.how != howRemote || int(pd.pulled) != full || pd.kept != 0 {
				t.Fatalf("%+v: want a remote prefill pulling %d blocks", pd, full)
			}
			if got := time.Duration(pd.pfirst - rs.arrival); got != wantPrefill {
				t.Errorf("prefill TTFT %v, want %v", got, wantPrefill)
			}
			if got := time.Duration(pd.transfer); got != transfer {
				t.Errorf("transfer %v, want %v", got, transfer)
			}
			if got := time.Duration(rs.first - rs.arrival); got != want {
				t.Errorf("TTFT %v, want prefill %v + transfer %v + decode step %v = %v", got, wantPrefill, transfer, engine.StepTime(computed, 0, 0), want)
			}
			p := s.point()
			if d := p.Disagg; d.RemotePrefills != 1 || d.TransferredBlocks != float64(full) || d.TransferredBytes != float64(full*bs*DefaultKVBytesPerToken) {
				t.Errorf("stats %+v", d)
			}
		})
	}
}

// A second request sharing the first one's prompt decodes where that
// prompt is cached and pulls only its own blocks; routed as Dynamo routes
// decode (no reuse, no credit), it goes to the idle decode engine instead
// and pulls everything.
func TestDisaggDecodeRoutingFollowsTransfer(t *testing.T) {
	const bs = 16
	shared := seqPrompt(1, 32*bs)
	second := append(append([]uint32{}, shared...), seqPrompt(100_000, 2*bs)...)
	w := Requests{
		{Tokens: shared, OSL: 400}, // still decoding when the second arrives
		{At: 500 * time.Millisecond, Tokens: second, OSL: 4},
	}
	run := func(noReuse bool) pdState {
		cfg := pdConfig(1, 2)
		cfg.Engine.BlockSize, cfg.Router.BlockSize = bs, bs
		cfg.Disagg.NoAssumeKVReuse = noReuse
		if noReuse {
			// As the command sets it: --no-router-assume-kv-reuse.
			off := false
			cfg.Router.Routing.AssumeKVReuse = &off
		}
		s := runSim(t, cfg, "kv", w, 1)
		a, b := s.pd[0], s.pd[1]
		if a.how != howRemote || b.how != howRemote || a.pulled != 32 {
			t.Fatalf("no reuse %v: %+v, %+v", noReuse, a, b)
		}
		if s.reqs[0].done < s.reqs[1].arrival {
			t.Fatal("the first request ended before the second arrived")
		}
		b.pe = a.de // where the first one decoded, for the caller
		return b
	}
	aware := run(false)
	if aware.de != aware.pe || aware.pulled != 2 || aware.kept != 32 {
		t.Fatalf("transfer-aware: decoded on engine %d (the first on %d), pulled %d blocks, had %d; want the same engine, 2 pulled, 32 kept",
			aware.de, aware.pe, aware.pulled, aware.kept)
	}
	dynamo := run(true)
	if dynamo.de == dynamo.pe || dynamo.pulled != 34 {
		t.Fatalf("Dynamo's decode routing: decoded on engine %d (the first on %d), pulled %d blocks; want the other engine, 34 pulled",
			dynamo.de, dynamo.pe, dynamo.pulled)
	}
}

// A disaggregated sweep is a function of its inputs; an aggregated one's
// results.json has no disaggregation fields.
func TestDisaggSweepIsDeterministic(t *testing.T) {
	w := synthetic(t, 160)
	sweep := func(cfg Config) []byte {
		res, err := Sweep(SweepConfig{
			Sim: cfg, Modes: []string{"kv", "round-robin"},
			ArrivalSpeedups: []float64{1, 4}, SLOTTFTP90: 200 * time.Millisecond, BisectSteps: 2,
		}, w)
		if err != nil {
			t.Fatal(err)
		}
		res.WallS = 0
		b, err := JSON(res)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	cfg := pdConfig(2, 2)
	cfg.Disagg.MinUncachedTokens = 256
	a, b := sweep(cfg), sweep(cfg)
	if !bytes.Equal(a, b) {
		t.Fatalf("two sweeps differ:\n%s\n%s", a, b)
	}
	var res Results
	if err := json.Unmarshal(a, &res); err != nil {
		t.Fatal(err)
	}
	if c := res.Config.Disagg; c == nil || c.PrefillWorkers != 2 || c.DecodeWorkers != 2 || res.Config.Workers != 4 || c.MinUncachedTokens != 256 {
		t.Fatalf("config %+v, disagg %+v", res.Config, res.Config.Disagg)
	}
	for _, mode := range res.Order {
		for _, p := range res.Modes[mode].Points {
			if p.Disagg == nil || p.Disagg.RemotePrefills == 0 || p.Disagg.TransferredBlocks <= 0 {
				t.Fatalf("%s ×%g: %+v", mode, p.ArrivalSpeedup, p.Disagg)
			}
		}
	}
	var md bytes.Buffer
	if err := Markdown(&md, &res); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(md.String(), "2 prefill, 2 decode") || !strings.Contains(md.String(), "| pulled blocks |") {
		t.Fatalf("report without the disaggregation figures:\n%s", md.String())
	}
	agg := sweep(smallConfig())
	if bytes.Contains(agg, []byte("disagg")) {
		t.Fatal("an aggregated results.json has disaggregation fields")
	}
}
