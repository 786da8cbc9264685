package serve

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"
)

// DefaultLoRAPollInterval is how often engines' adapters are re-read when
// Config.LoRAPollInterval is 0: an adapter loaded or unloaded behind the
// router's back is seen within it.
const DefaultLoRAPollInterval = 5 * time.Second

// loraReadTimeout bounds one GET /v1/models.
const loraReadTimeout = 5 * time.Second

// readAdapters lists the LoRA adapters an engine has loaded: vLLM lists
// each in GET /v1/models as an entry whose parent is the base model (base
// models have none).
func readAdapters(ctx context.Context, client *http.Client, base string) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, loraReadTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(base, "/")+"/v1/models", nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET /v1/models answered %d", resp.StatusCode)
	}
	var list struct {
		Data []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(&list); err != nil {
		return nil, fmt.Errorf("GET /v1/models: %w", err)
	}
	var out []string
	for _, m := range list.Data {
		if m.Parent != nil && *m.Parent != "" && m.ID != *m.Parent && !slices.Contains(out, m.ID) {
			out = append(out, m.ID)
		}
	}
	slices.Sort(out)
	return out, nil
}

// rereadAdapters reads an engine's adapters into the registry. A failed
// read keeps what was known: the health probe, not this, decides whether
// the engine is there.
func (s *Server) rereadAdapters(ctx context.Context, id uint64) {
	s.mu.Lock()
	w := s.workers[id]
	s.mu.Unlock()
	if w == nil {
		return
	}
	w.adaptersRead.Lock()
	defer w.adaptersRead.Unlock()
	names, err := readAdapters(ctx, s.loraClient, w.spec.URL)
	if err != nil {
		s.log.Debug("reading the engine's LoRA adapters", "worker", w.spec.Name, "err", err)
		return
	}
	s.mu.Lock()
	changed := !slices.Equal(w.adapters, names)
	w.adapters = names
	s.mu.Unlock()
	if changed {
		s.log.Info("engine's LoRA adapters", "worker", w.spec.Name, "adapters", names)
	}
}

// watchAdapters re-reads every engine's adapters on a schedule, and a
// discovered engine's at once.
func (s *Server) watchAdapters(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-s.adaptersKick:
		}
		s.mu.Lock()
		var ids []uint64
		for id, w := range s.workers {
			if w.up {
				ids = append(ids, id)
			}
		}
		s.mu.Unlock()
		var wg sync.WaitGroup
		for _, id := range ids {
			wg.Go(func() { s.rereadAdapters(ctx, id) })
		}
		wg.Wait()
	}
}

// kickAdapters has the adapters of every engine re-read soon.
func (s *Server) kickAdapters() {
	select {
	case s.adaptersKick <- struct{}{}:
	default:
	}
}
