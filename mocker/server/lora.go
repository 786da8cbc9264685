package server

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
)

// LoRAModule is a LoRA adapter an engine serves: requests naming it run
// with their blocks keyed by its name. The mocker reads nothing at Path;
// it only reports it, as vLLM's /v1/models reports an adapter's root.
type LoRAModule struct {
	Name, Path string
}

// ParseLoRAModule reads vLLM's --lora-modules form name=path.
func ParseLoRAModule(s string) (LoRAModule, error) {
	name, path, ok := strings.Cut(s, "=")
	if !ok || name == "" || path == "" {
		return LoRAModule{}, fmt.Errorf("--lora-modules %q: want name=path", s)
	}
	return LoRAModule{Name: name, Path: path}, nil
}

// loras are the adapters an engine has loaded, in the order loaded.
type loras struct {
	mu   sync.Mutex
	mods []LoRAModule
}

// load adds m, or replaces the adapter of its name when inplace; it
// reports false when the name is taken and not inplace.
func (l *loras) load(m LoRAModule, inplace bool) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if i := slices.IndexFunc(l.mods, func(x LoRAModule) bool { return x.Name == m.Name }); i >= 0 {
		if !inplace {
			return false
		}
		l.mods[i] = m
		return true
	}
	l.mods = append(l.mods, m)
	return true
}

func (l *loras) unload(name string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := len(l.mods)
	l.mods = slices.DeleteFunc(l.mods, func(x LoRAModule) bool { return x.Name == name })
	return len(l.mods) < n
}

func (l *loras) has(name string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.mods, func(x LoRAModule) bool { return x.Name == name })
}

func (l *loras) list() []LoRAModule {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.mods)
}

type loadLoRARequest struct {
	Name        string `json:"lora_name"`
	Path        string `json:"lora_path"`
	LoadInplace bool   `json:"load_inplace"`
}

// loadLoRA answers as vLLM's /v1/load_lora_adapter, which vLLM serves only
// with VLLM_ALLOW_RUNTIME_LORA_UPDATING set; the mocker always serves it.
func (s *Server) loadLoRA(w http.ResponseWriter, r *http.Request) {
	var req loadLoRARequest
	if !s.decode(w, r, &req) {
		return
	}
	switch {
	case req.Name == "" || req.Path == "":
		writeError(w, http.StatusBadRequest, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
	case !s.loras.load(LoRAModule{Name: req.Name, Path: req.Path}, req.LoadInplace):
		writeError(w, http.StatusBadRequest, "InvalidUserInput", "The lora adapter '%s' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.", req.Name)
	default:
		_, _ = io.WriteString(w, "Success: LoRA adapter '"+req.Name+"' added successfully.")
	}
}

// unloadLoRA answers as vLLM's /v1/unload_lora_adapter. The adapter's
// cached blocks stay until evicted, as in vLLM.
func (s *Server) unloadLoRA(w http.ResponseWriter, r *http.Request) {
	var req loadLoRARequest
	if !s.decode(w, r, &req) {
		return
	}
	switch {
	case req.Name == "":
		writeError(w, http.StatusBadRequest, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter.")
	case !s.loras.unload(req.Name):
		writeError(w, http.StatusNotFound, "NotFoundError", "The lora adapter '%s' cannot be found.", req.Name)
	default:
		_, _ = io.WriteString(w, "Success: LoRA adapter '"+req.Name+"' removed successfully.")
	}
}
