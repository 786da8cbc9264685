package replay

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kvrouter/kvrouter/lab/plots"
)

// WriteReport writes results.json, report.md, the plots (ttft_cdf.png,
// worker_load.png, hit_rate.png) and every request's record
// (requests/<mode>.jsonl) into dir.
func WriteReport(dir string, res *Results) error {
	if err := os.MkdirAll(filepath.Join(dir, "requests"), 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "results.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	for _, mode := range res.Order {
		if err := writeRecords(filepath.Join(dir, "requests", mode+".jsonl"), res.records[mode]); err != nil {
			return err
		}
	}
	if err := writePlots(dir, res); err != nil {
		return err
	}
	return WriteFile(filepath.Join(dir, "report.md"), func(w io.Writer) error { return Markdown(w, res) })
}

// WriteFile creates path and writes it with write, closing it either way.
func WriteFile(path string, write func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func writeRecords(path string, recs []Record) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	enc := json.NewEncoder(w)
	for i := range recs {
		if err := enc.Encode(&recs[i]); err != nil {
			f.Close()
			return err
		}
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Markdown writes the comparison table and how kv compares with each
// other mode.
func Markdown(w io.Writer, res *Results) error {
	c := res.Config
	bw := bufio.NewWriter(w)
	fmt.Fprintf(bw, "# kvrouter bench replay\n\n")
	if c.Command != "" {
		fmt.Fprintf(bw, "```sh\n%s\n```\n\n", c.Command)
	}
	fmt.Fprintf(bw, "%s: %d requests", c.Workload, c.Requests)
	if c.Target != "" {
		fmt.Fprintf(bw, " against %s (model %s).", c.Target, c.Model)
	} else {
		fmt.Fprintf(bw, " on %d simulated engines (%d KV blocks of %d tokens, %d batched tokens per step), engine speedup %g, arrival speedup %g, seed %d.",
			c.Workers, c.NumGPUBlocks, c.BlockSize, c.MaxBatched, c.Speedup, c.ArrivalSpeedup, c.Seed)
	}
	fmt.Fprintf(bw, " Times are model time (wall × speedup), in ms. Ceiling hit rate (one infinite cache): %.3f. Wall time %.0f s.\n\n", c.CeilingHitRate, c.WallSeconds)
	fmt.Fprintln(bw, "| mode | requests | errors | TTFT mean | p50 | p90 | p99 | ITL p50 | ITL p99 | E2E mean | E2E p90 | output tok/s | hit rate | of ceiling | busiest worker share | peak in flight |")
	fmt.Fprintln(bw, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, name := range res.Order {
		m := res.Modes[name]
		share, peak := 0.0, 0
		for w, s := range m.WorkerShare {
			share = max(share, s)
			peak = max(peak, m.PeakActive[w])
		}
		ofCeiling := 0.0
		if m.CeilingHitRate > 0 {
			ofCeiling = m.PrefixHitRate / m.CeilingHitRate
		}
		fmt.Fprintf(bw, "| %s | %d | %d | %.0f | %.0f | %.0f | %.0f | %.1f | %.1f | %.0f | %.0f | %.0f | %.3f | %.0f%% | %.3f | %d |\n",
			name, m.Requests, m.Errors, m.TTFT.Mean, m.TTFT.P50, m.TTFT.P90, m.TTFT.P99, m.ITL.P50, m.ITL.P99,
			m.E2E.Mean, m.E2E.P90, m.OutputTokensPerS, m.PrefixHitRate, 100*ofCeiling, share, peak)
	}
	for _, name := range res.Order {
		if m := res.Modes[name]; m.Sessions > 0 {
			fmt.Fprintf(bw, "\n%s: %d of %d sessions had turns on more than one engine.\n", name, m.SplitSessions, m.Sessions)
		}
	}
	for _, name := range res.Order {
		if m := res.Modes[name]; m.EngineDrift > DriftWarning {
			fmt.Fprintf(bw, "\n**Warning:** in %s the engines ran %.1f %% slower than the timing model (%d times more than 50 ms behind): the machine did not keep up with speedup %g, and the latencies above are too long. Rerun at a lower --speedup.\n",
				name, 100*m.EngineDrift, m.EngineLagResets, c.Speedup)
		}
	}
	disaggTable(bw, res)
	if kv := res.Modes["kv"]; kv != nil && len(res.Order) > 1 {
		fmt.Fprintf(bw, "\nkv against each other mode (negative = kv lower, better):\n\n")
		fmt.Fprintln(bw, "| mode | TTFT mean | TTFT p90 | TTFT p99 | E2E mean |")
		fmt.Fprintln(bw, "|---|---|---|---|---|")
		for _, name := range res.Order {
			if name == "kv" {
				continue
			}
			m := res.Modes[name]
			fmt.Fprintf(bw, "| %s | %s | %s | %s | %s |\n", name, rel(kv.TTFT.Mean, m.TTFT.Mean), rel(kv.TTFT.P90, m.TTFT.P90), rel(kv.TTFT.P99, m.TTFT.P99), rel(kv.E2E.Mean, m.E2E.Mean))
		}
	}
	fmt.Fprintf(bw, "\nPlots: ![TTFT CDF](ttft_cdf.png) ![in-flight requests per worker](worker_load.png) ![prefix-cache hit rate](hit_rate.png)\n")
	return bw.Flush()
}

// disaggTable shows what the disaggregated setups moved between pools.
func disaggTable(w io.Writer, res *Results) {
	var rows []string
	for _, name := range res.Order {
		d := res.Modes[name].Disagg
		if d == nil {
			continue
		}
		local, reasons := 0, []string{}
		for _, k := range slices.Sorted(maps.Keys(d.Prefills)) {
			if k != "remote" && d.Prefills[k] > 0 {
				local += d.Prefills[k]
				reasons = append(reasons, fmt.Sprintf("%s %d", k, d.Prefills[k]))
			}
		}
		why := strings.Join(reasons, ", ")
		if why == "" {
			why = "none"
		}
		rows = append(rows, fmt.Sprintf("| %s | %d + %d | %d | %d (%s) | %.1f | %.2f | %.3f |",
			name, d.PrefillWorkers, d.DecodeWorkers, d.Prefills["remote"], local, why,
			d.TransferredBlocksPerRequest, d.TransferredBytes/1e9, d.PrefillHitRate))
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintf(w, "\nDisaggregated setups (hit rate above: the hits that spared prefill work, on the prefill engines and on the decode engines' own prefills; blocks and bytes: what decode engines pulled, as the engines counted them):\n\n")
	fmt.Fprintln(w, "| setup | prefill + decode engines | remote prefills | local prefills (why) | blocks pulled per request | GB pulled | prefill hit rate |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|")
	for _, r := range rows {
		fmt.Fprintln(w, r)
	}
}

// DriftWarning is the engines' lag behind the timing model beyond which a
// replay's latencies are not the model's: a step's timer fires a few
// hundred microseconds late at most, far below it.
const DriftWarning = 0.02

func rel(kv, other float64) string {
	if other == 0 {
		return "n/a"
	}
	return fmt.Sprintf("%+.0f%% (%.2f×)", 100*(kv-other)/other, kv/other)
}

const timeBuckets = 120

func writePlots(dir string, res *Results) error {
	ttft := map[string][]float64{}
	for _, mode := range res.Order {
		for _, r := range res.records[mode] {
			if r.Err == "" {
				ttft[mode] = append(ttft[mode], r.TTFTMS)
			}
		}
	}
	if err := plots.CDF(filepath.Join(dir, "ttft_cdf.png"), "Time to first token", "TTFT (ms, model time, log scale)", res.Order, ttft, true); err != nil {
		return err
	}
	var panels []plots.Panel
	for _, mode := range res.Order {
		panels = append(panels, plots.Panel{Title: mode, XLabel: "time (s)", YLabel: "requests in flight", Series: inFlight(res.records[mode])})
	}
	cols := min(3, len(panels))
	if err := plots.Grid(filepath.Join(dir, "worker_load.png"), "Requests in flight per worker", cols, panels); err != nil {
		return err
	}
	one := 1.0
	zero := 0.0
	hit := plots.Panel{Title: "Prefix-cache hit rate (engines' report, per window of arrivals)", XLabel: "time (s)", YLabel: "cached / prompt tokens", YMin: &zero, YMax: &one}
	for _, mode := range res.Order {
		hit.Series = append(hit.Series, hitRate(mode, res.records[mode]))
	}
	return plots.Lines(filepath.Join(dir, "hit_rate.png"), hit)
}

// inFlight samples, per worker, the requests in flight over time.
func inFlight(recs []Record) []plots.Series {
	var end float64
	workers := map[string]bool{}
	for _, r := range recs {
		if r.Err == "" && r.Worker != "" {
			end = max(end, r.SentMS+r.E2EMS)
			workers[r.Worker] = true
		}
	}
	names := make([]string, 0, len(workers))
	for w := range workers {
		names = append(names, w)
	}
	slices.Sort(names)
	if end == 0 {
		return nil
	}
	step := end / timeBuckets
	var out []plots.Series
	for _, w := range names {
		counts := make([]float64, timeBuckets+1)
		for _, r := range recs {
			if r.Err != "" || r.Worker != w {
				continue
			}
			// Count the request in every sample point it spans.
			lo := int(math.Ceil(r.SentMS / step))
			hi := int((r.SentMS + r.E2EMS) / step)
			for i := max(lo, 0); i <= min(hi, timeBuckets); i++ {
				counts[i]++
			}
		}
		s := plots.Series{Name: w}
		for i, c := range counts {
			s.X = append(s.X, float64(i)*step/1000)
			s.Y = append(s.Y, c)
		}
		out = append(out, s)
	}
	return out
}

// hitRate is the engines' prefix-cache hit rate per window of arrival time.
func hitRate(mode string, recs []Record) plots.Series {
	var end float64
	for _, r := range recs {
		end = max(end, r.SentMS)
	}
	const windows = 40
	step := max(end/windows, 1)
	cached := make([]float64, windows+1)
	prompt := make([]float64, windows+1)
	for _, r := range recs {
		if r.Err != "" {
			continue
		}
		i := min(int(r.SentMS/step), windows)
		cached[i] += float64(r.CachedTokens)
		prompt[i] += float64(r.PromptTokens)
	}
	s := plots.Series{Name: mode}
	for i := range cached {
		if prompt[i] > 0 {
			s.X = append(s.X, (float64(i)+0.5)*step/1000)
			s.Y = append(s.Y, cached[i]/prompt[i])
		}
	}
	return s
}

// Summary is a one-line-per-mode text table for the terminal.
func Summary(res *Results) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-20s %8s %6s %10s %10s %10s %10s %9s %9s\n", "mode", "requests", "errors", "TTFT mean", "TTFT p50", "TTFT p90", "TTFT p99", "hit rate", "of ceil.")
	for _, name := range res.Order {
		m := res.Modes[name]
		of := 0.0
		if m.CeilingHitRate > 0 {
			of = m.PrefixHitRate / m.CeilingHitRate
		}
		fmt.Fprintf(&b, "%-20s %8d %6d %10.0f %10.0f %10.0f %10.0f %9.3f %8.0f%%\n", name, m.Requests, m.Errors, m.TTFT.Mean, m.TTFT.P50, m.TTFT.P90, m.TTFT.P99, m.PrefixHitRate, 100*of)
	}
	return b.String()
}
