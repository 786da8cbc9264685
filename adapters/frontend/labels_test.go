package frontend

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

// A fleet serving every model, asked for 50,000 made-up ones (5,000 under
// the race detector), labels its metrics with a bounded set of models.
func TestMadeUpModelsDoNotGrowTheMetrics(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.fake(1, "", 1, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"x","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
	})
	h := e.fe.Handler()
	complete := func(model string) {
		t.Helper()
		body := fmt.Sprintf(`{"model":%q,"prompt":[1,2,3],"max_tokens":1}`, model)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("POST", "/v1/completions", strings.NewReader(body)))
		if rec.Code != 200 {
			t.Fatalf("model %s: %d %s", model, rec.Code, rec.Body)
		}
	}
	models := 50_000
	if raceDetector {
		models = 5_000
	}
	for i := range models {
		complete(fmt.Sprintf("m%d", i))
	}
	// The first models the engine served label their later requests; the
	// rest stay "other".
	complete("m0")
	complete("m40000")
	if e.counter("m0", "completions", "200") != 1 || e.counter(otherModel, "completions", "200") != float64(models+1) {
		t.Fatalf("m0 counted %v, other %v", e.counter("m0", "completions", "200"), e.counter(otherModel, "completions", "200"))
	}
	families, err := e.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	series := 0
	values := map[string]bool{}
	for _, mf := range families {
		for _, m := range mf.GetMetric() {
			series++
			for _, l := range m.GetLabel() {
				if l.GetName() == "model" {
					values[l.GetValue()] = true
				}
			}
		}
	}
	t.Logf("%d requests for distinct models: %d series, %d model label values", models, series, len(values))
	if len(values) > maxLearntModels+1 || !values[otherModel] {
		t.Fatalf("%d values of the model label, want at most %d with %q", len(values), maxLearntModels+1, otherModel)
	}
	if series > 2000 {
		t.Fatalf("%d series after %d made-up models", series, models)
	}
}

// blockingCollector holds every Collect until release is closed.
type blockingCollector struct {
	desc    *prometheus.Desc
	entered chan struct{}
	release chan struct{}
}

func (c *blockingCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }
func (c *blockingCollector) Collect(ch chan<- prometheus.Metric) {
	c.entered <- struct{}{}
	<-c.release
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, 1)
}

func TestConcurrentScrapesAreLimited(t *testing.T) {
	e := newEnv(t, envOpts{})
	bc := &blockingCollector{desc: prometheus.NewDesc("test_blocking", "blocks scrapes", nil, nil),
		entered: make(chan struct{}, MaxConcurrentScrapes+1), release: make(chan struct{})}
	e.reg.MustRegister(bc)
	var once sync.Once
	release := func() { once.Do(func() { close(bc.release) }) }
	defer release()
	var wg sync.WaitGroup
	codes := make(chan int, MaxConcurrentScrapes)
	for range MaxConcurrentScrapes {
		wg.Go(func() {
			resp, err := http.Get(e.srv.URL + "/metrics")
			if err != nil {
				codes <- 0
				return
			}
			resp.Body.Close()
			codes <- resp.StatusCode
		})
	}
	for range MaxConcurrentScrapes {
		select {
		case <-bc.entered:
		case <-time.After(10 * time.Second):
			t.Fatal("the scrapes did not start")
		}
	}
	// Without a limit the scrape would wait with the others.
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(e.srv.URL + "/metrics")
	if err != nil {
		t.Fatalf("a scrape beyond the limit was not refused: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if code := openAIError(t, resp, body, 429); code != "too_many_scrapes" || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("a scrape beyond the limit: %s", code)
	}
	release()
	wg.Wait()
	close(codes)
	for c := range codes {
		if c != 200 {
			t.Fatalf("a scrape within the limit answered %d", c)
		}
	}
	testwait.Until(t, 5*time.Second, "a scrape once the others ended", func() bool {
		resp, _ := e.get("/metrics")
		return resp.StatusCode == 200
	})
}
