package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// enginePool runs each simulated engine as a fleet of its own on fixed
// ports, so that one engine can die and come back where the router (or
// its agent) expects it, with an empty cache as a restarted vLLM has.
// The events and replay sockets are reached through cuttable proxies.
type enginePool struct {
	base  fleet.Config
	slots []*engineSlot
}

type engineSlot struct {
	id                       uint64
	name                     string
	cfg                      fleet.Config
	eventsProxy, replayProxy *proxy
	mu                       sync.Mutex
	running                  *fleet.Fleet
	startedAt                time.Time
}

// freePort picks a port an engine can be restarted on later. Ports the
// kernel hands out for ":0" come from the ephemeral range, where any
// outgoing connection may take one in the meantime and make the restart
// fail with "address already in use"; so the pick is below that range
// (Linux's default starts at 32768), from a random start so that test
// processes running side by side do not walk the same sequence.
func freePort() (int, error) {
	const low, high = 20000, 32000
	portMu.Lock()
	defer portMu.Unlock()
	if nextPort == 0 {
		nextPort = low + rand.IntN(high-low)
	}
	for range high - low {
		p := nextPort
		if nextPort++; nextPort >= high {
			nextPort = low
		}
		ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			continue
		}
		ln.Close()
		return p, nil
	}
	return 0, fmt.Errorf("no free port in %d-%d", low, high)
}

var (
	portMu   sync.Mutex
	nextPort int
)

func startPool(ctx context.Context, base fleet.Config, n int) (_ *enginePool, err error) {
	p := &enginePool{base: base}
	defer func() {
		if err != nil {
			p.close()
		}
	}()
	for i := range n {
		s := &engineSlot{id: uint64(i + 1), name: "engine-" + strconv.Itoa(i), cfg: base}
		s.cfg.NumWorkers, s.cfg.DataParallelSize, s.cfg.Host = 1, 1, "127.0.0.1"
		// Distinct seeds: engines name the same content with different ids.
		s.cfg.Engine.Seed = base.Engine.Seed ^ uint64(i+1)*0x9e3779b97f4a7c15
		for _, port := range []*int{&s.cfg.HTTPPort, &s.cfg.KVEventsPort, &s.cfg.KVEventsReplayPort} {
			if *port, err = freePort(); err != nil {
				return nil, err
			}
		}
		if s.eventsProxy, err = newProxy(fmt.Sprintf("127.0.0.1:%d", s.cfg.KVEventsPort)); err != nil {
			return nil, err
		}
		if s.replayProxy, err = newProxy(fmt.Sprintf("127.0.0.1:%d", s.cfg.KVEventsReplayPort)); err != nil {
			return nil, err
		}
		p.slots = append(p.slots, s)
		if err := s.start(ctx); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// start binds the engine's fixed ports, retrying while the ports of the
// engine it replaces are still being released.
func (s *engineSlot) start(ctx context.Context) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		f, err := fleet.Start(ctx, s.cfg)
		if err == nil {
			s.mu.Lock()
			s.running, s.startedAt = f, time.Now()
			s.mu.Unlock()
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// kill drops the engine at once: open streams break, its sockets close.
func (s *engineSlot) kill() {
	s.mu.Lock()
	f := s.running
	s.running = nil
	s.mu.Unlock()
	if f != nil {
		f.Close()
	}
}

// up tells whether the engine runs (its HTTP server is listening). Whether
// it gets traffic again is the router's choice: a restarted engine holds no
// cache, and kv routing may rightly prefer the others for a while.
func (s *engineSlot) up() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.running != nil
}

// blocks is what the running engine caches; empty when down.
func (s *engineSlot) blocks() heldBlocks {
	s.mu.Lock()
	defer s.mu.Unlock()
	held := newHeldBlocks()
	if s.running == nil {
		return held
	}
	h := blockhash.New(s.cfg.Engine.BlockSize, "")
	seqOf := map[uint64]uint64{}
	for _, b := range s.running.Engines()[0].Ranks[0].Runner.CachedBlocks() { // parents first
		seq := h.LocalHash(b.Tokens)
		if b.Parent != nil {
			seq = blockhash.Chain(seqOf[*b.Parent], seq)
		}
		seqOf[b.Hash] = seq
		held.ids[b.Hash], held.seqs[seq] = seq, true
	}
	return held
}

// workers describes the engines as the router sees them: HTTP direct,
// events and replay through the proxies.
func (p *enginePool) workers() []serve.WorkerSpec {
	var out []serve.WorkerSpec
	for _, s := range p.slots {
		out = append(out, serve.WorkerSpec{
			ID: s.id, Name: s.name, Model: s.cfg.Server.Model, DPSize: 1,
			URL:              fmt.Sprintf("http://127.0.0.1:%d", s.cfg.HTTPPort),
			Events:           "tcp://" + s.eventsProxy.addr(),
			Replay:           "tcp://" + s.replayProxy.addr(),
			KVBlocks:         s.cfg.Engine.NumGPUBlocks,
			MaxBatchedTokens: s.cfg.Engine.MaxNumBatchedTokens,
		})
	}
	return out
}

func (p *enginePool) close() {
	for _, s := range p.slots {
		s.kill()
		if s.eventsProxy != nil {
			s.eventsProxy.close()
		}
		if s.replayProxy != nil {
			s.replayProxy.close()
		}
	}
}
