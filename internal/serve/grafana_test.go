package serve

import (
	"encoding/json"
	"io"
	"net/http"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

// promqlWords are the PromQL functions, aggregations and keywords the
// dashboard's queries may use: every other identifier outside braces is a
// metric name.
var promqlWords = map[string]bool{
	"sum": true, "avg": true, "max": true, "min": true, "count": true, "topk": true, "bottomk": true,
	"rate": true, "irate": true, "increase": true, "delta": true, "histogram_quantile": true,
	"clamp_min": true, "clamp_max": true, "by": true, "without": true, "on": true, "ignoring": true,
	"group_left": true, "group_right": true, "and": true, "or": true, "unless": true, "offset": true,
}

var (
	promqlStrip = regexp.MustCompile(`\{[^}]*\}|\[[^\]]*\]|"[^"]*"|\b(?:by|without|on|ignoring)\s*\([^)]*\)`)
	promqlIdent = regexp.MustCompile(`[A-Za-z_:][A-Za-z0-9_:]*`)
)

// metricNames extracts the metric names a PromQL expression reads.
func metricNames(expr string) []string {
	var out []string
	for _, id := range promqlIdent.FindAllString(promqlStrip.ReplaceAllString(expr, " "), -1) {
		if !promqlWords[id] {
			out = append(out, id)
		}
	}
	return out
}

func TestMetricNamesOfPromQL(t *testing.T) {
	got := metricNames(`histogram_quantile(0.9, sum by (le, phase) (rate(kvrouter_a_bucket{phase="total"}[$__rate_interval]))) / clamp_min(sum(kvrouter_b), 1)`)
	if strings.Join(got, ",") != "kvrouter_a_bucket,kvrouter_b" {
		t.Fatalf("got %v", got)
	}
}

// exported gathers the names a running router exports on /metrics, after
// traffic that observes every histogram the dashboard reads; histograms and
// summaries count with their _bucket, _sum and _count series.
func exported(t *testing.T) map[string]bool {
	t.Helper()
	s := startServer(t, spec(1, engineFleet(t)))
	body := `{"model": "kvrouter-mock", "prompt": "the dashboard's metrics are observed by this request and the one after it, which repeats it word for word so that its prompt blocks are cached on the engine and counted in the hit rate", "max_tokens": 6, "stream": true}`
	for range 2 {
		resp, err := http.Post(s.URL()+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	testwait.Until(t, 10*time.Second, "the engine's KV events", func() bool { return s.Router().Stats().Index.StoredEvents > 0 })
	resp, err := http.Get(s.URL() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for name, f := range fams {
		names[name] = true
		if f.GetType() == dto.MetricType_HISTOGRAM || f.GetType() == dto.MetricType_SUMMARY {
			names[name+"_sum"], names[name+"_count"] = true, true
			if f.GetType() == dto.MetricType_HISTOGRAM {
				names[name+"_bucket"] = true
			}
		}
	}
	return names
}

// Every query of the Grafana dashboard reads metrics the router exports:
// renaming or dropping a metric fails here, not on an operator's screen.
func TestGrafanaDashboardQueriesExportedMetrics(t *testing.T) {
	raw, err := os.ReadFile("../../deploy/grafana/kvrouter.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatal(err)
	}
	if len(dash.Panels) < 10 {
		t.Fatalf("the dashboard has %d panels", len(dash.Panels))
	}
	names := exported(t)
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			used := metricNames(tg.Expr)
			if len(used) == 0 {
				t.Errorf("panel %q: no metric in %q", p.Title, tg.Expr)
			}
			for _, n := range used {
				if !names[n] {
					t.Errorf("panel %q reads %s, which the router does not export (%s)", p.Title, n, tg.Expr)
				}
			}
		}
	}
}
