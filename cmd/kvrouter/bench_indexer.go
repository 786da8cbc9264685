package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/adapters/indexerapi"
	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// benchIndexerConfig shapes bench indexer's fleet and queries.
type benchIndexerConfig struct {
	Workers, PromptsPerWorker, PromptBlocks, SharedBlocks, Queries, BlockSize int
	Seed                                                                      uint64
}

func newBenchIndexerCmd() *cobra.Command {
	var cfg benchIndexerConfig
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "indexer",
		Short: "Time overlap queries through the indexer HTTP API, and a decision with a remote primary",
		Long: `Fills one index with --workers engines, each holding --prompts-per-worker
prompts of --prompt-blocks blocks (the first --shared-blocks shared by the
workers of a group of 8, as a system prompt is), serves it with kvrouter
indexer's HTTP API on 127.0.0.1, and times, one at a time over a kept-alive
connection:

  query_by_hash  POST /query_by_hash, MessagePack, the router's path
  query          POST /query, JSON token ids
  local          a routing decision (BestWorker, query only) on a router
                 keeping the same index itself
  remote         the same decision on a router using the served index
                 (--use-remote-indexer): its added cost is remote - local

Each query is one of the stored prompts with as many new blocks after it.
The timings include the client's encoding and decoding, not a network.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			rep, err := benchIndexer(cmd.Context(), cfg)
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(rep)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintf(tw, "workers %d, pairs %d, %d queries of %d blocks\n", cfg.Workers, rep.Pairs, cfg.Queries, 2*cfg.PromptBlocks)
			fmt.Fprintln(tw, "PATH\tP50\tP99\tMEAN")
			for _, r := range rep.Rows {
				fmt.Fprintf(tw, "%s\t%v\t%v\t%v\n", r.Path, r.P50, r.P99, r.Mean)
			}
			return tw.Flush()
		},
	}
	f := cmd.Flags()
	f.IntVar(&cfg.Workers, "workers", 1000, "engines in the index")
	f.IntVar(&cfg.PromptsPerWorker, "prompts-per-worker", 8, "prompts each engine holds")
	f.IntVar(&cfg.PromptBlocks, "prompt-blocks", 64, "blocks of each stored prompt")
	f.IntVar(&cfg.SharedBlocks, "shared-blocks", 16, "leading blocks shared by the engines of a group of 8")
	f.IntVar(&cfg.Queries, "queries", 5000, "queries timed per path")
	f.IntVar(&cfg.BlockSize, "block-size", 16, "tokens per KV block")
	f.Uint64Var(&cfg.Seed, "seed", 1, "seed of the prompts")
	f.BoolVar(&asJSON, "json", false, "print the report as JSON")
	return cmd
}

type benchIndexerRow struct {
	Path           string
	P50, P99, Mean time.Duration
}

type benchIndexerReport struct {
	Pairs uint64
	Rows  []benchIndexerRow
}

// oneGroup serves a single index.
type oneGroup struct{ g indexerapi.RouterGroup }

func (b oneGroup) Register(indexerapi.Registration) error { return indexerapi.ErrForbidden }
func (b oneGroup) Unregister(uint64, string, *string, *uint32) error {
	return indexerapi.ErrForbidden
}
func (b oneGroup) Workers(string, string) []indexerapi.WorkerView { return nil }
func (b oneGroup) Group(k indexerapi.GroupKey) (indexerapi.Group, error) {
	if k.Model != "bench" {
		return nil, indexerapi.ErrNotFound
	}
	return b.g, nil
}
func (b oneGroup) Groups() []indexerapi.GroupKey {
	return []indexerapi.GroupKey{{Model: "bench", Group: indexerapi.DefaultRoutingGroup}}
}

func benchIndexer(ctx context.Context, cfg benchIndexerConfig) (benchIndexerReport, error) {
	if cfg.Workers <= 0 || cfg.PromptBlocks <= 0 || cfg.Queries <= 0 || cfg.BlockSize <= 0 || cfg.PromptsPerWorker <= 0 {
		return benchIndexerReport{}, fmt.Errorf("--workers, --prompt-blocks, --prompts-per-worker, --queries and --block-size must be positive")
	}
	cfg.SharedBlocks = min(max(cfg.SharedBlocks, 0), cfg.PromptBlocks)
	rcfg := router.DefaultConfig()
	rcfg.BlockSize = cfg.BlockSize
	rcfg.PredictedTTL, rcfg.KVEventsGrace = 0, 0
	local, err := router.New(rcfg)
	if err != nil {
		return benchIndexerReport{}, err
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 7))
	tokens := func(n int) []uint32 {
		t := make([]uint32, n)
		for i := range t {
			t[i] = rng.Uint32N(100000)
		}
		return t
	}
	h := blockhash.New(cfg.BlockSize, "")
	var prompts [][]uint32
	id := uint64(0)
	for w := range cfg.Workers {
		local.AddWorker(router.WorkerInfo{ID: uint64(w + 1), Model: "bench"})
	}
	groupPrefix := map[int][]uint32{}
	for w := range cfg.Workers {
		for range cfg.PromptsPerWorker {
			shared, ok := groupPrefix[w/8]
			if !ok {
				shared = tokens(cfg.SharedBlocks * cfg.BlockSize)
				groupPrefix[w/8] = shared
			}
			p := append(slices.Clone(shared), tokens((cfg.PromptBlocks-cfg.SharedBlocks)*cfg.BlockSize)...)
			prompts = append(prompts, p)
			lh := h.LocalHashes(p)
			blocks := make([]kv.Block, len(lh))
			for i, l := range lh {
				id++
				blocks[i] = kv.Block{EngineHash: id, LocalHash: l}
			}
			ev := kv.StoredEvent(kv.Worker{ID: uint64(w + 1)}, id, nil, blocks...)
			if err := local.ApplyEvent(&ev); err != nil {
				return benchIndexerReport{}, err
			}
		}
	}
	api := indexerapi.New(indexerapi.Config{Backend: oneGroup{indexerapi.RouterGroup{Router: local}}})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return benchIndexerReport{}, err
	}
	srv := &http.Server{Handler: api.Handler()}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	base := "http://" + ln.Addr().String()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}

	remote, err := indexerapi.NewRemote(indexerapi.RemoteConfig{URL: base, BlockSize: cfg.BlockSize, Client: client, Timeout: time.Second})
	if err != nil {
		return benchIndexerReport{}, err
	}
	rcfg.Remote = remote
	viaRemote, err := router.New(rcfg)
	if err != nil {
		return benchIndexerReport{}, err
	}
	for w := range cfg.Workers {
		viaRemote.AddWorker(router.WorkerInfo{ID: uint64(w + 1), Model: "bench"})
	}
	queries := make([][]uint32, cfg.Queries)
	for i := range queries {
		queries[i] = append(slices.Clone(prompts[rng.IntN(len(prompts))]), tokens(cfg.PromptBlocks*cfg.BlockSize)...)
	}
	post := func(path, ctype string, body []byte) error {
		resp, err := client.Post(base+path, ctype, bytes.NewReader(body))
		if err != nil {
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("POST %s: %s", path, resp.Status)
		}
		return nil
	}
	paths := []struct {
		name string
		run  func(q []uint32) error
	}{
		{"query_by_hash", func(q []uint32) error {
			lh := h.LocalHashes(q)
			b, _ := msgpack.Marshal(map[string]any{"block_hashes": lh, "model_name": "bench"})
			return post("/query_by_hash", "application/msgpack", b)
		}},
		{"query", func(q []uint32) error {
			b, _ := json.Marshal(map[string]any{"token_ids": q, "model_name": "bench"})
			return post("/query", "application/json", b)
		}},
		{"local", func(q []uint32) error {
			_, err := local.BestWorker(ctx, &router.Request{Tokens: q, Model: "bench"})
			return err
		}},
		{"remote", func(q []uint32) error {
			_, err := viaRemote.BestWorker(ctx, &router.Request{Tokens: q, Model: "bench"})
			return err
		}},
	}
	rep := benchIndexerReport{Pairs: uint64(cfg.Workers * cfg.PromptsPerWorker * cfg.PromptBlocks)}
	for _, p := range paths {
		for _, q := range queries[:min(len(queries), 200)] { // warm up
			if err := p.run(q); err != nil {
				return rep, err
			}
		}
		lat := make([]time.Duration, len(queries))
		for i, q := range queries {
			if ctx.Err() != nil {
				return rep, ctx.Err()
			}
			t0 := time.Now()
			if err := p.run(q); err != nil {
				return rep, err
			}
			lat[i] = time.Since(t0)
		}
		slices.Sort(lat)
		var sum time.Duration
		for _, l := range lat {
			sum += l
		}
		rep.Rows = append(rep.Rows, benchIndexerRow{Path: p.name, P50: lat[len(lat)/2], P99: lat[len(lat)*99/100], Mean: sum / time.Duration(len(lat))})
	}
	if st := viaRemote.RemoteStats(); st.Failed > 0 {
		return rep, fmt.Errorf("the remote indexer failed %d of %d queries", st.Failed, st.Answered+st.Failed)
	}
	return rep, nil
}
