package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/mocker/engine"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// RecoveryConfig sets up `kvrouter bench recovery`: one simulated engine
// under shared-prefix traffic through a router that is restarted once the
// engine's replay ring has wrapped.
type RecoveryConfig struct {
	Speedup      float64
	Blocks       int // the engine's KV blocks
	BufferSteps  int // batches the engine keeps for replay
	Prefixes     int // distinct shared prefixes
	PrefixTokens int
	MinUser      int // unique prompt tokens per request, uniform in [MinUser, MaxUser]
	MaxUser      int
	MinOutput    int // max_tokens, uniform in [MinOutput, MaxOutput]
	MaxOutput    int
	Concurrency  int
	Traffic      time.Duration // through the first router, before the restart
	Observe      time.Duration // after the restart
	Sample       time.Duration // how often router and engine are compared
	// Dump lets the restarted router load the engine's /kv_events/dump;
	// without it the router has only the events (as with vLLM).
	Dump bool
	Seed uint64
}

// DefaultRecoveryConfig is the reference scenario: one engine at speedup
// 10 with 16,384 blocks, 64 shared 512-token prefixes, 30 s of traffic.
func DefaultRecoveryConfig() RecoveryConfig {
	return RecoveryConfig{Speedup: 10, Blocks: 16384, BufferSteps: zmqevents.DefaultBufferSize, Prefixes: 64, PrefixTokens: 512,
		MinUser: 64, MaxUser: 1024, MinOutput: 16, MaxOutput: 128, Concurrency: 32,
		Traffic: 30 * time.Second, Observe: 20 * time.Second, Sample: 500 * time.Millisecond, Dump: true, Seed: 1}
}

// RecoverySample compares the restarted router's view of the engine with
// the engine's cache at one instant (the engine paused between two steps,
// the router caught up with every batch it had published). Blocks are
// counted per storage tier: a block the engine holds on its device and
// its host is two, and the router must hold it on both.
type RecoverySample struct {
	AfterSec     float64 `json:"after_s"` // since the restarted router started
	EngineBlocks int     `json:"engine_blocks"`
	RouterBlocks int     `json:"router_blocks"`
	// EngineLowerBlocks and RouterLowerBlocks are the part of the blocks
	// above held on a lower tier (host, disk, shared).
	EngineLowerBlocks int  `json:"engine_lower_tier_blocks"`
	RouterLowerBlocks int  `json:"router_lower_tier_blocks"`
	Missing           int  `json:"missing"` // engine (block, tier) pairs the router does not know
	Extra             int  `json:"extra"`   // router (block, tier) pairs the engine does not hold
	Behind            bool `json:"behind"`  // the router had not applied every batch yet
}

// recoveryTiers are the storage tiers a sample compares.
var recoveryTiers = []kv.StorageTier{kv.TierDevice, kv.TierHostPinned, kv.TierDisk, kv.TierExternal}

// compare fills the sample's counts from the engine's blocks (sequence
// hashes by tier) and the router's, tier by tier.
func (smp *RecoverySample) compare(engine map[kv.StorageTier]map[uint64]bool, router func(kv.StorageTier) []uint64) {
	for _, tier := range recoveryTiers {
		want, got := engine[tier], router(tier)
		smp.EngineBlocks += len(want)
		smp.RouterBlocks += len(got)
		if tier != kv.TierDevice {
			smp.EngineLowerBlocks += len(want)
			smp.RouterLowerBlocks += len(got)
		}
		have := make(map[uint64]bool, len(got))
		for _, s := range got {
			have[s] = true
			if !want[s] {
				smp.Extra++
			}
		}
		for s := range want {
			if !have[s] {
				smp.Missing++
			}
		}
	}
}

// RecoveryResult is what `kvrouter bench recovery` measured.
type RecoveryResult struct {
	Dump                bool    `json:"dump"`
	BatchesAtRestart    uint64  `json:"batches_at_restart"`     // published before the restart
	OldestAtRestart     uint64  `json:"oldest_buffered_batch"`  // first batch the ring still held
	ConvergedAfterSec   float64 `json:"converged_after_s"`      // first sample with router == engine; -1 if none
	EqualAfterConverged float64 `json:"equal_after_converged"`  // fraction of later samples still equal
	FinalCoverage       float64 `json:"final_coverage"`         // engine blocks the router knew at the last sample
	RequestsAfter       int64   `json:"requests_after_restart"` // completed through the restarted router
	Errors              int64   `json:"errors"`                 // failed requests (mostly during the restart)
	Reanchored          uint64  `json:"events_reanchored"`
	Refused             uint64  `json:"events_refused_unknown_parent"`
	BlocksInferred      uint64  `json:"blocks_inferred"`
	Dumps               uint64  `json:"dumps_loaded"`
	Samples             []RecoverySample
}

// RunRecovery runs the scenario. Progress goes to progress.
func RunRecovery(ctx context.Context, cfg RecoveryConfig, progress io.Writer) (RecoveryResult, error) {
	if cfg.Concurrency < 1 || cfg.Prefixes < 1 || cfg.MaxUser < cfg.MinUser || cfg.MaxOutput < cfg.MinOutput || cfg.MinOutput < 1 || cfg.Sample <= 0 {
		return RecoveryResult{}, errors.New("bench recovery: need concurrency, prefixes ≥ 1, min ≤ max, output ≥ 1 and a positive sample interval")
	}
	fcfg := fleet.DefaultConfig()
	fcfg.SpeedupRatio = cfg.Speedup
	fcfg.Engine.NumGPUBlocks = cfg.Blocks
	fcfg.ReplayBufferSize = cfg.BufferSteps
	fcfg.HTTPPort, fcfg.KVEventsPort, fcfg.KVEventsReplayPort = 0, 0, 0
	f, err := fleet.Start(ctx, fcfg)
	if err != nil {
		return RecoveryResult{}, err
	}
	defer f.Close()
	spec := serve.FleetWorkers(f, fcfg)[0]
	worker := kv.Worker{ID: spec.ID}
	startRouter := func(dump bool) (*serve.Server, error) {
		w := spec
		if !dump {
			w.Dump = ""
		}
		return serve.Start(ctx, serve.Config{Router: router.DefaultConfig(), Workers: []serve.WorkerSpec{w}, Addr: "127.0.0.1:0", HealthInterval: 100 * time.Millisecond})
	}

	first, err := startRouter(true)
	if err != nil {
		return RecoveryResult{}, err
	}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	err = first.WaitReady(rctx)
	cancel()
	if err != nil {
		first.Close()
		return RecoveryResult{}, err
	}

	var target atomic.Pointer[string]
	url := "http://" + first.Addr()
	target.Store(&url)
	var requests, failures atomic.Int64
	lctx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	var wg sync.WaitGroup
	rng := rand.New(rand.NewPCG(cfg.Seed, 9))
	prefixes := make([][]uint32, cfg.Prefixes)
	for i := range prefixes {
		prefixes[i] = randomTokens(rng, cfg.PrefixTokens)
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: cfg.Concurrency}}
	for c := range cfg.Concurrency {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(cfg.Seed, uint64(c)+100))
			for lctx.Err() == nil {
				ids := append(append([]uint32(nil), prefixes[r.IntN(len(prefixes))]...), randomTokens(r, cfg.MinUser+r.IntN(cfg.MaxUser-cfg.MinUser+1))...)
				_, err := send(lctx, client, *target.Load(), fcfg.Server.Model, prompt{ids: ids}, cfg.MinOutput+r.IntN(cfg.MaxOutput-cfg.MinOutput+1), false, false)
				switch {
				case lctx.Err() != nil:
				case err != nil:
					failures.Add(1)
					select { // the router is restarting
					case <-lctx.Done():
					case <-time.After(10 * time.Millisecond):
					}
				default:
					requests.Add(1)
				}
			}
		})
	}
	defer wg.Wait()

	// Traffic through the first router, and on until the ring has wrapped.
	begin := time.Now()
	for {
		select {
		case <-ctx.Done():
			first.Close()
			return RecoveryResult{}, ctx.Err()
		case <-time.After(time.Second):
		}
		oldest, next := f.Buffered(0, 0)
		fmt.Fprintf(progress, "recovery: %.0f s of traffic, %d requests, %d batches published, ring from %d\n", time.Since(begin).Seconds(), requests.Load(), next, oldest)
		if time.Since(begin) >= cfg.Traffic && oldest > 0 {
			break
		}
	}

	_ = first.Close()
	res := RecoveryResult{Dump: cfg.Dump, ConvergedAfterSec: -1}
	res.OldestAtRestart, res.BatchesAtRestart = f.Buffered(0, 0)
	before := requests.Load()
	restart := time.Now()
	second, err := startRouter(cfg.Dump)
	if err != nil {
		return RecoveryResult{}, err
	}
	defer second.Close()
	url2 := "http://" + second.Addr()
	target.Store(&url2)

	h := blockhash.New(fcfg.Engine.BlockSize, "")
	for time.Since(restart) < cfg.Observe {
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-time.After(cfg.Sample):
		}
		var smp RecoverySample
		var src *enginesource.Source
		if srcs := second.Sources(spec.ID); len(srcs) > 0 {
			src = srcs[0]
		}
		err := f.Inspect(ctx, 0, 0, func(next uint64, blocks []engine.CachedBlock) {
			smp.AfterSec = time.Since(restart).Seconds()
			want := EngineSeqs(h, slices.DeleteFunc(blocks, func(b engine.CachedBlock) bool { return b.Host }))
			if src == nil {
				smp.Behind = next > 0
			} else if next > 0 {
				// Short: the router may itself be waiting for this engine's
				// dump, which waits for this pause to end.
				wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
				smp.Behind = src.WaitSeq(wctx, next-1) != nil
				cancel()
			}
			// The bench runs the mocker without a host tier: every block
			// the router holds on a lower tier is one too many.
			smp.compare(map[kv.StorageTier]map[uint64]bool{kv.TierDevice: want}, func(tier kv.StorageTier) []uint64 {
				return second.Router().HeldBlocksOn(worker, tier)
			})
		})
		if err != nil {
			return res, err
		}
		res.Samples = append(res.Samples, smp)
		equal := !smp.Behind && smp.Missing == 0 && smp.Extra == 0
		if equal && res.ConvergedAfterSec < 0 {
			res.ConvergedAfterSec = smp.AfterSec
		}
		fmt.Fprintf(progress, "recovery: %.1f s after the restart: engine %d blocks (%d on lower tiers), router %d (%d), missing %d, extra %d%s\n",
			smp.AfterSec, smp.EngineBlocks, smp.EngineLowerBlocks, smp.RouterBlocks, smp.RouterLowerBlocks, smp.Missing, smp.Extra, map[bool]string{true: " (router behind)"}[smp.Behind])
	}
	stopLoad()
	res.RequestsAfter, res.Errors = requests.Load()-before, failures.Load()
	st := second.Router().Stats().Index
	res.Reanchored, res.Refused, res.BlocksInferred = st.Reanchored, st.UnknownParent, st.BlocksInferred
	if srcs := second.Sources(spec.ID); len(srcs) > 0 {
		res.Dumps = srcs[0].Stats().Dumps
	}
	if n := len(res.Samples); n > 0 {
		last := res.Samples[n-1]
		if last.EngineBlocks > 0 {
			res.FinalCoverage = float64(last.EngineBlocks-last.Missing) / float64(last.EngineBlocks)
		}
		later, equal := 0, 0
		for _, smp := range res.Samples {
			if res.ConvergedAfterSec >= 0 && smp.AfterSec > res.ConvergedAfterSec {
				later++
				if !smp.Behind && smp.Missing == 0 && smp.Extra == 0 {
					equal++
				}
			}
		}
		if later > 0 {
			res.EqualAfterConverged = float64(equal) / float64(later)
		}
	}
	return res, f.PublishErr()
}

// EngineSeqs is an engine's cache (parents first, as
// engine.Engine.CachedBlocks lists it) as sequence hashes: what a router's
// index must hold for that engine.
func EngineSeqs(h blockhash.Hasher, blocks []engine.CachedBlock) map[uint64]bool {
	seqOf := make(map[uint64]uint64, len(blocks))
	out := make(map[uint64]bool, len(blocks))
	for _, b := range blocks {
		seq := h.LocalHash(b.Tokens)
		if b.Parent != nil {
			seq = blockhash.Chain(seqOf[*b.Parent], seq)
		}
		seqOf[b.Hash] = seq
		out[seq] = true
	}
	return out
}
