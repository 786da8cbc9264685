package frontend

import (
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/adapters/metrics"
)

// tokenizerCheck compares the router's prompt token count with the
// engine's usage.prompt_tokens on every answer that reports one. The engine
// tokenizes the prompt itself, so a router tokenizing with another
// tokenizer hashes blocks the engine never stores: routing by cache goes
// blind and nothing else says so. A count is compared only when the
// router's tokens are the prompt the engine got (not a continuation).
type tokenizerCheck struct {
	log        *slog.Logger
	mismatch   *prometheus.GaugeVec
	mismatches *prometheus.CounterVec

	mu      sync.Mutex
	byModel map[string]*tokenizerState
}

// tokenizerState is a model's last comparison, as /health shows it.
type tokenizerState struct {
	Model        string `json:"model"`
	Worker       string `json:"worker"`
	RouterTokens int    `json:"router_prompt_tokens"`
	EngineTokens int    `json:"engine_prompt_tokens"`
	Mismatch     bool   `json:"mismatch"`
	Compared     uint64 `json:"compared"`
	Mismatched   uint64 `json:"mismatched"`
}

// maxTokenizerModels bounds the models remembered; models are those the
// router serves, so this only guards against a fleet of thousands.
const maxTokenizerModels = 1024

func newTokenizerCheck(log *slog.Logger) *tokenizerCheck {
	return &tokenizerCheck{
		log: log,
		mismatch: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: metrics.Namespace, Name: "tokenizer_mismatch",
			Help: "1 while the last answer of the model reported another prompt token count (usage.prompt_tokens) than the router's tokenizer counted: the router's tokenizer is not the engine's.",
		}, []string{"model"}),
		mismatches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Name: "prompt_token_count_mismatches_total",
			Help: "Answers whose usage.prompt_tokens differed from the router's prompt token count.",
		}, []string{"model"}),
		byModel: map[string]*tokenizerState{},
	}
}

func (t *tokenizerCheck) collectors() []prometheus.Collector {
	return []prometheus.Collector{t.mismatch, t.mismatches}
}

// observe compares one answer's counts; engine < 0 means it reported none.
func (t *tokenizerCheck) observe(model, worker string, router, engine int) {
	if router <= 0 || engine < 0 {
		return
	}
	bad := router != engine
	t.mu.Lock()
	st := t.byModel[model]
	if st == nil {
		if len(t.byModel) >= maxTokenizerModels {
			t.mu.Unlock()
			return
		}
		st = &tokenizerState{Model: model}
		t.byModel[model] = st
	}
	changed := st.Compared == 0 && bad || st.Compared > 0 && st.Mismatch != bad
	st.Worker, st.RouterTokens, st.EngineTokens, st.Mismatch = worker, router, engine, bad
	st.Compared++
	if bad {
		st.Mismatched++
	}
	t.mu.Unlock()
	if bad {
		t.mismatch.WithLabelValues(model).Set(1)
		t.mismatches.WithLabelValues(model).Inc()
	} else {
		t.mismatch.WithLabelValues(model).Set(0)
	}
	switch {
	case changed && bad:
		t.log.Warn(mismatchText(model, worker, router, engine)+": give serve the engine's tokenizer (--tokenizer or --model-path, tokenizer= on the worker), or none to tokenize through the engine's /tokenize",
			"model", model, "worker", worker, "router_prompt_tokens", router, "engine_prompt_tokens", engine)
	case changed:
		t.log.Info("the router's prompt token counts agree with the engine's again", "model", model, "worker", worker)
	}
}

func mismatchText(model, worker string, router, engine int) string {
	return fmt.Sprintf("model %q: the router counted %d prompt tokens where engine %s counted %d: the router's tokenizer is not the engine's, so its block hashes miss the engine's cache",
		model, router, worker, engine)
}

// health lists every model compared, by name, and the reasons to call the
// router degraded.
func (t *tokenizerCheck) health() ([]tokenizerState, []string) {
	t.mu.Lock()
	out := make([]tokenizerState, 0, len(t.byModel))
	for _, st := range t.byModel {
		out = append(out, *st)
	}
	t.mu.Unlock()
	slices.SortFunc(out, func(a, b tokenizerState) int { return strings.Compare(a.Model, b.Model) })
	var reasons []string
	for _, st := range out {
		if st.Mismatch {
			reasons = append(reasons, mismatchText(st.Model, st.Worker, st.RouterTokens, st.EngineTokens))
		}
	}
	return out, reasons
}
