// Package metrics exposes the router's counters to Prometheus. It is an
// adapter at the edge: the core counts, this package names and exports.
//
// The collector reads Router.Stats at scrape time, so the core keeps no
// Prometheus state and pays nothing between scrapes.
package metrics

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/core/router"
)

// Namespace prefixes every metric of kvrouter.
const Namespace = "kvrouter"

type desc struct {
	*prometheus.Desc
	kind prometheus.ValueType
}

func newDesc(name, help string, kind prometheus.ValueType, labels ...string) desc {
	return desc{prometheus.NewDesc(prometheus.BuildFQName(Namespace, "", name), help, labels, nil), kind}
}

// Collector exports one router's state.
type Collector struct {
	r *router.Router

	decisions, booked, queued, allBusy, errors desc
	overlapBlocks, promptBlocks                desc
	queuePending, queueTokens                  desc
	events, eventsRejected                     desc
	blocks, blocksSkipped                      desc
	indexPairs, indexEvicted, lookupWaits      desc
	approxPairs, approxDropped                 desc
	activeRequests                             desc
	workerDecode, workerPrefill, workerReqs    desc
	reanchored, inferred                       desc
	recovering, rankInferred                   desc
	workerBlockSize, blockSizeMismatch         desc
	workerRole                                 desc
	workerOverBound                            desc
}

// NewCollector returns a collector for r; register it with a
// prometheus.Registerer.
func NewCollector(r *router.Router) *Collector {
	c, g := prometheus.CounterValue, prometheus.GaugeValue
	return &Collector{
		r:                 r,
		decisions:         newDesc("router_decisions_total", "Routing decisions made.", c),
		booked:            newDesc("router_requests_booked_total", "Requests booked on a worker (their load counts until freed).", c),
		queued:            newDesc("router_requests_queued_total", "Requests that waited in the admission queue.", c),
		allBusy:           newDesc("router_all_workers_busy_total", "Requests refused because every worker was over its busy threshold.", c),
		errors:            newDesc("router_errors_total", "Routing decisions that failed for another reason.", c),
		overlapBlocks:     newDesc("router_overlap_blocks_total", "Prompt blocks already cached on the chosen worker; divided by router_prompt_blocks_total it is the KV hit rate.", c),
		promptBlocks:      newDesc("router_prompt_blocks_total", "Full prompt blocks of routed requests.", c),
		queuePending:      newDesc("router_queue_pending_requests", "Requests waiting in the admission queue.", g),
		queueTokens:       newDesc("router_queue_pending_tokens", "Uncached prompt tokens of the requests waiting in the queue.", g),
		events:            newDesc("kv_events_total", "KV events received, by type.", c, "type"),
		eventsRejected:    newDesc("kv_events_rejected_total", "KV events refused whole, by reason.", c, "reason"),
		blocks:            newDesc("kv_blocks_total", "Blocks applied to the index, by operation.", c, "op"),
		blocksSkipped:     newDesc("kv_blocks_skipped_total", "Blocks of accepted events that were skipped, by reason.", c, "reason"),
		indexPairs:        newDesc("index_pairs", "Indexed (block, worker) pairs in the event-fed index.", g),
		indexEvicted:      newDesc("index_evicted_pairs_total", "Pairs evicted from the event-fed index by its memory cap.", c),
		lookupWaits:       newDesc("index_lookup_waits_total", "Lookups of an index shard that found it taken by a KV-event writer and waited: how often routing decisions queue behind event application.", c),
		approxPairs:       newDesc("approx_index_pairs", "Pairs in the approximate (routing-fed) index.", g),
		approxDropped:     newDesc("approx_index_dropped_pairs_total", "Pairs dropped from the approximate index, by reason.", c, "reason"),
		activeRequests:    newDesc("router_active_requests", "Booked requests not yet freed.", g),
		workerDecode:      newDesc("worker_active_decode_blocks", "Predicted KV blocks in use on a worker rank.", g, "worker_id", "dp_rank"),
		workerPrefill:     newDesc("worker_active_prefill_tokens", "Predicted prompt tokens awaiting prefill on a worker rank.", g, "worker_id", "dp_rank"),
		workerReqs:        newDesc("worker_active_requests", "Booked requests on a worker rank.", g, "worker_id", "dp_rank"),
		reanchored:        newDesc("kv_events_reanchored_total", "Stored events below a parent the index did not know, placed from the prompts just routed to the worker.", c),
		inferred:          newDesc("kv_blocks_inferred_total", "Blocks held on inference while re-anchoring: above a re-anchored parent, never named by the engine.", c),
		recovering:        newDesc("worker_kv_index_recovering", "1 while a worker rank's index is rebuilt from traffic: its events hang below blocks the router never saw.", g, "worker_id", "dp_rank"),
		rankInferred:      newDesc("worker_kv_index_inferred_blocks", "Blocks of a recovering worker rank held on inference.", g, "worker_id", "dp_rank"),
		workerBlockSize:   newDesc("worker_block_size", "Tokens per KV block of a worker, as its KV events carry it (or as announced, or the router's own until they do); its requests are matched with hashes of this size.", g, "worker_id"),
		blockSizeMismatch: newDesc("worker_block_size_mismatch", "1 while a worker's KV block size is not the router's --kv-cache-block-size.", g, "worker_id"),
		workerRole:        newDesc("worker_role", "1 for each worker, labelled with its role (prefill, decode or both): join the per-worker gauges on worker_id to see each pool's load.", g, "worker_id", "role"),
		workerOverBound:   newDesc("worker_kv_blocks_over_bound_total", "Stored blocks of a worker rank the index refused because the rank already held a quarter more than its announced KV capacity, plus 1,024 (a buggy or hostile engine); only ranks that went past it.", c, "worker_id", "dp_rank"),
	}
}

func (c *Collector) all() []desc {
	return []desc{c.decisions, c.booked, c.queued, c.allBusy, c.errors, c.overlapBlocks, c.promptBlocks,
		c.queuePending, c.queueTokens, c.events, c.eventsRejected, c.blocks, c.blocksSkipped,
		c.indexPairs, c.indexEvicted, c.lookupWaits, c.approxPairs, c.approxDropped, c.activeRequests,
		c.workerDecode, c.workerPrefill, c.workerReqs, c.reanchored, c.inferred, c.recovering, c.rankInferred,
		c.workerBlockSize, c.blockSizeMismatch, c.workerRole, c.workerOverBound}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.all() {
		ch <- d.Desc
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	st := c.r.Stats()
	emit := func(d desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d.Desc, d.kind, v, labels...)
	}
	emit(c.decisions, float64(st.Decisions))
	emit(c.booked, float64(st.Booked))
	emit(c.queued, float64(st.Queued))
	emit(c.allBusy, float64(st.AllBusy))
	emit(c.errors, float64(st.Errors))
	emit(c.overlapBlocks, float64(st.OverlapBlocks))
	emit(c.promptBlocks, float64(st.PromptBlocks))
	emit(c.queuePending, float64(st.QueuePending))
	emit(c.queueTokens, float64(st.QueuePendingTokens))

	ix := st.Index
	emit(c.events, float64(ix.StoredEvents), "stored")
	emit(c.events, float64(ix.RemovedEvents), "removed")
	emit(c.events, float64(ix.ClearedEvents), "cleared")
	emit(c.eventsRejected, float64(ix.UnknownParent), "unknown_parent")
	emit(c.eventsRejected, float64(ix.EmptyStored), "empty_stored")
	emit(c.eventsRejected, float64(ix.UnknownKind), "unknown_kind")
	emit(c.eventsRejected, float64(st.UnknownWorkerEvents), "unknown_worker")
	emit(c.eventsRejected, float64(st.DPRankEvents), "dp_rank_out_of_range")
	emit(c.blocks, float64(ix.BlocksStored), "stored")
	emit(c.blocks, float64(ix.BlocksRemoved), "removed")
	emit(c.blocksSkipped, float64(ix.UnknownBlocks), "unknown_block")
	emit(c.blocksSkipped, float64(ix.DuplicateBlocks), "duplicate")
	emit(c.blocksSkipped, float64(st.MisSizedBlocks), "mis_sized")
	emit(c.blocksSkipped, float64(ix.BlocksOverBound), "over_bound")
	emit(c.indexPairs, float64(st.IndexedPairs))
	emit(c.indexEvicted, float64(ix.PairsEvicted))
	emit(c.lookupWaits, float64(ix.LookupWaits))
	emit(c.approxPairs, float64(st.Approx.Pairs))
	emit(c.approxDropped, float64(st.Approx.Expired), "expired")
	emit(c.approxDropped, float64(st.Approx.Evicted), "size_bound")
	emit(c.activeRequests, float64(st.Load.Active))
	emit(c.reanchored, float64(ix.Reanchored))
	emit(c.inferred, float64(ix.BlocksInferred))
	for _, ob := range c.r.OverBound() {
		emit(c.workerOverBound, float64(ob.Refused), strconv.FormatUint(ob.Worker.ID, 10), strconv.FormatUint(uint64(ob.Worker.DPRank), 10))
	}
	for _, rc := range c.r.Recovering() {
		id, rank := strconv.FormatUint(rc.Worker.ID, 10), strconv.FormatUint(uint64(rc.Worker.DPRank), 10)
		emit(c.recovering, 1, id, rank)
		emit(c.rankInferred, float64(rc.Inferred), id, rank)
	}

	routerSize := c.r.BlockSize()
	for _, w := range c.r.WorkerBlockSizes() {
		id := strconv.FormatUint(w.ID, 10)
		emit(c.workerBlockSize, float64(w.BlockSize), id)
		mismatch := 0.0
		if w.Mismatched(routerSize) {
			mismatch = 1
		}
		emit(c.blockSizeMismatch, mismatch, id)
	}

	for _, w := range c.r.Workers() {
		emit(c.workerRole, 1, strconv.FormatUint(w.ID, 10), w.Role.String())
	}
	for _, l := range c.r.Loads() {
		id, rank := strconv.FormatUint(l.Worker.ID, 10), strconv.FormatUint(uint64(l.Worker.DPRank), 10)
		emit(c.workerDecode, l.ActiveDecodeBlocks, id, rank)
		emit(c.workerPrefill, float64(l.ActivePrefillTokens), id, rank)
		emit(c.workerReqs, float64(l.ActiveRequests), id, rank)
	}
}
