package sim

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kvrouter/kvrouter/lab/plots"
	"github.com/kvrouter/kvrouter/lab/replay"
)

// WriteReport writes results.json, report.md and the plots (goodput.png,
// ttft_vs_load.png, itl_vs_load.png, hit_rate_vs_load.png, and
// goodput_vs_workers.png for a sweep over fleet sizes) into dir.
func WriteReport(dir string, res *Results) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := JSON(res)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "results.json"), b, 0o644); err != nil {
		return err
	}
	if err := writePlots(dir, res); err != nil {
		return err
	}
	return replay.WriteFile(filepath.Join(dir, "report.md"), func(w io.Writer) error { return Markdown(w, res) })
}

// JSON is results.json's content (what --json prints).
func JSON(res *Results) ([]byte, error) {
	b, err := json.MarshalIndent(res, "", "  ")
	return append(b, '\n'), err
}

// loadCurve is a mode's runs, tested points and bisection probes alike,
// by increasing load.
func loadCurve(m *ModeResult) []Point {
	ps := append(slices.Clone(m.Points), m.Probes...)
	slices.SortStableFunc(ps, func(a, b Point) int { return cmp.Compare(a.ArrivalSpeedup, b.ArrivalSpeedup) })
	return ps
}

// Markdown writes the goodput table and one table of points per mode.
func Markdown(w io.Writer, res *Results) error {
	c := res.Config
	bw := bufio.NewWriter(w)
	fmt.Fprintf(bw, "# kvrouter sim\n\n")
	if c.Command != "" {
		fmt.Fprintf(bw, "```sh\n%s\n```\n\n", c.Command)
	}
	engines := fmt.Sprintf("%d simulated engines", c.Workers)
	if d := c.Disagg; d != nil {
		engines = fmt.Sprintf("%d simulated engines (%d prefill, %d decode)", c.Workers, d.PrefillWorkers, d.DecodeWorkers)
	}
	if c.DPSize > 1 {
		engines += fmt.Sprintf(" of %d data-parallel ranks", c.DPSize)
	}
	fmt.Fprintf(bw, "%s: %d requests over %.0f s, on %s (%d KV blocks of %d tokens, %d batched tokens per step), KV events %.0f ms late, engine metrics every %.0f ms, seed %d. "+
		"Times are model time, in ms. Ceiling hit rate: %.3f with one infinite cache, %.3f with one LRU cache as large as the fleet's together. %.0f s of model time simulated in %.1f s.\n\n",
		c.Workload, c.Requests, c.SpanS, engines, c.NumGPUBlocks, c.BlockSize, c.MaxBatched, c.KVEventDelayMS, c.MetricsMS, c.Seed, c.CeilingHitRate, c.FleetCeilingHitRate, res.ModelS, res.WallS)
	if closedLoop(res) {
		fmt.Fprintf(bw, "The sessions are closed-loop: each run is measured in its steady state, between %.0f %% of the way through the sessions' starts and the last start "+
			"(`steady_window` in results.json). Its req/s are the requests that arrived in that window, its latencies and hit rate theirs.\n\n", SteadyWarmup*100)
	}
	slo := fmt.Sprintf("p90 TTFT ≤ %.0f ms", c.SLOTTFTP90MS)
	if c.SLOITLP90MS > 0 {
		slo += fmt.Sprintf(", p90 ITL ≤ %.0f ms", c.SLOITLP90MS)
	}
	fmt.Fprintf(bw, "## Goodput at %s\n\n", slo)
	rr := res.Modes["round-robin"]
	fmt.Fprintln(bw, "| mode | goodput (req/s) | arrival speedup | × round-robin |")
	fmt.Fprintln(bw, "|---|---|---|---|")
	for _, name := range res.Order {
		m := res.Modes[name]
		vsRR := "n/a"
		if rr != nil && rr.GoodputRPS > 0 {
			vsRR = fmt.Sprintf("%.2f×", m.GoodputRPS/rr.GoodputRPS)
		}
		bound := ""
		if m.GoodputBound != "" {
			bound = m.GoodputBound + " "
		}
		fmt.Fprintf(bw, "| %s | %s%.2f | %.3g | %s |\n", name, bound, m.GoodputRPS, m.GoodputArrivalSpeedup, vsRR)
	}
	if c.Fleet != "" {
		charge := "and charge held blocks at the largest engine's KV size"
		if c.KVBoundRPS > 0 {
			charge += " (the KV bound, below, at each engine's own)"
		}
		fmt.Fprintf(bw, "\nThe engines are unequal (`--fleet %s`: COUNTxSPEED[:KV]); the bounds count each engine by its speed %s.\n", c.Fleet, charge)
	}
	if c.PrefillBoundRPS > 0 {
		fmt.Fprintf(bw, "\nNo policy sustains more than %.1f req/s on %d engines: that rate saturates them with the prompt tokens one infinite cache would miss, "+
			"prefilled at the cheapest cost per token and nothing else to do (the prefill bound).\n", c.PrefillBoundRPS, c.Workers)
	}
	if c.EngineBoundRPS > 0 {
		fmt.Fprintf(bw, "\nNor more than %.1f req/s once decoding is charged too: a decode step's fixed cost for every `--max-num-seqs` tokens decoded, "+
			"and, in every step a request decodes in, the KV reads of the blocks it holds that no other decoding request can share (the engine bound; see docs/benchmarks.md).\n", c.EngineBoundRPS)
	}
	if c.KVBoundRPS > 0 && c.KVBoundRPS <= c.EngineBoundRPS {
		fmt.Fprintf(bw, "\nThe engines' caches differ: that bound charges each engine's blocks at its own KV size, "+
			"keeps each request's decode and private prompt on one engine, and counts at least one decode step for every cache's worth of held blocks (the KV bound, %.1f req/s).\n", c.KVBoundRPS)
	}
	if w := res.BurstWarning(); w != "" {
		fmt.Fprintf(bw, "\n**Warning:** %s\n", w)
	}
	if len(c.WorkerCounts) > 1 {
		fmt.Fprintf(bw, "\n## Goodput by fleet size (req/s at %s)\n\n", slo)
		fmt.Fprint(bw, "| mode |")
		for _, n := range c.WorkerCounts {
			fmt.Fprintf(bw, " %d workers |", n)
		}
		fmt.Fprint(bw, "\n|---|")
		for range c.WorkerCounts {
			fmt.Fprint(bw, "---|")
		}
		fmt.Fprintln(bw)
		for _, name := range res.Order {
			fmt.Fprintf(bw, "| %s |", name)
			for _, f := range res.Modes[name].ByWorkers {
				bound := ""
				if f.GoodputBound != "" {
					bound = "≥ "
				}
				fmt.Fprintf(bw, " %s%.2f |", bound, f.GoodputRPS)
			}
			fmt.Fprintln(bw)
		}
		fmt.Fprintf(bw, "\nThe tables below are the %d-worker fleet's; ![goodput vs fleet size](goodput_vs_workers.png)\n", c.Workers)
	}
	for _, name := range res.Order {
		fmt.Fprintf(bw, "\n## %s\n\n", name)
		fmt.Fprintln(bw, "| arrival speedup | req/s | errors | TTFT mean | p50 | p90 | p99 | ITL p50 | ITL p90 | E2E mean | E2E p90 | hit rate | of ceiling | phantom blocks | queued | preemptions | KV use mean / max | decoding / prefill tokens per step | prefill share | SLO |")
		fmt.Fprintln(bw, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
		for _, p := range loadCurve(res.Modes[name]) {
			of := 0.0
			if c.CeilingHitRate > 0 {
				of = p.HitRate / c.CeilingHitRate
			}
			fmt.Fprintf(bw, "| %.3g | %.2f | %d | %.0f | %.0f | %.0f | %.0f | %.1f | %.1f | %.0f | %.0f | %.3f | %.0f%% | %d | %d | %d | %.2f / %.2f | %.0f / %.0f | %.0f%% | %s |\n",
				p.ArrivalSpeedup, p.ArrivalRPS, p.Errors, p.TTFT.Mean, p.TTFT.P50, p.TTFT.P90, p.TTFT.P99, p.ITL.P50, p.ITL.P90,
				p.E2E.Mean, p.E2E.P90, p.HitRate, 100*of, p.PhantomBlocks, p.Queued, p.Preemptions,
				p.Engines.KVUsageMean, p.Engines.KVUsageMax, p.Engines.DecodeSeqsPerStep, p.Engines.PrefillTokensPerStep, 100*p.Engines.PrefillShare, yes(p.MeetsSLO))
		}
		if c.Disagg != nil {
			disaggTable(bw, c.Disagg, res.Modes[name])
		}
		if c.Replicas != nil {
			replicaTable(bw, c.Replicas, res.Modes[name])
		}
	}
	fmt.Fprintf(bw, "\nRows include the bisection's runs. Phantom blocks: blocks the router credited to the engine it chose that the engine did not reuse when it scheduled the request (aggregated fleets). Plots: ![goodput](goodput.png) ![TTFT vs load](ttft_vs_load.png) ![ITL vs load](itl_vs_load.png) ![hit rate vs load](hit_rate_vs_load.png)\n")
	return bw.Flush()
}

// replicaTable is how a mode's router replicas agreed with a single
// router, per load.
func replicaTable(w io.Writer, c *ReplicasConfig, m *ModeResult) {
	sync := "without replica sync"
	if c.Sync {
		sync = fmt.Sprintf("each told of the others' bookings %.0f ms late by the replica-sync messages", c.SyncDelayMS)
	}
	spread := map[Spread]string{
		SpreadRequest: "requests sent to them in turn",
		SpreadBurst:   "the requests of one instant sent to one of them, each instant's to the next in turn",
		SpreadSession: "each session's requests sent to one of them by a hash of the session",
	}[c.Spread]
	fmt.Fprintf(w, "\n%d router replicas, %s, %s. A decision is identical when a single router, "+
		"seeing the same engines at the same instant and every booking at once, rates the replica's choice cheapest (ties included).\n\n", c.Replicas, spread, sync)
	loadRows(w, "| arrival speedup | decisions | identical | sync messages | bytes | applied | refused |", m, func(p *Point) string {
		r := p.Replicas
		if r == nil {
			return ""
		}
		return fmt.Sprintf("| %.3g | %d | %.1f%% | %d | %d | %d | %d |", p.ArrivalSpeedup, r.Decisions, 100*r.IdenticalShare, r.Messages, r.Bytes, r.Applied, r.Refused)
	})
}

// loadRows writes a table: header, its rule, and the row that row makes
// of each of m's runs by increasing load ("" for none).
func loadRows(w io.Writer, header string, m *ModeResult, row func(p *Point) string) {
	fmt.Fprintln(w, header)
	fmt.Fprintln(w, "|"+strings.Repeat("---|", strings.Count(header, "|")-1))
	for _, p := range loadCurve(m) {
		if r := row(&p); r != "" {
			fmt.Fprintln(w, r)
		}
	}
}

// disaggTable is a mode's disaggregation figures per load.
func disaggTable(w io.Writer, c *DisaggConfig, m *ModeResult) {
	cond := "always remote"
	if c.MinUncachedTokens > 0 {
		cond = fmt.Sprintf("local below %d uncached tokens", c.MinUncachedTokens)
	}
	decode := "transfer-aware"
	if c.NoAssumeKVReuse {
		decode = "Dynamo's (no reuse, no credit)"
	}
	fmt.Fprintf(w, "\nDisaggregation (%s; decode routing %s; KV %d B/token over %.3g GB/s). Transfers are per remote prefill; "+
		"prefill TTFT is arrival to the prefill engine's token, TTFT arrival to the decode engine's first.\n\n", cond, decode, c.KVBytesPerToken, c.KVTransferBandwidth/1e9)
	loadRows(w, "| arrival speedup | remote | local: short / busy / none / error / timeout | pulled blocks | pulled MB | cached on decode | transfer mean / p90 | prefill TTFT mean / p90 | remote TTFT mean / p90 | local TTFT mean / p90 |", m, func(p *Point) string {
		d := p.Disagg
		if d == nil {
			return ""
		}
		l := d.LocalPrefills
		return fmt.Sprintf("| %.3g | %d | %d / %d / %d / %d / %d | %.1f | %.1f | %.1f | %.1f / %.1f | %.0f / %.0f | %.0f / %.0f | %.0f / %.0f |",
			p.ArrivalSpeedup, d.RemotePrefills, l.ShortUncached, l.PrefillBusy, l.NoPrefillWorker, l.PrefillError, l.PrefillTimeout,
			d.TransferredBlocks, d.TransferredBytes/1e6, d.CachedOnDecodeBlocks, d.TransferMS.Mean, d.TransferMS.P90,
			d.PrefillTTFT.Mean, d.PrefillTTFT.P90, d.RemoteTTFT.Mean, d.RemoteTTFT.P90, d.LocalTTFT.Mean, d.LocalTTFT.P90)
	})
}

func writePlots(dir string, res *Results) error {
	series := func(get func(*Point) float64) []plots.Series {
		var out []plots.Series
		for _, name := range res.Order {
			s := plots.Series{Name: name}
			for _, p := range loadCurve(res.Modes[name]) {
				s.X = append(s.X, p.ArrivalRPS)
				s.Y = append(s.Y, get(&p))
			}
			out = append(out, s)
		}
		return out
	}
	const x = "arrival rate (req/s, model time)"
	ttft := []plots.Panel{
		{Title: "p50", XLabel: x, YLabel: "TTFT (ms)", Series: series(func(p *Point) float64 { return p.TTFT.P50 })},
		{Title: "p90", XLabel: x, YLabel: "TTFT (ms)", Series: series(func(p *Point) float64 { return p.TTFT.P90 })},
	}
	if err := plots.Grid(filepath.Join(dir, "ttft_vs_load.png"), "Time to first token vs load", 2, ttft); err != nil {
		return err
	}
	itl := []plots.Panel{
		{Title: "p50", XLabel: x, YLabel: "ITL (ms)", Series: series(func(p *Point) float64 { return p.ITL.P50 })},
		{Title: "p90", XLabel: x, YLabel: "ITL (ms)", Series: series(func(p *Point) float64 { return p.ITL.P90 })},
	}
	if err := plots.Grid(filepath.Join(dir, "itl_vs_load.png"), "Inter-token latency vs load", 2, itl); err != nil {
		return err
	}
	var names []string
	var goodput []float64
	for _, name := range res.Order {
		names = append(names, name)
		goodput = append(goodput, res.Modes[name].GoodputRPS)
	}
	if err := plots.Bars(filepath.Join(dir, "goodput.png"), fmt.Sprintf("Goodput at p90 TTFT ≤ %.0f ms (req/s, model time)", res.Config.SLOTTFTP90MS),
		"req/s", names, goodput); err != nil {
		return err
	}
	if len(res.Config.WorkerCounts) > 1 {
		var fleets []plots.Series
		for _, name := range res.Order {
			s := plots.Series{Name: name}
			for _, f := range res.Modes[name].ByWorkers {
				s.X = append(s.X, float64(f.Workers))
				s.Y = append(s.Y, f.GoodputRPS)
			}
			fleets = append(fleets, s)
		}
		if err := plots.Lines(filepath.Join(dir, "goodput_vs_workers.png"), plots.Panel{
			Title: "Goodput vs fleet size", XLabel: "engines", YLabel: "goodput (req/s, model time)", Series: fleets,
		}); err != nil {
			return err
		}
	}
	zero, one := 0.0, 1.0
	return plots.Lines(filepath.Join(dir, "hit_rate_vs_load.png"), plots.Panel{
		Title: "Prefix-cache hit rate vs load (engines' count)", XLabel: x, YLabel: "cached / prompt tokens", YMin: &zero, YMax: &one,
		Series: series(func(p *Point) float64 { return p.HitRate }),
	})
}

// closedLoop reports whether res's runs were measured in a steady window.
func closedLoop(res *Results) bool {
	for _, m := range res.Modes {
		for _, p := range m.Points {
			if p.Steady != nil {
				return true
			}
		}
	}
	return false
}

// AboveEngineBound names the modes whose goodput exceeds the engine bound,
// in res.Order. No sustained rate can: their runs ended before the
// engines reached a steady state (the workload arrived as one burst, its
// requests still decoding when the last arrived), and the goodputs
// describe that burst, not a rate the fleet carries.
func (res *Results) AboveEngineBound() []string {
	bound := res.Config.EngineBoundRPS
	if bound <= 0 {
		return nil
	}
	var above []string
	for _, name := range res.Order {
		if res.Modes[name].GoodputRPS > bound {
			above = append(above, name)
		}
	}
	return above
}

// BurstWarning says what AboveEngineBound's modes mean for the reader, or
// "" when there are none.
func (res *Results) BurstWarning() string {
	above := res.AboveEngineBound()
	if len(above) == 0 {
		return ""
	}
	return fmt.Sprintf("the goodput of %s exceeds the engine bound, which no sustained rate can: the runs ended before the engines reached a steady state. "+
		"Simulate more requests (--synthetic-requests, --agentic-requests, --max-requests) for a capacity.", strings.Join(above, ", "))
}
