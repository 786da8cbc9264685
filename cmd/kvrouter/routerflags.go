package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/internal/serve"
)

// routerFlags binds the router's configuration to Dynamo's flag names, so
// its users find the knobs where they expect them.
type routerFlags struct {
	cfg router.Config

	mode                          string
	credit, scale, weight, temp   float64
	affinity                      float64
	hostWeight, diskWeight        float64
	sharedMult, creditDecay       float64
	requestWeight                 float64
	sharedType, prefillModel      string
	decodeThreshold               float64
	prefillThreshold              int
	prefillFrac                   float64
	queueThreshold, queuePolicy   string
	ttlSecs, predictedTTLSecs     float64
	noKVEvents, noTrackActive     bool
	noAssumeReuse, noTrackPrefill bool
	overlapRefreshSecs            float64
	kvEventsGraceSecs             float64
	cpuRatio                      int
}

func newRouterFlags() *routerFlags {
	cfg := router.DefaultConfig()
	return &routerFlags{
		cfg: cfg, mode: string(sched.ModeKV), credit: 1, scale: sched.DefaultPrefillLoadScale, affinity: sched.DefaultCacheAffinity,
		hostWeight: sched.DefaultHostHitWeight, diskWeight: sched.DefaultDiskHitWeight, sharedMult: sched.DefaultSharedMultiplier, sharedType: "none", prefillModel: "none",
		queueThreshold: fmt.Sprint(sched.DefaultQueueThreshold), queuePolicy: string(sched.FCFS),
		ttlSecs: cfg.ApproxTTL.Seconds(), overlapRefreshSecs: cfg.OverlapRefreshAfter.Seconds(),
		kvEventsGraceSecs: cfg.KVEventsGrace.Seconds(), predictedTTLSecs: cfg.PredictedTTL.Seconds(),
		cpuRatio: sched.DefaultNonCPUToCPURatio,
	}
}

func (f *routerFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.mode, "router-mode", f.mode, "routing mode: "+modeNames())
	fs.IntVar(&f.cfg.BlockSize, "kv-cache-block-size", f.cfg.BlockSize, "tokens per KV block, as the engines use")
	fs.Float64Var(&f.temp, "router-temperature", 0, "softmax temperature over normalised costs; 0 picks the cheapest worker")
	fs.Float64Var(&f.credit, "router-kv-overlap-score-credit", f.credit, "prefill blocks credited per cached prefix block, in [0, 1]; 0 disables the index")
	fs.Float64Var(&f.scale, "router-prefill-load-scale", f.scale, "weight of prompt-side load against decode blocks (Dynamo's default: 1)")
	fs.Float64Var(&f.affinity, "router-cache-affinity", f.affinity, "extra blocks of cost credited per cached prefix block (the KV memory and later turns a reuse saves; on a much busier worker, per block saved net of its longer queue); 0 = Dynamo's cost")
	fs.Float64Var(&f.creditDecay, "router-kv-overlap-score-credit-decay", 0, "fade a worker's device credit as its prompt backlog exceeds the lightest worker's: × 1/(1 + this × excess/request blocks); 0 = off")
	fs.Float64Var(&f.hostWeight, "router-host-cache-hit-weight", f.hostWeight, "prefill blocks credited per prefix block held only on a worker's host (CPU) tier, in [0, 1]")
	fs.Float64Var(&f.diskWeight, "router-disk-cache-hit-weight", f.diskWeight, "prefill blocks credited per prefix block held only on a worker's disk tier, in [0, 1]")
	fs.StringVar(&f.sharedType, "shared-cache-type", f.sharedType, "shared KV cache credited beyond each worker's device prefix: none, or hicache (blocks engines publish on an external medium)")
	fs.Float64Var(&f.sharedMult, "shared-cache-multiplier", f.sharedMult, "prefill blocks credited per shared-cache block beyond the device prefix, in [0, 1] (with --shared-cache-type)")
	fs.StringVar(&f.prefillModel, "router-prefill-load-model", f.prefillModel, "prompt-side load: none counts a prompt's tokens until its first token; learned fits each engine's prefill time from the requests it serves and prices load in time (aic is not available: use learned)")
	fs.Float64Var(&f.requestWeight, "router-decode-active-request-weight", 0, "blocks of cost per request a worker already runs; 0 = off")
	fs.Float64Var(&f.weight, "router-kv-overlap-score-weight", -1, "deprecated: legacy overlap weight (sets the prefill load scale; 0 also disables the index)")
	fs.BoolVar(&f.cfg.LoadAware, "load-aware", false, "kv mode on load alone: no overlap credit, no KV events, no reuse assumption")
	fs.BoolVar(&f.noKVEvents, "no-router-kv-events", false, "ignore KV events and predict caches from routing decisions (approximate mode)")
	fs.Float64Var(&f.ttlSecs, "router-ttl-secs", f.ttlSecs, "approximate mode: seconds a routed prefix is assumed cached")
	fs.IntVar(&f.cfg.MaxTreeSize, "router-max-tree-size", f.cfg.MaxTreeSize, "approximate mode: most (block, worker) pairs before pruning")
	fs.Float64Var(&f.cfg.PruneTargetRatio, "router-prune-target-ratio", f.cfg.PruneTargetRatio, "approximate mode: prune down to this fraction of the maximum")
	fs.Float64Var(&f.predictedTTLSecs, "router-predicted-ttl-secs", f.predictedTTLSecs, "predict-on-route: also index each decision for this many seconds (needs KV events); 0 = off")
	fs.Float64Var(&f.kvEventsGraceSecs, "router-kv-events-grace-secs", f.kvEventsGraceSecs, "an engine that serves requests but sends no KV event for this many seconds is reported and routed by predicted caches until its events come; 0 = off")
	fs.IntVar(&f.cfg.EventThreads, "router-event-threads", f.cfg.EventThreads, "index write parallelism")
	fs.Uint64Var(&f.cfg.MaxIndexedPairs, "router-max-indexed-pairs", 0, "memory cap of the event-fed index in (block, worker) pairs, least recently matched evicted first; 0 = a budget of a quarter of the machine's (or cgroup's) memory at 128 B a pair, evicting any leaves")
	fs.BoolVar(&f.noTrackActive, "no-router-track-active-blocks", false, "do not count active decode blocks")
	fs.BoolVar(&f.cfg.TrackOutputBlocks, "router-track-output-blocks", false, "count output blocks as they fill (decayed by nvext agent_hints.osl)")
	fs.BoolVar(&f.noAssumeReuse, "no-router-assume-kv-reuse", false, "count every prompt block as new on its worker (disaggregated decode)")
	fs.BoolVar(&f.noTrackPrefill, "no-router-track-prefill-tokens", false, "do not count prompt tokens awaiting prefill")
	fs.Float64Var(&f.decodeThreshold, "active-decode-blocks-threshold", 0, "busy above this fraction of a worker's KV blocks in use; 0 = off")
	fs.IntVar(&f.prefillThreshold, "active-prefill-tokens-threshold", 0, "busy above this many prompt tokens awaiting prefill; 0 = off")
	fs.Float64Var(&f.prefillFrac, "active-prefill-tokens-threshold-frac", 0, "busy above this many times the worker's max batched tokens awaiting prefill (with either prefill threshold); 0 = off")
	fs.StringVar(&f.queueThreshold, "router-queue-threshold", f.queueThreshold, "hold requests while every worker's prefill backlog exceeds this × its max batched tokens; \"none\" disables")
	fs.StringVar(&f.queuePolicy, "router-queue-policy", f.queuePolicy, "queue order: fcfs, lcfs or wspt")
	fs.Float64Var(&f.overlapRefreshSecs, "router-overlap-refresh-after-secs", f.overlapRefreshSecs, "re-match queued requests that waited this long; 0 = never")
	// Dynamo reads the ratio from DYN_ENCODER_CUDA_TO_CPU_RATIO only; the
	// flag is named so that its DYN_<FLAG> is that variable.
	fs.IntVar(&f.cpuRatio, "encoder-cuda-to-cpu-ratio", f.cpuRatio, "device-aware-weighted mode: requests one accelerator engine serves for each one a CPU engine serves (engines say device=cpu)")
}

func modeNames() string {
	var names []string
	for _, m := range sched.Modes() {
		names = append(names, string(m))
	}
	return strings.Join(names, ", ")
}

// envAliases maps environment variables other tools read for the same
// setting; Dynamo's own other names are in dynamoflags.go.
var envAliases = map[string]string{
	"VLLM_API_KEY": "api-key",
}

// applyEnv fills every flag the command line left unset from DYN_<FLAG>
// (upper case, dashes as underscores: --router-temperature is
// DYN_ROUTER_TEMPERATURE), as Dynamo does, then from the other names
// Dynamo, vLLM and NATS read.
func applyEnv(fs *pflag.FlagSet) error {
	return applyEnvFrom(fs, os.LookupEnv, os.Stderr)
}

func applyEnvFrom(fs *pflag.FlagSet, lookup func(string) (string, bool), warnings io.Writer) error {
	var err error
	set := func(name, env string) {
		fl := fs.Lookup(name)
		if fl == nil || fl.Changed || err != nil {
			return
		}
		v, ok := lookup(env)
		if !ok {
			return
		}
		if fl.Value.Type() == "bool" {
			b, e := parseDynamoBool(v)
			if e != nil {
				err = fmt.Errorf("%s: %w", env, e)
				return
			}
			v = strconv.FormatBool(b)
		}
		if e := fs.Set(name, v); e != nil {
			err = fmt.Errorf("%s=%q: %w", env, v, e)
		}
	}
	fs.VisitAll(func(fl *pflag.Flag) {
		if fl.Deprecated == "" {
			set(fl.Name, envName(fl.Name))
		}
	})
	if err != nil {
		return err
	}
	if err := applyDynamoEnv(fs, lookup, warnings); err != nil {
		return err
	}
	for env, name := range envAliases {
		set(name, env)
	}
	for _, f := range natsEnv {
		for _, env := range f.envs {
			set(f.flag, env)
		}
	}
	return err
}

// config resolves the flags into a router configuration; warnings (such
// as a deprecated flag) go to warn.
func (f *routerFlags) config(fs *pflag.FlagSet, warn func(string)) (router.Config, error) {
	cfg := f.cfg
	mode, err := sched.ParseMode(f.mode)
	if err != nil {
		return cfg, err
	}
	cfg.Mode = mode
	shared, err := parseSharedCacheType(f.sharedType)
	if err != nil {
		return cfg, err
	}
	cfg.Routing = sched.Overrides{
		OverlapCredit: &f.credit, PrefillLoadScale: &f.scale, CacheAffinity: &f.affinity, Temperature: &f.temp,
		HostHitWeight: &f.hostWeight, DiskHitWeight: &f.diskWeight, SharedCache: &shared, SharedMultiplier: &f.sharedMult,
		CreditDecay: &f.creditDecay, DecodeRequestWeight: &f.requestWeight,
	}
	if f.weight >= 0 {
		w := f.weight
		cfg.Routing.LegacyOverlapWeight = &w
	}
	if f.noAssumeReuse {
		cfg.Routing.AssumeKVReuse = new(bool)
	}
	if f.noTrackPrefill {
		cfg.Routing.TrackPrefillTokens = new(bool)
	}
	if _, err := router.ParsePrefillLoadModel(f.prefillModel); err != nil {
		return cfg, err
	}
	cfg.PrefillLoadModel = f.prefillModel
	cfg.KVEvents = !f.noKVEvents
	if cfg.MaxIndexedPairs == 0 {
		cfg.IndexBudgetPairs = serve.IndexBudgetPairs(serve.MemoryLimit())
	}
	cfg.TrackActiveBlocks = !f.noTrackActive
	cfg.ApproxTTL = seconds(f.ttlSecs)
	cfg.PredictedTTL = seconds(f.predictedTTLSecs)
	if f.noKVEvents && fs.Changed("router-predicted-ttl-secs") && cfg.PredictedTTL > 0 {
		return cfg, errors.New("--router-predicted-ttl-secs needs KV events: with --no-router-kv-events every decision is already a prediction (--router-ttl-secs)")
	}
	cfg.OverlapRefreshAfter = seconds(f.overlapRefreshSecs)
	cfg.KVEventsGrace = seconds(f.kvEventsGraceSecs)
	if f.decodeThreshold > 0 {
		v := f.decodeThreshold
		cfg.Busy.ActiveDecodeBlocks = &v
	}
	if f.prefillThreshold > 0 {
		v := f.prefillThreshold
		cfg.Busy.ActivePrefillTokens = &v
	}
	if f.prefillFrac > 0 {
		v := f.prefillFrac
		cfg.Busy.ActivePrefillTokensFrac = &v
	}
	if err := cfg.Busy.Validate(); err != nil {
		return cfg, fmt.Errorf("--active-prefill-tokens-threshold-frac: %w", err)
	}
	if cfg.QueueThreshold, err = sched.ParseQueueThreshold(f.queueThreshold); err != nil {
		return cfg, err
	}
	if cfg.QueuePolicy, err = sched.ParseQueuePolicy(f.queuePolicy); err != nil {
		return cfg, err
	}
	if f.cpuRatio < 1 {
		return cfg, fmt.Errorf("--encoder-cuda-to-cpu-ratio (DYN_ENCODER_CUDA_TO_CPU_RATIO) %d: want a whole number ≥ 1, the throughput of one accelerator engine in CPU engines", f.cpuRatio)
	}
	cfg.NonCPUToCPURatio = f.cpuRatio
	if fs.Changed("router-kv-overlap-score-weight") || f.weight >= 0 {
		warn(sched.LegacyWeightWarning)
	}
	return cfg, nil
}

// parseSharedCacheType reads --shared-cache-type: Dynamo's none and
// hicache. kvrouter learns a shared cache's blocks from the engines'
// events (an external medium), not by asking the pool itself.
func parseSharedCacheType(s string) (bool, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "none", "":
		return false, nil
	case "hicache":
		return true, nil
	}
	return false, fmt.Errorf("--shared-cache-type %q: want none or hicache", s)
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
