package sched

import (
	"errors"
	"fmt"
	"math"
)

// Params are the effective knobs of one routing decision, after the
// configuration and the request's own overrides have been merged by Resolve.
type Params struct {
	// OverlapCredit is how many prefill blocks one cached prefix block
	// saves. 0 makes the router blind to caches, so no index is needed.
	OverlapCredit float64
	// PrefillLoadScale weighs prompt work against decode blocks.
	PrefillLoadScale float64
	// CacheAffinity credits each cached prefix block (on a much busier
	// worker only its lead net of the extra load, see Cost) with
	// this many more blocks of cost, without the clamp at 0: a reused
	// prefix also spares the KV memory a second copy would take and the
	// prefill of the conversation's later turns, which stay where their
	// prefix is. It only applies while OverlapCredit > 0. Dynamo has no
	// such term (0).
	CacheAffinity float64
	// HostHitWeight and DiskHitWeight are the prefill blocks one prefix
	// block held only on the host tier, or only on disk, saves: loading it
	// back costs less than computing it, more than finding it on the GPU.
	HostHitWeight, DiskHitWeight float64
	// SharedCache credits the prefix an external cache shared by the
	// fleet holds beyond a worker's device prefix, SharedMultiplier blocks
	// per block.
	SharedCache      bool
	SharedMultiplier float64
	// CreditDecay (λ) fades the device credit of a worker whose prompt
	// backlog exceeds the lightest candidate's: × 1/(1 + λ × excess/isl),
	// both in blocks. It applies only while prompt tokens are tracked.
	CreditDecay float64
	// DecodeRequestWeight charges each request a worker already runs, for
	// engines whose step time follows the batch's size more than its
	// blocks.
	DecodeRequestWeight float64
	// Temperature 0 picks the cheapest worker; above 0 it samples.
	Temperature float64
	// AssumeKVReuse and TrackPrefillTokens do not enter the cost here: the
	// load tracker applies them when it computes the candidates' loads.
	// They are resolved here so that one call yields every per-request knob.
	AssumeKVReuse      bool
	TrackPrefillTokens bool
}

// DefaultCacheAffinity is kvrouter's default --router-cache-affinity: it
// keeps conversations on the worker caching them, for a prefix-cache hit
// rate near the ceiling, while the load terms still move requests off a
// worker whose backlog outweighs what its cache saves. Chosen by goodput
// (`kvrouter sim`, docs/benchmarks.md): 7, 12, 20, 30 and 50 carried 34.9,
// 35.3, 35.3, 35.7 and 35.7 req/s of the Mooncake conversation trace
// within p90 TTFT ≤ 2 s, 644, 699, 699, 699 and 699 of synthetic sessions,
// and about 180, 187, 191, 192 and 188 of agent sessions; 20 is the
// smallest value at the plateau of all three.
const DefaultCacheAffinity = 20

// DefaultPrefillLoadScale is kvrouter's default --router-prefill-load-scale
// (Dynamo's is 1). Time to first token waits on the prompts queued ahead
// and on the request's own prefill; a worker's decode blocks slow its steps
// only mildly until its KV cache fills. Weighing the prompt side 3× (2 to 4
// measured alike) lowered mean and p90 TTFT by about 15 % on the Mooncake
// replay (docs/benchmarks.md). It also scales the cache credits.
const DefaultPrefillLoadScale = 3

// DefaultParams are the values a router started without flags uses.
func DefaultParams() Params {
	return Params{
		OverlapCredit: 1, PrefillLoadScale: DefaultPrefillLoadScale, CacheAffinity: DefaultCacheAffinity,
		HostHitWeight: DefaultHostHitWeight, DiskHitWeight: DefaultDiskHitWeight, SharedMultiplier: DefaultSharedMultiplier,
		AssumeKVReuse: true, TrackPrefillTokens: true,
	}
}

// Dynamo's defaults of the lower-tier and shared-cache credits
// (--router-host-cache-hit-weight, --router-disk-cache-hit-weight,
// --shared-cache-multiplier).
const (
	DefaultHostHitWeight    = 0.75
	DefaultDiskHitWeight    = 0.25
	DefaultSharedMultiplier = 0.5
)

// UsesOverlap reports whether cached prefixes can change a decision, i.e.
// whether the router needs a block index at all.
func (p Params) UsesOverlap() bool { return p.OverlapCredit > 0 }

// Cost is the KV-mode cost of sending a request of isl prompt tokens to c,
// given the fleet's lightest loads (Lightest over the same candidates):
//
//	ttft  = max((active_prefill_tokens + isl)/block_size − credit × overlap, 0)
//	saved = credit × overlap, or, on a worker running more than
//	        ImbalanceRatio × the fewest requests + ImbalanceSlack,
//	        credit × overlap − (active_prefill_tokens − fewest_prefill_tokens)/block_size
//	                         − (active_decode_blocks − fewest_decode_blocks)/scale
//	cost  = scale × (ttft − affinity × max(saved, 0)) + potential_decode_blocks
//
// ttft is the prompt work the request waits for there, in blocks. The clamp
// at 0 keeps a large cache hit from making a loaded worker look cheaper
// than an idle one by more than the prompt itself is worth. Prefill blocks
// are not rounded so that a partial block still separates otherwise equal
// workers.
//
// The affinity (only while credit > 0) multiplies saved. On a worker much
// busier than another, saved is the worker's lead, in the cost's own
// units, over sending the prompt uncached to the lightest: the cached
// prefix less the extra queue the request would wait behind there and
// less the extra decode blocks it would run beside, each decode block
// weighing 1/scale of a prefill block as in the cost itself. Once the
// extra queue or decode load has eaten the saving, the worker is judged by
// time to first token and decode load alone, so a few hot conversations
// cannot keep an idle or restarted engine empty, whether their load is
// prompts queued for prefill or sequences decoding beside each other.
// Between workers of similar load the whole prefix counts: their load
// differences come and go by themselves, and moving a conversation for
// them costs its later turns their cache.
//
// With tiers, a decay or a request weight set, credit × overlap is Dynamo's
// whole credit (see credit) and the cost adds request_weight ×
// active_requests; the affinity counts the worker's own credit, not the
// shared cache's, which every worker can read.
//
// With a learned prefill time (Candidate.Prefill) the load terms are in
// time, counted in blocks of the fastest candidate (see timed).
func (p Params) Cost(c *Candidate, isl, blockSize int, fleet Lightest) float64 {
	return p.Terms(c, isl, blockSize, fleet).Total
}

// A worker running more than ImbalanceRatio × the fewest requests of any
// candidate, plus ImbalanceSlack, is much busier than the fleet's lightest
// worker: there Cost bounds the cache affinity by the cache's lead net of
// the extra queue and decode load. Bounding it between workers of similar
// load too cost the Mooncake replay 10 points of hit rate and 17 % of mean
// TTFT; 3 and 2 keep the replay's figures and still spread twelve
// clients' hot conversations over an idle engine (measurements in
// docs/routing-core.md).
const (
	ImbalanceRatio = 3
	ImbalanceSlack = 2
)

// Lightest is the lightest load among the candidates of one decision, the
// reference Cost compares a worker with.
type Lightest struct {
	PrefillTokens int     // fewest prompt tokens awaiting prefill
	DecodeBlocks  float64 // fewest active decode blocks
	Requests      int     // fewest active requests
	// SecondsPerToken is the fastest learned prefill, 0 without one.
	SecondsPerToken float64
	// MostKVBlocks is the largest candidate's KV blocks, with a learned
	// prefill only (0 otherwise, or when no worker has said).
	MostKVBlocks int
	// OSL is the request's expected output length (agent_hints.osl) and
	// MeanOSL the mean of the hints the scheduler has booked; both 0 when
	// unknown.
	OSL     int
	MeanOSL float64
}

// holdRatio is how much longer than the average request this one is
// expected to hold its blocks: its OSL hint over the mean hint, 1 without
// one. Decode steps run at one pace on an engine, so the steps a request
// holds its blocks through follow its output length.
func (l Lightest) holdRatio() float64 {
	if l.OSL <= 0 || l.MeanOSL <= 0 {
		return 1
	}
	return float64(l.OSL) / l.MeanOSL
}

// LightestOf summarises cands for Cost.
func LightestOf(cands []Candidate) Lightest {
	if len(cands) == 0 {
		return Lightest{}
	}
	l := Lightest{PrefillTokens: cands[0].ActivePrefillTokens, DecodeBlocks: cands[0].ActiveDecodeBlocks, Requests: cands[0].ActiveRequests}
	for i := range cands[1:] {
		c := &cands[i+1]
		l.PrefillTokens = min(l.PrefillTokens, c.ActivePrefillTokens)
		l.DecodeBlocks = min(l.DecodeBlocks, c.ActiveDecodeBlocks)
		l.Requests = min(l.Requests, c.ActiveRequests)
	}
	if cands[0].Prefill.Known {
		l.SecondsPerToken = math.Inf(1)
		for i := range cands {
			if s := cands[i].Prefill.SecondsPerToken; s > 0 {
				l.SecondsPerToken = min(l.SecondsPerToken, s)
			}
			l.MostKVBlocks = max(l.MostKVBlocks, cands[i].TotalKVBlocks)
		}
		if math.IsInf(l.SecondsPerToken, 1) {
			l.SecondsPerToken = 0
		}
	}
	return l
}

func (l Lightest) muchBusier(c *Candidate) bool {
	return c.ActiveRequests > ImbalanceRatio*l.Requests+ImbalanceSlack
}

// Overrides is one layer of optional knobs: the router's flags form one
// layer, a request's nvext fields another. Nil leaves the lower layer's
// value in place.
type Overrides struct {
	OverlapCredit    *float64 // --router-kv-overlap-score-credit, in [0, 1]
	PrefillLoadScale *float64 // --router-prefill-load-scale, ≥ 0
	CacheAffinity    *float64 // --router-cache-affinity, ≥ 0
	// LegacyOverlapWeight is the deprecated --kv-overlap-score-weight /
	// --router-kv-overlap-score-weight. It beats PrefillLoadScale of the same
	// layer, and 0 also forces OverlapCredit of the same layer to 0, so old
	// deployments keep their behaviour unchanged.
	LegacyOverlapWeight *float64
	Temperature         *float64 // --router-temperature, ≥ 0
	HostHitWeight       *float64 // --router-host-cache-hit-weight, in [0, 1]
	DiskHitWeight       *float64 // --router-disk-cache-hit-weight, in [0, 1]
	SharedCache         *bool    // --shared-cache-type other than none
	SharedMultiplier    *float64 // --shared-cache-multiplier, in [0, 1]
	CreditDecay         *float64 // --router-kv-overlap-score-credit-decay, ≥ 0
	DecodeRequestWeight *float64 // --router-decode-active-request-weight, ≥ 0
	AssumeKVReuse       *bool
	TrackPrefillTokens  *bool
}

// ErrInvalidParams wraps every validation failure of Resolve, so that an
// HTTP layer can answer 400 for a bad per-request override.
var ErrInvalidParams = errors.New("sched: invalid routing parameter")

// LegacyWeightWarning is the deprecation notice Resolve returns when a
// legacy overlap weight was applied.
const LegacyWeightWarning = "the overlap score weight (--router-kv-overlap-score-weight, --kv-overlap-score-weight) is deprecated: " +
	"move its value to --router-prefill-load-scale, and use --router-kv-overlap-score-credit only to tune the cache credit itself"

// Resolve merges defaults, then config, then request. Within a layer the
// legacy weight wins over the newer fields; across layers the request wins,
// because a client that names a knob means it for this request. warning is
// LegacyWeightWarning when either layer used the legacy weight, "" otherwise.
func Resolve(config, request Overrides) (p Params, warning string, err error) {
	p = DefaultParams()
	for _, layer := range []struct {
		name string
		o    *Overrides
	}{{"config", &config}, {"request", &request}} {
		legacy, err := layer.o.apply(&p)
		if err != nil {
			return Params{}, "", fmt.Errorf("%w: %s %v", ErrInvalidParams, layer.name, err)
		}
		if legacy {
			warning = LegacyWeightWarning
		}
	}
	return p, warning, nil
}

func (o *Overrides) apply(p *Params) (usedLegacy bool, err error) {
	for _, k := range []struct {
		name string
		v    *float64
		dst  *float64
		unit bool // in [0, 1], else any finite value ≥ 0
	}{
		{"overlap score credit", o.OverlapCredit, &p.OverlapCredit, true},
		{"prefill load scale", o.PrefillLoadScale, &p.PrefillLoadScale, false},
		{"cache affinity", o.CacheAffinity, &p.CacheAffinity, false},
		{"temperature", o.Temperature, &p.Temperature, false},
		{"host cache hit weight", o.HostHitWeight, &p.HostHitWeight, true},
		{"disk cache hit weight", o.DiskHitWeight, &p.DiskHitWeight, true},
		{"shared cache multiplier", o.SharedMultiplier, &p.SharedMultiplier, true},
		{"overlap score credit decay", o.CreditDecay, &p.CreditDecay, false},
		{"decode active request weight", o.DecodeRequestWeight, &p.DecodeRequestWeight, false},
	} {
		if k.v == nil {
			continue
		}
		if v := *k.v; k.unit && !(v >= 0 && v <= 1) {
			return false, fmt.Errorf("%s %v: want a value in [0, 1]", k.name, v)
		}
		if err := nonNegative(k.name, *k.v); err != nil {
			return false, err
		}
		*k.dst = *k.v
	}
	// The legacy weight beats the newer fields of its layer.
	if o.LegacyOverlapWeight != nil {
		w := *o.LegacyOverlapWeight
		if err := nonNegative("overlap score weight", w); err != nil {
			return false, err
		}
		p.PrefillLoadScale = w
		if w == 0 {
			p.OverlapCredit = 0
		}
		usedLegacy = true
	}
	if o.SharedCache != nil {
		p.SharedCache = *o.SharedCache
	}
	if o.AssumeKVReuse != nil {
		p.AssumeKVReuse = *o.AssumeKVReuse
	}
	if o.TrackPrefillTokens != nil {
		p.TrackPrefillTokens = *o.TrackPrefillTokens
	}
	return usedLegacy, nil
}

func nonNegative(name string, v float64) error {
	if !(v >= 0) || math.IsInf(v, 1) {
		return fmt.Errorf("%s %v: want a finite value ≥ 0", name, v)
	}
	return nil
}

// LoadAware applies the --load-aware preset to the config layer: KV mode
// (ModeKV) with the cache credit forced to 0 and no reuse assumption, while
// the prefill load scale and the lower tiers' weights are kept for tuning,
// and the shared cache is off, as Dynamo's preset has it. The caller must also run
// without KV events and without building an index; this package cannot do
// that for it.
func LoadAware(config Overrides) Overrides {
	zero, no, yes := 0.0, false, true
	config.OverlapCredit = &zero
	config.CacheAffinity = &zero
	config.AssumeKVReuse = &no
	config.TrackPrefillTokens = &yes
	config.SharedCache = &no
	return config
}

// DynamoDefaults is the config layer that reproduces Dynamo's KV router:
// no cache affinity, prefill load scale 1.
func DynamoDefaults() Overrides {
	zero, one := 0.0, 1.0
	return Overrides{CacheAffinity: &zero, PrefillLoadScale: &one}
}

// CostTerms is Cost split into the parts a person reads to see why a
// worker won: Total = Prefill − CacheCredit + Decode, all in blocks.
type CostTerms struct {
	// Prefill is the scaled prompt work the request would wait for there,
	// its cached prefix already taken off.
	Prefill float64
	// CacheCredit is the scaled cache affinity: what keeping the prefix
	// where it is earns beyond the prefill it saves.
	CacheCredit float64
	// Decode is the worker's decode blocks with this request added, and
	// the request weight's charge for the requests it runs.
	Decode float64
	Total  float64
}

// Terms is Cost with its terms apart: Cost is Terms(...).Total.
func (p Params) Terms(c *Candidate, isl, blockSize int, fleet Lightest) CostTerms {
	own, shared := p.credit(c, isl, blockSize, fleet)
	if c.Prefill.Known && fleet.SecondsPerToken > 0 {
		return p.timed(c, isl, blockSize, fleet, own, shared)
	}
	prefill, affinity := p.prefill(c, isl, blockSize, own+shared), p.affinity(c, blockSize, fleet, own)
	t := CostTerms{Prefill: p.PrefillLoadScale * prefill, CacheCredit: p.PrefillLoadScale * affinity, Decode: p.decode(c)}
	t.Total = p.total(prefill, affinity, c)
	return t
}

// timed is the cost in time: the prompt work is the learned prefill the
// request would wait for there, the backlog ahead of it and its own
// prefill (the fixed part and its uncached blocks after the credit), and
// the decode blocks weigh as much more as the worker's token is dearer.
// Everything is counted in blocks of the fastest candidate (fleet's
// SecondsPerToken), so on a fleet of one speed the prompt terms keep the
// scale of the blocks they replace, and a worker twice as slow counts
// twice. A decode block also counts as much more as the worker's KV cache
// is smaller than the largest candidate's: it fills that much more of it,
// and an engine's decode step time and its preemptions follow the share
// of its cache in use, not the block count; there the request's own blocks
// count by its expected output length too (see holdRatio).
func (p *Params) timed(c *Candidate, isl, blockSize int, fleet Lightest, own, shared float64) CostTerms {
	rel := c.Prefill.SecondsPerToken / fleet.SecondsPerToken
	perBlock := fleet.SecondsPerToken * float64(blockSize)
	prefill := max(float64(isl)/float64(blockSize)-own-shared, 0)*rel + (c.Prefill.Backlog+c.Prefill.Fixed)/perBlock
	affinity := p.affinity(c, blockSize, fleet, own)
	decode := rel * p.decode(c)
	if c.TotalKVBlocks > 0 && fleet.MostKVBlocks > c.TotalKVBlocks {
		// On a smaller cache the request's own new blocks also weigh by
		// how long it will hold them (holdRatio): its share of the cache
		// times its decode steps is what it takes of the engine's room
		// (Little's law), so long answers go to the large caches and
		// short ones fill the small caches' gaps.
		own := c.PotentialDecodeBlocks - c.ActiveDecodeBlocks
		decode = rel * float64(fleet.MostKVBlocks) / float64(c.TotalKVBlocks) *
			(c.ActiveDecodeBlocks + own*fleet.holdRatio() + p.DecodeRequestWeight*float64(c.ActiveRequests))
	}
	t := CostTerms{Prefill: p.PrefillLoadScale * prefill, CacheCredit: p.PrefillLoadScale * affinity, Decode: decode}
	t.Total = p.PrefillLoadScale*(prefill-affinity) + t.Decode
	return t
}

func (p *Params) total(prefill, affinity float64, c *Candidate) float64 {
	return p.PrefillLoadScale*(prefill-affinity) + p.decode(c)
}

func (p *Params) decode(c *Candidate) float64 {
	return c.PotentialDecodeBlocks + p.DecodeRequestWeight*float64(c.ActiveRequests)
}

// credit is Dynamo's prefill credit of c, in blocks, apart: own is what
// the worker's tiers hold,
//
//	credit × decay × device + host_weight × host_only + disk_weight × disk_only
//
// and shared is shared_multiplier × the shared cache's blocks beyond the
// device prefix. host_only and disk_only are the prefix blocks beyond the
// faster tiers' (the candidate's tier overlaps are cumulative).
func (p *Params) credit(c *Candidate, isl, blockSize int, fleet Lightest) (own, shared float64) {
	if p.deviceOnly(c) {
		return p.OverlapCredit * float64(c.OverlapBlocks), 0
	}
	return p.wholeCredit(c, isl, blockSize, fleet)
}

// deviceOnly reports whether c's credit is its device term alone, the
// case of every decision without tiers, a decay or a shared cache; kvPolicy
// tests it inline before paying for wholeCredit's call.
func (p *Params) deviceOnly(c *Candidate) bool {
	return p.CreditDecay <= 0 && !p.SharedCache && max(c.HostBlocks, c.DiskBlocks) <= c.OverlapBlocks
}

func (p *Params) wholeCredit(c *Candidate, isl, blockSize int, fleet Lightest) (own, shared float64) {
	own = p.OverlapCredit * float64(c.OverlapBlocks)
	if p.CreditDecay > 0 && p.TrackPrefillTokens {
		own *= p.decay(c, isl, blockSize, fleet)
	}
	if c.HostBlocks > c.OverlapBlocks || c.DiskBlocks > c.OverlapBlocks {
		host := max(c.HostBlocks, c.OverlapBlocks)
		own += p.HostHitWeight*float64(host-c.OverlapBlocks) + p.DiskHitWeight*float64(max(c.DiskBlocks-host, 0))
	}
	if p.SharedCache {
		shared = p.SharedMultiplier * float64(c.SharedBlocks)
	}
	return own, shared
}

// decay is 1/(1 + λ × normalized excess prefill), the excess being c's
// prompt backlog over the lightest candidate's, in blocks, per block of
// the request (at least one), as Dynamo normalises it.
func (p *Params) decay(c *Candidate, isl, blockSize int, fleet Lightest) float64 {
	excess := float64(max(c.ActivePrefillTokens-fleet.PrefillTokens, 0)) / float64(blockSize)
	requestBlocks := float64(max((isl+blockSize-1)/blockSize, 1))
	return 1 / (1 + p.CreditDecay*excess/requestBlocks)
}

// prefill is the unscaled prompt work c would wait for after credit, and
// affinity the unscaled cache affinity its own credit earns. Each is small
// enough to inline: they run for every worker of every decision.
func (p *Params) prefill(c *Candidate, isl, blockSize int, credit float64) float64 {
	return max(float64(c.ActivePrefillTokens+isl)/float64(blockSize)-credit, 0)
}

func (p *Params) affinity(c *Candidate, blockSize int, fleet Lightest, saved float64) float64 {
	// A scale of 0 weighs no prompt work, the affinity included.
	if p.OverlapCredit <= 0 || p.PrefillLoadScale <= 0 {
		return 0
	}
	if fleet.muchBusier(c) {
		saved -= float64(c.ActivePrefillTokens-fleet.PrefillTokens)/float64(blockSize) + (c.ActiveDecodeBlocks-fleet.DecodeBlocks)/p.PrefillLoadScale
	}
	return p.CacheAffinity * max(saved, 0)
}
