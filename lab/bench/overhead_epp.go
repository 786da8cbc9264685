package bench

import (
	"context"
	"errors"
	"net"
	"net/http"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvrouter/kvrouter/adapters/epp/epptest"
	"github.com/kvrouter/kvrouter/adapters/modeltok"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/serve"
)

// EPPResult is the same loads as the routed phases, sent through a gateway
// that asks kvrouter's endpoint picker (ext_proc) for each request's
// engine and proxies it there, as an Inference Extension gateway does
// (package epptest stands in for Envoy).
type EPPResult struct {
	Streamed Phase `json:"streamed"`
	Short    Phase `json:"short"`
	// Added* are the streamed TTFT through the gateway and the picker
	// minus direct, as OverheadResult.Added* are the frontend's.
	AddedP50ms float64 `json:"added_ttft_p50_ms"`
	AddedP99ms float64 `json:"added_ttft_p99_ms"`
	// Pick* are the picker's answer time as the gateway sees it: from the
	// request's headers sent to the headers' answer (the engine named),
	// the body sent and routed in between; warm-up requests included.
	PickP50ms      float64 `json:"pick_p50_ms"`
	PickP99ms      float64 `json:"pick_p99_ms"`
	ShortPickP50ms float64 `json:"short_pick_p50_ms"`
	ShortPickP99ms float64 `json:"short_pick_p99_ms"`
	// Chunk* are the streamed phase's response body chunks' round trip
	// through the picker (FULL_DUPLEX_STREAMED sends each one there and
	// back before the client gets it).
	ChunkP50ms float64 `json:"chunk_p50_ms"`
	ChunkP99ms float64 `json:"chunk_p99_ms"`
}

// eppPhases runs run's two loads against a fresh frontend serving the
// picker, through a gateway in front of the engines.
func eppPhases(ctx context.Context, workers []serve.WorkerSpec, tokenizers map[string]*modeltok.Model, run func(target []string, streamed bool) (Phase, error)) (res *EPPResult, err error) {
	rcfg := router.DefaultConfig()
	rcfg.QueueThreshold = nil // measure the path, not admission control
	var s *serve.Server
	err = labelled(ctx, "frontend", func(ctx context.Context) (err error) {
		s, err = serve.Start(ctx, serve.Config{Router: rcfg, Workers: workers, Addr: "127.0.0.1:0", EPPAddr: "127.0.0.1:0", Tokenizers: tokenizers})
		return err
	})
	if err != nil {
		return nil, err
	}
	defer s.Close()
	ready, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := s.WaitReady(ready); err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient(s.EPPAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	gw := &epptest.Gateway{Conn: conn, Client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024}}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	hs := &http.Server{Handler: gw}
	done := make(chan error, 1)
	go func() { done <- hs.Serve(ln) }()
	defer func() {
		_ = hs.Close()
		if serr := <-done; !errors.Is(serr, http.ErrServerClosed) && err == nil {
			err = serr
		}
	}()
	target := []string{"http://" + ln.Addr().String()}
	res = &EPPResult{}
	pct := func(ds []time.Duration) (p50, p99 float64) {
		ms := make([]float64, len(ds))
		for i, d := range ds {
			ms[i] = float64(d.Microseconds()) / 1e3
		}
		return Percentile(ms, 50), Percentile(ms, 99)
	}
	if res.Streamed, err = run(target, true); err != nil {
		return nil, err
	}
	res.PickP50ms, res.PickP99ms = pct(gw.Picks())
	res.ChunkP50ms, res.ChunkP99ms = pct(gw.Chunks())
	n := len(gw.Picks())
	if res.Short, err = run(target, false); err != nil {
		return nil, err
	}
	res.ShortPickP50ms, res.ShortPickP99ms = pct(gw.Picks()[n:])
	return res, nil
}
