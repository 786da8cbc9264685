package sim

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/lab/replay"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// Disaggregated prefill and decode, as kvrouter serve runs it in front of
// prefill and decode engines (the frontend's Disagg), in virtual time:
//
//  1. with MinUncachedTokens > 0, a request the decode engine it would go
//     to lacks fewer than that many prompt tokens of is served aggregated
//     there (local prefill, "short_uncached");
//  2. otherwise its prefill is booked among the prefill engines ("<id>-
//     prefill", Request.Prefill) and sent with max_tokens 1, its full
//     prompt blocks held; no prefill engine free (sched.ErrAllBusy), none
//     at all (router.ErrNoWorkers), an engine refusing it or no token
//     within PrefillTimeout of the arrival → local prefill;
//  3. at the prefill's token its booking is freed and the decode is booked
//     among the decode engines without prefill load (and, with
//     NoAssumeKVReuse, without cache credit: Dynamo's decode routing);
//  4. the decode engine keeps the leading prompt blocks it caches and pulls
//     the rest, which takes their bytes over the link's bandwidth; then the
//     prefill engine's hold ends and the decode engine admits the request
//     with its whole prompt loaded. Its first token is the client's.
//
// The prefill engine's KV events reach the router like any engine's.

// Defaults of the KV transfer model: the mocker's.
const (
	// DefaultKVBytesPerToken is Llama-3.1-8B's KV in bf16: 32 layers × 8
	// KV heads × 128 dims × 2 (K and V) × 2 bytes.
	DefaultKVBytesPerToken = 131072
	// DefaultKVTransferBandwidth is one 200 Gb/s RDMA NIC, in bytes/s.
	DefaultKVTransferBandwidth = 25e9
)

// Disagg is a disaggregated fleet: PrefillWorkers prefill engines and
// DecodeWorkers decode engines in place of Config.Workers aggregated ones;
// the comments name the flags of `kvrouter sim`.
type Disagg struct {
	PrefillWorkers int // --prefill-workers
	DecodeWorkers  int // --decode-workers
	// MinUncachedTokens is conditional disaggregation
	// (--disagg-min-uncached-tokens): 0 always prefills remotely.
	MinUncachedTokens int
	// NoAssumeKVReuse routes decode as Dynamo does: no cache credit, every
	// prompt block new on the decode engine (--no-router-assume-kv-reuse).
	NoAssumeKVReuse bool
	// KVBytesPerToken and KVTransferBandwidth (bytes/s) time a pull, in
	// model time (--kv-bytes-per-token, --kv-transfer-bandwidth).
	KVBytesPerToken     int
	KVTransferBandwidth float64
	// PrefillTimeout gives up a prefill that has not answered this long
	// after the request's arrival, routing included, and the decode
	// engine prefills (--disagg-prefill-timeout; serve's default
	// DefaultPrefillTimeout when 0). Serve also takes a prefill out of the
	// router's admission queue then; the sim cannot (router.Submit has no
	// cancel), so a prefill dispatched past its deadline is given up at
	// once instead.
	PrefillTimeout time.Duration
}

// DefaultPrefillTimeout is serve's --disagg-prefill-timeout default.
const DefaultPrefillTimeout = 60 * time.Second

func (d Disagg) prefillTimeout() int64 {
	if d.PrefillTimeout > 0 {
		return int64(d.PrefillTimeout)
	}
	return int64(DefaultPrefillTimeout)
}

// Enabled reports a disaggregated fleet.
func (d Disagg) Enabled() bool { return d.PrefillWorkers > 0 || d.DecodeWorkers > 0 }

func (d Disagg) validate() error {
	switch {
	case d.PrefillWorkers < 1 || d.DecodeWorkers < 1:
		return fmt.Errorf("sim: a disaggregated fleet needs prefill and decode engines, got %d and %d", d.PrefillWorkers, d.DecodeWorkers)
	case d.MinUncachedTokens < 0:
		return fmt.Errorf("sim: negative minimum of uncached tokens %d", d.MinUncachedTokens)
	case d.KVBytesPerToken <= 0:
		return fmt.Errorf("sim: KV bytes per token must be positive, got %d", d.KVBytesPerToken)
	case !(d.KVTransferBandwidth > 0):
		return fmt.Errorf("sim: KV transfer bandwidth must be positive, got %v bytes/s", d.KVTransferBandwidth)
	case d.PrefillTimeout < 0:
		return fmt.Errorf("sim: negative prefill timeout %v", d.PrefillTimeout)
	}
	return nil
}

// role is the part of worker index w (from 0): the prefill engines come
// first.
func (d Disagg) role(w int) router.Role {
	switch {
	case !d.Enabled():
		return router.RoleBoth
	case w < d.PrefillWorkers:
		return router.RolePrefill
	}
	return router.RoleDecode
}

// TransferTime is the model time of pulling blocks KV blocks of blockSize
// tokens, computed as the mocker's decode engines wait it.
func (d Disagg) TransferTime(blocks, blockSize int) time.Duration {
	bytes := float64(blocks) * float64(blockSize) * float64(d.KVBytesPerToken)
	return time.Duration(bytes / d.KVTransferBandwidth * float64(time.Second))
}

// How a request's prompt was prefilled on a disaggregated fleet; the local
// reasons are serve's (kvrouter_frontend_prefill_decisions_total).
const (
	howUnknown        uint8 = iota // not yet decided
	howRemote                      // on a prefill engine, KV pulled by the decode engine
	howShortUncached               // locally: too little of it uncached to be worth a transfer
	howPrefillBusy                 // locally: every prefill engine busy
	howNoPrefill                   // locally: no prefill engine
	howPrefillError                // locally: the prefill engine refused it
	howPrefillTimeout              // locally: the prefill took too long
)

// pdState is a request's disaggregated life, model ns.
type pdState struct {
	pfirst   int64 // the prefill engine's token
	transfer int64 // the pull's duration
	pe, de   int32 // prefill and decode engines (indices in engines)
	pcached  int32 // prompt tokens the prefill engine had cached
	pulled   int32 // blocks pulled from the prefill engine
	kept     int32 // full prompt blocks the decode engine had cached
	how      uint8
}

const prefillSuffix = "-prefill"

// arriveDisagg starts a request on a disaggregated fleet.
func (s *sim) arriveDisagg(i int, req *workload.Request) {
	s.held[i] = *req
	if s.r.ShortUncached(context.Background(), router.Request{Tokens: req.Tokens, OSL: req.OSL, CacheSalt: s.salt(req)}, s.cfg.Disagg.MinUncachedTokens) {
		s.local(i, howShortUncached)
		return
	}
	d, queued, err := s.r.Submit(&router.Request{ID: strconv.Itoa(i) + prefillSuffix, Tokens: req.Tokens, CacheSalt: s.salt(req), Prefill: true}, s.onDispatch(i, dispPrefill))
	if queued {
		s.queuedBy[dispPrefill]++
	} else {
		s.prefillRouted(i, d, err)
	}
}

// prefillRouted acts on the prefill's routing: the prefill engine gets it,
// or the decode engine prefills.
func (s *sim) prefillRouted(i int, d router.Decision, err error) {
	switch {
	case err == nil:
		s.startPrefill(i, d)
	case errors.Is(err, sched.ErrAllBusy):
		s.local(i, howPrefillBusy)
	case errors.Is(err, router.ErrNoWorkers):
		s.local(i, howNoPrefill)
	default:
		s.local(i, howPrefillError)
	}
}

// local serves a request aggregated on a decode engine.
func (s *sim) local(i int, how uint8) {
	s.pd[i].how = how
	req := s.held[i]
	delete(s.held, i)
	s.submit(i, &req)
}

func (s *sim) startPrefill(i int, d router.Decision) {
	e := s.engineOf(d.Worker)
	req := s.held[i]
	id := strconv.Itoa(i)
	deadline := s.reqs[i].arrival + s.cfg.Disagg.prefillTimeout()
	if s.now >= deadline {
		s.r.Free(id + prefillSuffix)
		s.local(i, howPrefillTimeout)
		return
	}
	// The prompt may be handed over (Owned) although the loop reads it
	// again for the decode: a request of max_tokens 1 finishes with its
	// first token, so the engine never appends to it.
	if err := s.engines[e].eng.Add(engine.Request{ID: id, Tokens: req.Tokens, MaxTokens: 1, CacheSalt: req.CacheSalt, HoldBlocks: true, Owned: s.ownsPrompts}); err != nil {
		s.r.Free(id + prefillSuffix)
		s.local(i, howPrefillError)
		return
	}
	pd := &s.pd[i]
	pd.pe, pd.how = int32(e), howRemote
	s.wake(e)
	s.schedule(deadline, evPrefillTimeout, i)
}

// prefillTimedOut gives up a prefill that has not answered by its
// deadline: the prefill engine drops it and the decode engine prefills.
func (s *sim) prefillTimedOut(i int) error {
	pd := &s.pd[i]
	if pd.how != howRemote || pd.pfirst != 0 {
		return nil // answered in time
	}
	id := strconv.Itoa(i)
	// Abort fails on a prefill whose token its engine's current step
	// computed: prefilled releases its hold when the step ends.
	s.engines[pd.pe].eng.Abort(id)
	s.r.Free(id + prefillSuffix)
	s.local(i, howPrefillTimeout)
	return s.flushDispatched()
}

// prefilled is the prefill engine's token: the prefill booking ends and the
// decode is routed.
func (s *sim) prefilled(i int, cached int) error {
	pd := &s.pd[i]
	if pd.how == howPrefillTimeout {
		// Its step began before the deadline and ended after: nobody
		// waits for these blocks any more.
		s.releaseHold(int(pd.pe), strconv.Itoa(i))
		return nil
	}
	if pd.how != howRemote || pd.pfirst != 0 {
		return fmt.Errorf("sim: request %d prefilled twice", i)
	}
	pd.pfirst, pd.pcached = s.now, int32(cached)
	id := strconv.Itoa(i)
	s.r.Free(id + prefillSuffix)
	req := s.held[i]
	d, queued, err := s.r.Submit(&router.Request{ID: id, Tokens: req.Tokens, OSL: req.OSL, CacheSalt: s.salt(&req), Overrides: s.decodeOverrides}, s.onDispatch(i, dispDecode))
	if queued {
		s.queuedBy[dispDecode]++
	} else {
		s.decodeRouted(i, d, err)
	}
	return nil
}

// decodeRouted starts the pull of the blocks the decode engine lacks.
func (s *sim) decodeRouted(i int, d router.Decision, err error) {
	pd := &s.pd[i]
	if err != nil {
		s.abandon(i, err)
		return
	}
	e := s.engineOf(d.Worker)
	toks := s.held[i].Tokens
	full := len(toks) / s.cfg.Engine.BlockSize
	kept := s.engines[e].eng.CachedPrefixBlocks(toks)
	pd.de, pd.kept, pd.pulled = int32(e), int32(kept), int32(full-kept)
	pd.transfer = int64(s.cfg.Disagg.TransferTime(full-kept, s.cfg.Engine.BlockSize))
	s.schedule(s.now+pd.transfer, evTransfer, i)
}

// transferred is the pull's end: the prefill engine lets the blocks go and
// the decode engine admits the request with its prompt loaded.
func (s *sim) transferred(i int) error {
	pd := &s.pd[i]
	req := s.held[i]
	delete(s.held, i)
	id := strconv.Itoa(i)
	s.releaseHold(int(pd.pe), id)
	full := len(req.Tokens) / s.cfg.Engine.BlockSize
	if err := s.engines[pd.de].eng.Add(engine.Request{ID: id, Tokens: req.Tokens, MaxTokens: req.OSL, CacheSalt: req.CacheSalt, KVLoadedBlocks: full, Owned: s.ownsPrompts}); err != nil {
		s.r.Free(id)
		s.fail(i, err)
	} else {
		s.wake(int(pd.de))
	}
	return s.flushDispatched()
}

// abandon fails a request whose prefill is done but whose decode cannot
// be: the prefill engine's hold ends with it.
func (s *sim) abandon(i int, err error) {
	s.releaseHold(int(s.pd[i].pe), strconv.Itoa(i))
	delete(s.held, i)
	s.fail(i, err)
}

// releaseHold ends a prefill engine's hold on a request's blocks, and wakes
// the engine if it waits for room.
func (s *sim) releaseHold(e int, id string) {
	eng := s.engines[e].eng
	if eng.Release(id) && !eng.Idle() {
		s.wake(e)
	}
}

// DisaggStats is Point.Disagg: where prompts were prefilled and what
// crossed the network, over the requests that finished.
type DisaggStats struct {
	// RemotePrefills were prefilled on a prefill engine, their KV pulled.
	RemotePrefills int `json:"remote_prefills"`
	// LocalPrefills were prefilled by their decode engine, by why.
	LocalPrefills LocalPrefills `json:"local_prefills"`
	// Per remote prefill, means: blocks pulled, their bytes, and the full
	// prompt blocks the decode engine had cached already.
	TransferredBlocks    float64     `json:"transferred_blocks_per_request"`
	TransferredBytes     float64     `json:"transferred_bytes_per_request"`
	CachedOnDecodeBlocks float64     `json:"cached_on_decode_blocks_per_request"`
	TransferMS           replay.Dist `json:"transfer_ms"`
	// PrefillTTFT is arrival to the prefill engine's token; RemoteTTFT the
	// same requests' TTFT, arrival to the decode engine's first token.
	PrefillTTFT replay.Dist `json:"prefill_ttft_ms"`
	RemoteTTFT  replay.Dist `json:"remote_ttft_ms"`
	// LocalTTFT is the TTFT of the requests prefilled locally.
	LocalTTFT replay.Dist `json:"local_ttft_ms"`
}

// LocalPrefills counts local prefills by serve's reasons.
type LocalPrefills struct {
	ShortUncached   int `json:"short_uncached"`
	PrefillBusy     int `json:"prefill_busy"`
	NoPrefillWorker int `json:"no_prefill_worker"`
	PrefillError    int `json:"prefill_error"`
	PrefillTimeout  int `json:"prefill_timeout"`
}

// Total is every local prefill.
func (l LocalPrefills) Total() int {
	return l.ShortUncached + l.PrefillBusy + l.NoPrefillWorker + l.PrefillError + l.PrefillTimeout
}

func (s *sim) disaggStats() *DisaggStats {
	st := &DisaggStats{}
	var prefill, remote, local, transfer []float64
	var pulled, kept int64
	for i := range s.reqs {
		rs, pd := &s.reqs[i], &s.pd[i]
		if !rs.finished {
			continue
		}
		ttft := float64(rs.first-rs.arrival) / 1e6
		switch pd.how {
		case howRemote:
			st.RemotePrefills++
			prefill = append(prefill, float64(pd.pfirst-rs.arrival)/1e6)
			remote = append(remote, ttft)
			transfer = append(transfer, float64(pd.transfer)/1e6)
			pulled += int64(pd.pulled)
			kept += int64(pd.kept)
			continue
		case howShortUncached:
			st.LocalPrefills.ShortUncached++
		case howPrefillBusy:
			st.LocalPrefills.PrefillBusy++
		case howNoPrefill:
			st.LocalPrefills.NoPrefillWorker++
		case howPrefillError:
			st.LocalPrefills.PrefillError++
		case howPrefillTimeout:
			st.LocalPrefills.PrefillTimeout++
		}
		local = append(local, ttft)
	}
	if n := float64(st.RemotePrefills); n > 0 {
		st.TransferredBlocks = float64(pulled) / n
		st.TransferredBytes = float64(pulled) * float64(s.cfg.Engine.BlockSize) * float64(s.cfg.Disagg.KVBytesPerToken) / n
		st.CachedOnDecodeBlocks = float64(kept) / n
	}
	st.TransferMS, st.PrefillTTFT = replay.DistOf(transfer), replay.DistOf(prefill)
	st.RemoteTTFT, st.LocalTTFT = replay.DistOf(remote), replay.DistOf(local)
	return st
}
