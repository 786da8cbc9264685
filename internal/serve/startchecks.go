package serve

import (
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"unicode"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
)

// checkWorkers refuses engine lists that cannot be what the operator
// meant: an id, an HTTP URL or a KV-event endpoint given twice would make
// one engine count as two (twice the capacity, its events applied to both)
// or two engines as one.
func checkWorkers(ws []WorkerSpec) error {
	ids := map[uint64]WorkerSpec{}
	urls := map[string]string{}
	events := map[string]string{}
	for _, w := range ws {
		if other, ok := ids[w.ID]; ok {
			// Names default to the id, so the URLs tell the two apart.
			return fmt.Errorf("serve: workers %q (%s) and %q (%s) both have id %d", other.Name, other.URL, w.Name, w.URL, w.ID)
		}
		ids[w.ID] = w
		url := strings.TrimSuffix(w.URL, "/")
		if other, ok := urls[url]; ok {
			return fmt.Errorf("serve: workers %q and %q have the same url %s", other, w.Name, w.URL)
		}
		urls[url] = w.Name
		if w.Events == "" {
			continue
		}
		if other, ok := events[w.Events]; ok {
			return fmt.Errorf("serve: workers %q and %q have the same KV-event endpoint %s", other, w.Name, w.Events)
		}
		events[w.Events] = w.Name
	}
	return nil
}

// warnModelTypos warns about models whose names differ only in case,
// punctuation or an organisation prefix ("Llama-3" and "meta/llama_3"): a
// request names one of them and never reaches the engines of the other,
// which is rarely what was meant.
func warnModelTypos(log *slog.Logger, ws []WorkerSpec) {
	engines := map[string][]string{}
	for _, w := range ws {
		if w.Model != "" {
			engines[w.Model] = append(engines[w.Model], w.Name)
		}
	}
	models := make([]string, 0, len(engines))
	for m := range engines {
		models = append(models, m)
	}
	slices.Sort(models)
	for i, a := range models {
		for _, b := range models[i+1:] {
			if modelKey(a) == modelKey(b) {
				log.Warn(fmt.Sprintf("models %q and %q differ only in spelling: requests for one never reach the engines of the other; a typo?", a, b),
					"engines_"+a, strings.Join(engines[a], ","), "engines_"+b, strings.Join(engines[b], ","))
			}
		}
	}
}

// modelKey is a model name without its organisation prefix, case and
// punctuation.
func modelKey(model string) string {
	if i := strings.LastIndexByte(model, '/'); i >= 0 {
		model = model[i+1:]
	}
	return strings.Map(func(r rune) rune {
		if unicode.IsLetter(r) || unicode.IsDigit(r) {
			return unicode.ToLower(r)
		}
		return -1
	}, model)
}

// warnIfNoEngines says how to give engines when none was configured and
// none was registered in discovery at start: the router then answers 503
// until an agent registers one.
func (s *Server) warnIfNoEngines() {
	if len(s.cfg.Workers) > 0 || s.cfg.Plane == nil {
		return
	}
	s.mu.Lock()
	n := len(s.workers)
	s.mu.Unlock()
	if n > 0 {
		return
	}
	names := s.cfg.Plane.Names
	if names.Namespace == "" {
		names.Namespace = natsplane.DefaultNamespace
	}
	s.log.Warn(fmt.Sprintf("no engines yet: none given with --worker or --config, and none registered in NATS discovery (%s, namespace %q); "+
		"run \"kvrouter agent --nats-url %s --namespace %s --engine-url http://HOST:8000 --events tcp://HOST:5557\" next to each engine, or restart with --worker; "+
		"requests are answered 503 until one joins", s.cfg.Plane.Conn.ConnectedUrlRedacted(), names.Namespace, s.cfg.Plane.Conn.ConnectedUrlRedacted(), names.Namespace))
}
