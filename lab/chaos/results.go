package chaos

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/kvrouter/kvrouter/lab/plots"
)

// Results is a chaos run's outcome, as written to results.json.
type Results struct {
	Config struct {
		Command         string   `json:"command,omitempty"`
		Plane           string   `json:"plane"`
		DurationSeconds float64  `json:"duration_s"`
		Clients         int      `json:"clients"`
		Engines         int      `json:"engines"`
		Faults          []string `json:"faults"`
		PauseSeconds    float64  `json:"pause_s"`
		GraceSeconds    float64  `json:"grace_s"`
		RouterArgs      []string `json:"router_args,omitempty"`
		Seed            uint64   `json:"seed"`
	} `json:"config"`
	Requests struct {
		OK      int64          `json:"ok"`
		Errors  int64          `json:"errors"`
		ByClass map[string]int `json:"errors_by_class"`
	} `json:"requests"`
	Faults      []Fault        `json:"faults"`
	FaultTable  []FaultSummary `json:"fault_table"`
	Unexplained []Outcome      `json:"unexplained_errors"`
	End         EndState       `json:"end_state"`
	RSS         RSSSummary     `json:"rss"`
	Failures    []string       `json:"failures"` // every failed check; empty = pass
	Pass        bool           `json:"pass"`

	TrafficEndSeconds float64     `json:"traffic_end_s"`
	OKPerSecond       []int       `json:"ok_per_second"`
	ErrorsPerSecond   []int       `json:"errors_per_second"`
	RSSSamples        []RSSSample `json:"rss_samples"`
	Errors            []Outcome   `json:"errors"`
}

// FaultSummary is one row of the table of faults survived.
type FaultSummary struct {
	Kind            FaultKind `json:"kind"`
	Count           int       `json:"count"`
	ClientErrors    int       `json:"client_errors"`
	RecoveryMeanSec float64   `json:"recovery_mean_s"`
	RecoveryMaxSec  float64   `json:"recovery_max_s"`
	NotRecovered    int       `json:"not_recovered"`
}

// RSSSummary describes the router's memory over the run.
type RSSSummary struct {
	IdleMB float64 `json:"idle_mb"` // before traffic
	PeakMB float64 `json:"peak_mb"`
	EndMB  float64 `json:"end_mb"` // after the quiet period
	// SlopeMBPerMin is the least-squares trend over the second half of the
	// traffic, within the last router process (a restart resets memory)
	// once it has warmed up.
	SlopeMBPerMin float64 `json:"slope_mb_per_min"`
	WindowSeconds float64 `json:"window_s"`
	// Flat is false only for growth beyond flatTolerance over a window of
	// at least a minute.
	Flat bool `json:"flat"`
}

// flatTolerance is the growth over the slope window, as a fraction of the
// mean RSS there, beyond which memory counts as growing: the Go heap
// breathes with the garbage collector by a few percent under steady load.
const flatTolerance = 0.10

// rssWarmup (seconds) is left out of the trend after a router starts: its
// index and heap fill up to the working set first.
const rssWarmup = 30

// minSlopeWindow (seconds) is the shortest window whose trend is judged.
const minSlopeWindow = 60

func summariseRSS(samples []RSSSample, trafficEnd float64) RSSSummary {
	var s RSSSummary
	if len(samples) == 0 {
		return s
	}
	s.IdleMB, s.EndMB = samples[0].MB, samples[len(samples)-1].MB
	last := samples[len(samples)-1].Incarnation
	born := math.Inf(1) // the last process's first sample
	for _, p := range samples {
		if p.Incarnation == last {
			born = min(born, p.T)
		}
	}
	var xs, ys []float64 // minutes, MB
	var from, to float64
	for _, p := range samples {
		s.PeakMB = max(s.PeakMB, p.MB)
		if p.T >= max(trafficEnd/2, born+rssWarmup) && p.T <= trafficEnd && p.Incarnation == last {
			if len(xs) == 0 {
				from = p.T
			}
			to = p.T
			xs, ys = append(xs, p.T/60), append(ys, p.MB)
		}
	}
	s.WindowSeconds = to - from
	if len(xs) < 2 || s.WindowSeconds < minSlopeWindow {
		s.Flat = true // too short a window to tell a trend from GC noise
		return s
	}
	var mx, my float64
	for i := range xs {
		mx, my = mx+xs[i], my+ys[i]
	}
	mx, my = mx/float64(len(xs)), my/float64(len(xs))
	var sxy, sxx float64
	for i := range xs {
		sxy += (xs[i] - mx) * (ys[i] - my)
		sxx += (xs[i] - mx) * (xs[i] - mx)
	}
	if sxx > 0 {
		s.SlopeMBPerMin = sxy / sxx
	}
	s.Flat = s.SlopeMBPerMin*s.WindowSeconds/60 <= flatTolerance*my
	return s
}

func (r *run) results(tr *traffic, end EndState, trafficEnd float64) *Results {
	res := &Results{End: end, TrafficEndSeconds: trafficEnd}
	c := &res.Config
	c.Plane, c.DurationSeconds, c.Clients, c.Engines = r.cfg.Plane, r.cfg.Duration.Seconds(), r.cfg.Clients, r.cfg.Engines
	for _, k := range r.cfg.Faults {
		c.Faults = append(c.Faults, string(k))
	}
	c.PauseSeconds, c.GraceSeconds, c.RouterArgs, c.Seed = r.cfg.Pause.Seconds(), r.cfg.Grace.Seconds(), r.cfg.RouterArgs, r.cfg.Seed

	tr.mu.Lock()
	res.Errors = slices.Clone(tr.errors)
	res.OKPerSecond, res.ErrorsPerSecond = slices.Clone(tr.okPerSec), slices.Clone(tr.errPerSec)
	tr.mu.Unlock()
	res.Requests.OK, res.Requests.Errors = tr.ok.Load(), tr.failed.Load()
	res.Requests.ByClass = map[string]int{}
	for _, e := range res.Errors {
		res.Requests.ByClass[e.Class]++
	}
	r.mu.Lock()
	res.Faults, res.RSSSamples, res.Failures = slices.Clone(r.faults), slices.Clone(r.rss), slices.Clone(r.failures)
	r.mu.Unlock()
	res.Unexplained = Account(res.Errors, res.Faults)
	res.FaultTable = faultTable(r.cfg.Faults, res.Faults)
	res.RSS = summariseRSS(res.RSSSamples, trafficEnd)

	if n := len(res.Unexplained); n > 0 {
		res.Failures = append(res.Failures, fmt.Sprintf("%d client error(s) no fault explains", n))
	}
	if !end.LoadsZero {
		res.Failures = append(res.Failures, "the router's active loads are not back to zero")
	}
	if !end.IndexEqual {
		res.Failures = append(res.Failures, "the router's index differs from the engines' caches")
	}
	if end.Err != "" {
		res.Failures = append(res.Failures, "end checks: "+end.Err)
	}
	if !res.RSS.Flat {
		res.Failures = append(res.Failures, fmt.Sprintf("router RSS grows: %.1f MB/min over the second half", res.RSS.SlopeMBPerMin))
	}
	res.Pass = len(res.Failures) == 0
	if res.Failures == nil {
		res.Failures = []string{}
	}
	return res
}

func faultTable(kinds []FaultKind, faults []Fault) []FaultSummary {
	var out []FaultSummary
	for _, k := range kinds {
		row := FaultSummary{Kind: k}
		for i := range faults {
			f := &faults[i]
			if f.Kind != k {
				continue
			}
			row.Count++
			row.ClientErrors += f.Errors
			if f.Err != "" {
				row.NotRecovered++
			}
			row.RecoveryMeanSec += f.RecoverySeconds()
			row.RecoveryMaxSec = max(row.RecoveryMaxSec, f.RecoverySeconds())
		}
		if row.Count > 0 {
			row.RecoveryMeanSec /= float64(row.Count)
		}
		out = append(out, row)
	}
	return out
}

// Summary renders the tables of faults survived, of the end state and of
// the run as text.
func Summary(res *Results) string {
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "FAULT\tCOUNT\tCLIENT ERRORS\tRECOVERY MEAN\tRECOVERY MAX\tNOT RECOVERED")
	for _, f := range res.FaultTable {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f s\t%.1f s\t%d\n", f.Kind, f.Count, f.ClientErrors, f.RecoveryMeanSec, f.RecoveryMaxSec, f.NotRecovered)
	}
	tw.Flush()
	b.WriteString("\n")
	tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ENGINE\tROUTER BLOCKS\tENGINE BLOCKS\tMISSING\tEXTRA\tUNDER AN INFERRED ID")
	for _, e := range res.End.Index {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\n", e.Engine, e.RouterBlocks, e.EngineBlocks, e.Missing, e.Extra, e.Unnamed)
	}
	tw.Flush()
	b.WriteString("\n")
	tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	total := res.Requests.OK + res.Requests.Errors
	fmt.Fprintf(tw, "requests\t%d ok, %d errors (%.3f%%)\n", res.Requests.OK, res.Requests.Errors, 100*float64(res.Requests.Errors)/math.Max(1, float64(total)))
	fmt.Fprintf(tw, "errors by class\t%s\n", byClass(res.Requests.ByClass))
	fmt.Fprintf(tw, "unexplained errors\t%d\n", len(res.Unexplained))
	fmt.Fprintf(tw, "loads back to zero\t%v\n", res.End.LoadsZero)
	fmt.Fprintf(tw, "index equals engines\t%v (settled %.1f s after the quiet period)\n", res.End.IndexEqual, res.End.SettledAfter)
	fmt.Fprintf(tw, "router RSS\tidle %.0f MB, peak %.0f MB, end %.0f MB, slope %+.2f MB/min over %.0f s (flat: %v)\n",
		res.RSS.IdleMB, res.RSS.PeakMB, res.RSS.EndMB, res.RSS.SlopeMBPerMin, res.RSS.WindowSeconds, res.RSS.Flat)
	verdict := "PASS"
	if !res.Pass {
		verdict = "FAIL: " + strings.Join(res.Failures, "; ")
	}
	fmt.Fprintf(tw, "verdict\t%s\n", verdict)
	tw.Flush()
	for i, e := range res.Unexplained {
		if i == 10 {
			fmt.Fprintf(&b, "... %d more in results.json\n", len(res.Unexplained)-10)
			break
		}
		fmt.Fprintf(&b, "unexplained: %.1f–%.1f s %s: %s\n", e.Start, e.End, e.Class, e.Detail)
	}
	return b.String()
}

func byClass(m map[string]int) string {
	if len(m) == 0 {
		return "none"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	return strings.Join(parts, ", ")
}

// WriteReport writes DIR/results.json, DIR/report.md and DIR/chaos.png.
func WriteReport(dir string, res *Results) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	js, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "results.json"), js, 0o644); err != nil {
		return err
	}
	var md strings.Builder
	fmt.Fprintf(&md, "# kvrouter bench chaos\n\n")
	if res.Config.Command != "" {
		fmt.Fprintf(&md, "`%s`\n\n", res.Config.Command)
	}
	fmt.Fprintf(&md, "Plane %s, %d engines, %d streaming clients, %.0f s of traffic; faults %s (pause %.0f s, grace %.0f s).\n\n",
		res.Config.Plane, res.Config.Engines, res.Config.Clients, res.Config.DurationSeconds, strings.Join(res.Config.Faults, ", "), res.Config.PauseSeconds, res.Config.GraceSeconds)
	md.WriteString("## Faults survived\n\n| fault | count | client errors in its windows | recovery mean | recovery max | not recovered |\n|---|---|---|---|---|---|\n")
	for _, f := range res.FaultTable {
		fmt.Fprintf(&md, "| %s | %d | %d | %.1f s | %.1f s | %d |\n", f.Kind, f.Count, f.ClientErrors, f.RecoveryMeanSec, f.RecoveryMaxSec, f.NotRecovered)
	}
	md.WriteString("\n## Summary\n\n```\n" + Summary(res) + "```\n\n![request rate, errors and router RSS](chaos.png)\n\n## Faults\n\n| at | fault | engine | restored | recovered | client errors | note |\n|---|---|---|---|---|---|---|\n")
	for _, f := range res.Faults {
		fmt.Fprintf(&md, "| %.1f s | %s | %s | %.1f s | %.1f s | %d | %s |\n", f.Injected, f.Kind, f.Engine, f.Restored, f.Recovered, f.Errors, f.Err)
	}
	if err := os.WriteFile(filepath.Join(dir, "report.md"), []byte(md.String()), 0o644); err != nil {
		return err
	}
	return plot(filepath.Join(dir, "chaos.png"), res)
}

// plot draws request rate, error rate and router RSS over time, each
// fault as a spike of its own series.
func plot(path string, res *Results) error {
	secs := func(n int) []float64 {
		xs := make([]float64, n)
		for i := range xs {
			xs[i] = float64(i)
		}
		return xs
	}
	ints := func(v []int) []float64 {
		out := make([]float64, len(v))
		for i, x := range v {
			out[i] = float64(x)
		}
		return out
	}
	okY, errY := ints(res.OKPerSecond), ints(res.ErrorsPerSecond)
	var rssX, rssY []float64
	for _, s := range res.RSSSamples {
		rssX, rssY = append(rssX, s.T), append(rssY, s.MB)
	}
	markers := func(top float64) []plots.Series {
		var out []plots.Series
		for _, k := range res.Config.Faults {
			s := plots.Series{Name: k}
			for _, f := range res.Faults {
				if string(f.Kind) == k {
					s.X = append(s.X, f.Injected, f.Injected, f.Injected)
					s.Y = append(s.Y, 0, top, 0)
				}
			}
			if len(s.X) > 0 {
				out = append(out, s)
			}
		}
		return out
	}
	peak := func(v []float64) float64 {
		m := 1.0
		for _, x := range v {
			m = max(m, x)
		}
		return m
	}
	panels := []plots.Panel{
		{Title: "completed requests per second", XLabel: "time (s)", YLabel: "requests/s",
			Series: append([]plots.Series{{Name: "ok", X: secs(len(okY)), Y: okY}}, markers(peak(okY))...)},
		{Title: "client errors per second", XLabel: "time (s)", YLabel: "errors/s",
			Series: append([]plots.Series{{Name: "errors", X: secs(len(errY)), Y: errY}}, markers(peak(errY))...)},
		{Title: "router RSS", XLabel: "time (s)", YLabel: "MB",
			Series: append([]plots.Series{{Name: "RSS", X: rssX, Y: rssY}}, markers(peak(rssY))...)},
	}
	return plots.Grid(path, "kvrouter bench chaos: faults as spikes", 1, panels)
}
