package frontend

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/core/lora"
	"github.com/kvrouter/kvrouter/core/router"
)

// LoRA configures the serving of LoRA adapters. A request whose model is
// an adapter that engines list in their /v1/models (Worker.Adapters) goes
// to those engines only, routed by cache and load among them, its blocks
// keyed by the adapter's name. An adapter no engine holds is loaded, with
// DynamicLoading, on the engine rendezvous hashing places it on (package
// core/lora), then routed there; without it the request is a 404.
type LoRA struct {
	// DynamicLoading loads an adapter no engine holds (Dynamo's
	// --lora-dynamic-loading); the adapter must be one of Modules.
	DynamicLoading bool
	// Modules are the adapters the router may load, by name
	// (--lora-modules): clients name an adapter, never a path, so that no
	// request makes an engine read a path of the client's choosing.
	Modules map[string]LoRAModule
	// Reread, optional, re-reads an engine's adapters and returns once
	// Config.Workers shows them: the router calls it after loading one.
	Reread func(ctx context.Context, workerID uint64)
	// LoadTimeout bounds one load; 0 means DefaultLoRALoadTimeout.
	LoadTimeout time.Duration
}

// LoRAModule is an adapter the router may load.
type LoRAModule struct {
	Name, Path string
	// Base is the model the adapter applies to; "" when the engines serve
	// one model only.
	Base string
}

// DefaultLoRALoadTimeout bounds an adapter's load when LoRA.LoadTimeout
// is 0: an engine reads the adapter's weights from disk or the network.
const DefaultLoRALoadTimeout = 2 * time.Minute

// loraLoads makes concurrent first requests for one adapter load it once.
type loraLoads struct {
	mu      sync.Mutex
	pending map[string]*loraLoad
}

type loraLoad struct {
	done    chan struct{}
	waiters int // requests waiting for it, guarded by loraLoads.mu
	worker  Worker
	err     *httpError
}

// isAdapter reports whether model names an adapter rather than a model:
// an engine lists it as one, or it is one the router may load and no
// engine serves it as its model.
func (f *Frontend) isAdapter(model string, all []Worker) bool {
	for _, w := range all {
		if slices.Contains(w.Adapters, model) {
			return true
		}
	}
	if _, ok := f.cfg.LoRA.Modules[model]; !ok {
		return false
	}
	for _, w := range all {
		if w.Model == model {
			return false
		}
	}
	return true
}

// unknownModel is the 404 of a model no engine serves, neither as its
// model nor as a LoRA adapter, and the router may not load.
func (f *Frontend) unknownModel(model string) *httpError {
	hint := "with --lora-dynamic-loading and --lora-modules " + model + "=PATH kvrouter loads it on an engine"
	if f.cfg.LoRA.DynamicLoading {
		hint = "kvrouter has no path for it: add --lora-modules " + model + "=PATH"
	}
	return newError(http.StatusNotFound, "invalid_request_error", "model_not_found", "model",
		"The model `%s` does not exist: no engine serves it, nor has a LoRA adapter of that name loaded (if it is an adapter, %s).", model, hint)
}

// adapterHolders returns the engines that hold adapter and their model.
func adapterHolders(adapter string, all []Worker) (base string, holders []Worker) {
	for _, w := range all {
		if slices.Contains(w.Adapters, adapter) {
			holders = append(holders, w)
			if base == "" {
				base = w.Model
			}
		}
	}
	return base, holders
}

// adapterWorkers returns the engines that serve adapter, loading it on one
// if none does and dynamic loading is on.
func (f *Frontend) adapterWorkers(ctx context.Context, adapter string, all []Worker) (base string, holders []Worker, herr *httpError) {
	if base, holders = adapterHolders(adapter, all); len(holders) > 0 {
		return base, holders, nil
	}
	// isAdapter holds: an engine lists it, or it is one of Modules.
	mod := f.cfg.LoRA.Modules[adapter]
	if !f.cfg.LoRA.DynamicLoading {
		return "", nil, newError(http.StatusNotFound, "invalid_request_error", "model_not_found", "model",
			"The model `%s` does not exist: no engine has the LoRA adapter `%s` loaded. Load it on an engine (POST /v1/load_lora_adapter), or let kvrouter load it: --lora-dynamic-loading.", adapter, adapter)
	}
	w, herr := f.loadOnce(ctx, mod, all)
	if herr != nil {
		return "", nil, herr
	}
	if base, holders = adapterHolders(adapter, f.cfg.Workers()); len(holders) == 0 {
		// The registry has not caught up: the engine that loaded it is
		// the one that holds it.
		base, holders = w.Model, []Worker{w}
	}
	return base, holders, nil
}

// loadOnce loads mod on its engine; concurrent calls for one adapter wait
// for the first one's load.
func (f *Frontend) loadOnce(ctx context.Context, mod LoRAModule, all []Worker) (Worker, *httpError) {
	f.loras.mu.Lock()
	l := f.loras.pending[mod.Name]
	first := l == nil
	if first {
		if f.loras.pending == nil {
			f.loras.pending = map[string]*loraLoad{}
		}
		l = &loraLoad{done: make(chan struct{})}
		f.loras.pending[mod.Name] = l
	}
	l.waiters++
	f.loras.mu.Unlock()
	if first {
		// The load outlives the client that asked first: the others wait
		// for it.
		go func() {
			l.worker, l.err = f.load(mod, all)
			f.loras.mu.Lock()
			delete(f.loras.pending, mod.Name)
			f.loras.mu.Unlock()
			close(l.done)
		}()
	}
	select {
	case <-l.done:
		return l.worker, l.err
	case <-ctx.Done():
		return Worker{}, errCancelled(ctx)
	}
}

// load places mod on the engine rendezvous hashing chooses among those
// serving its base model, loads it there and has the registry re-read.
func (f *Frontend) load(mod LoRAModule, all []Worker) (Worker, *httpError) {
	// A prefill engine serves no request whole: an adapter placed there
	// alone could not be routed.
	prefill := map[uint64]bool{}
	for _, in := range f.cfg.Router.Workers() {
		if in.Role == router.RolePrefill {
			prefill[in.ID] = true
		}
	}
	var candidates []Worker
	models := map[string]bool{}
	for _, w := range all {
		if prefill[w.ID] {
			continue
		}
		if mod.Base == "" || w.Model == "" || w.Model == mod.Base {
			candidates = append(candidates, w)
			models[w.Model] = true
		}
	}
	if mod.Base == "" && len(models) > 1 {
		return Worker{}, newError(http.StatusNotFound, "invalid_request_error", "model_not_found", "model",
			"The LoRA adapter `%s` is not loaded, and the engines serve several models: say which one it applies to, --lora-modules '{\"name\": %q, \"path\": %q, \"base_model_name\": \"MODEL\"}'.", mod.Name, mod.Name, mod.Path)
	}
	id, ok := lora.Choose(mod.Name, workerIDs(candidates))
	if !ok {
		return Worker{}, newError(http.StatusServiceUnavailable, "server_error", "no_workers", "", "no engine serves model %q, the base of the LoRA adapter %q", mod.Base, mod.Name)
	}
	w, _ := findWorker(candidates, id)
	timeout := cmp.Or(f.cfg.LoRA.LoadTimeout, DefaultLoRALoadTimeout)
	ctx, cancel := context.WithTimeout(f.aborted, timeout)
	defer cancel()
	if err := f.postLoad(ctx, w, mod); err != nil {
		f.log.Warn("loading a LoRA adapter failed", "adapter", mod.Name, "worker", w.Name, "err", err)
		return Worker{}, newError(http.StatusBadGateway, "server_error", "lora_load_failed", "model", "loading the LoRA adapter %q on engine %s failed: %v", mod.Name, w.Name, err)
	}
	f.log.Info("loaded a LoRA adapter", "adapter", mod.Name, "worker", w.Name, "path", mod.Path)
	if f.cfg.LoRA.Reread != nil {
		f.cfg.LoRA.Reread(ctx, w.ID)
	}
	return w, nil
}

// postLoad asks the engine to load the adapter as vLLM's
// /v1/load_lora_adapter does; one it has loaded already counts as loaded.
func (f *Frontend) postLoad(ctx context.Context, w Worker, mod LoRAModule) error {
	body, _ := json.Marshal(map[string]string{"lora_name": mod.Name, "lora_path": mod.Path})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(w.BaseURL, "/")+"/v1/load_lora_adapter", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := f.cfg.Client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	switch {
	case resp.StatusCode == http.StatusOK:
		return nil
	case resp.StatusCode == http.StatusBadRequest && bytes.Contains(msg, []byte("has already been loaded")):
		return nil
	case resp.StatusCode == http.StatusNotFound && !bytes.Contains(msg, []byte(`"error"`)):
		return fmt.Errorf("the engine has no /v1/load_lora_adapter (vLLM serves it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora)")
	}
	return fmt.Errorf("POST /v1/load_lora_adapter answered %d: %s", resp.StatusCode, engineMessage(msg))
}

func workerIDs(ws []Worker) []uint64 {
	ids := make([]uint64, len(ws))
	for i, w := range ws {
		ids[i] = w.ID
	}
	return ids
}
