package natsplane

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/core/eventlog"
	"github.com/kvrouter/kvrouter/core/kv"
)

// Recovery protocol. A router sends {"dp_rank", "from", "to"} to a worker's
// Recovery subject with a reply inbox; to = 0 asks for a dump. The worker
// answers with one or more messages to the inbox, each with headers:
// Kv-Kind "range" (body: JSON array of events) or "dump" (body: binary
// dump chunk), Kv-Last (the last event id the answer brings the router
// to), and Kv-Final "1" on the last message. A range that left the ring is
// answered with a dump.
const (
	hdrKind  = "Kv-Kind"
	hdrLast  = "Kv-Last"
	hdrFinal = "Kv-Final"

	kindRange = "range"
	kindDump  = "dump"

	// recoveryChunk bounds one reply message: 4,096 dump records are
	// 150 kB, well under MaxPayload and NATS' 1 MiB default.
	recoveryChunk = 4096
)

type recoveryRequest struct {
	DPRank uint32 `json:"dp_rank"`
	From   uint64 `json:"from"`
	To     uint64 `json:"to"`
}

// LoadReport is one engine rank's own account of its load, published on
// KVMetrics. LastEventID lets routers notice lost events that no later
// event revealed.
type LoadReport struct {
	WorkerID uint64 `json:"worker_id"`
	DPRank   uint32 `json:"dp_rank"`
	// LoadKnown is false when the engine's /metrics could not be read: the
	// report then only carries LastEventID.
	LoadKnown   bool    `json:"load_known"`
	Waiting     int     `json:"num_requests_waiting"`
	Running     int     `json:"num_requests_running"`
	KVUsage     float64 `json:"kv_cache_usage_perc"`
	LastEventID uint64  `json:"last_event_id"`
	// Unsupported is the rank's count of KV-event fields the router does
	// not honour, by field, as the agent's event source counted them
	// (kvrouter_worker_kv_events_unsupported_total on a router that reads
	// the engine itself).
	Unsupported map[string]uint64 `json:"kv_events_unsupported,omitempty"`
}

// PublisherConfig configures a worker's side of the event plane.
type PublisherConfig struct {
	Names    Names
	Worker   uint64
	RingSize int // events kept per rank for recovery; 0 means 1,024
	// Loss, when set, is asked before each publish; true drops the message
	// after it was logged, as a lossy network would. Tests use it.
	Loss   func() bool
	Logger *slog.Logger
}

// PublisherStats are a publisher's counters.
type PublisherStats struct {
	Published, Refused, Lost, PublishErrors uint64
	RangesServed, DumpsServed               uint64
	MalformedRequests                       uint64
}

// Publisher numbers a worker's KV events, publishes them and answers
// routers' recovery requests from its log. In durable mode the stream
// captures the same subject, so publishing is identical.
type Publisher struct {
	nc    *nats.Conn
	cfg   PublisherConfig
	log   *eventlog.Log
	sub   *nats.Subscription
	subj  string
	stats struct {
		published, refused, lost, publishErrors atomic.Uint64
		ranges, dumps, malformed                atomic.Uint64
	}
}

// NewPublisher starts the worker's recovery service.
func NewPublisher(nc *nats.Conn, cfg PublisherConfig) (*Publisher, error) {
	cfg.Names = cfg.Names.orDefault()
	if err := cfg.Names.Validate(); err != nil {
		return nil, err
	}
	if cfg.Worker == 0 {
		return nil, errors.New("natsplane: publisher needs a worker id")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	p := &Publisher{nc: nc, cfg: cfg, log: eventlog.New(cfg.Worker, cfg.RingSize), subj: cfg.Names.KVEvents()}
	sub, err := nc.Subscribe(cfg.Names.Recovery(cfg.Worker), p.serveRecovery)
	if err != nil {
		return nil, fmt.Errorf("natsplane: recovery service: %w", err)
	}
	p.sub = sub
	// Routers may ask as soon as the worker is announced: the subscription
	// must be on the server by then, not just queued in this client.
	if err := nc.Flush(); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("natsplane: recovery service: %w", err)
	}
	return p, nil
}

// Publish numbers ev, logs it and sends it. An event the worker's own
// index refuses (an unknown parent) is counted and not sent.
func (p *Publisher) Publish(ev kv.Event) error {
	ev, err := p.log.Append(ev)
	if err != nil {
		p.stats.refused.Add(1)
		return err
	}
	if p.cfg.Loss != nil && p.cfg.Loss() {
		p.stats.lost.Add(1)
		return nil
	}
	buf := eventBufs.Get().(*[]byte)
	b, err := ev.AppendJSON((*buf)[:0])
	if err == nil {
		err = p.nc.Publish(p.subj, b) // copies b into the connection's buffer
		*buf = b
	}
	eventBufs.Put(buf)
	if err != nil {
		p.stats.publishErrors.Add(1)
		return fmt.Errorf("natsplane: publish: %w", err)
	}
	p.stats.published.Add(1)
	return nil
}

var eventBufs = sync.Pool{New: func() any { b := make([]byte, 0, 2048); return &b }}

// PublishLoad sends a rank's load report, stamped with its last event id.
func (p *Publisher) PublishLoad(r LoadReport) error {
	r.WorkerID = p.cfg.Worker
	r.LastEventID = p.log.Last(r.DPRank)
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return p.nc.Publish(p.cfg.Names.KVMetrics(), b)
}

// Dump returns rank's current blocks as the worker knows them, and the id
// of the last event they include.
func (p *Publisher) Dump(rank uint32) ([]kv.Event, uint64) { return p.log.Dump(rank) }

// Stats returns the counters.
func (p *Publisher) Stats() PublisherStats {
	return PublisherStats{
		Published: p.stats.published.Load(), Refused: p.stats.refused.Load(),
		Lost: p.stats.lost.Load(), PublishErrors: p.stats.publishErrors.Load(),
		RangesServed: p.stats.ranges.Load(), DumpsServed: p.stats.dumps.Load(),
		MalformedRequests: p.stats.malformed.Load(),
	}
}

// Close stops answering recovery requests.
func (p *Publisher) Close() error { return p.sub.Unsubscribe() }

func (p *Publisher) serveRecovery(m *nats.Msg) {
	if m.Reply == "" {
		return
	}
	var req recoveryRequest
	if err := json.Unmarshal(m.Data, &req); err != nil {
		p.stats.malformed.Add(1)
		p.cfg.Logger.Warn("malformed recovery request skipped", "err", err)
		return
	}
	if req.To > 0 {
		if events, ok := p.log.Range(req.DPRank, req.From, req.To); ok {
			p.stats.ranges.Add(1)
			p.reply(m.Reply, kindRange, req.To, events)
			return
		}
	}
	p.stats.dumps.Add(1)
	events, last := p.log.Dump(req.DPRank)
	p.reply(m.Reply, kindDump, last, events)
}

func (p *Publisher) reply(inbox, kind string, last uint64, events []kv.Event) {
	for start := 0; ; start += recoveryChunk {
		end := min(start+recoveryChunk, len(events))
		msg := nats.NewMsg(inbox)
		msg.Header.Set(hdrKind, kind)
		msg.Header.Set(hdrLast, strconv.FormatUint(last, 10))
		var err error
		if kind == kindRange {
			msg.Data, err = json.Marshal(events[start:end])
		} else {
			msg.Data, err = EncodeDump(nil, events[start:end])
		}
		if end == len(events) {
			msg.Header.Set(hdrFinal, "1")
		}
		if err == nil {
			err = p.nc.PublishMsg(msg)
		}
		if err != nil {
			p.cfg.Logger.Warn("recovery reply failed", "err", err)
			return
		}
		if end == len(events) {
			return
		}
	}
}
