package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/adapters/frontend"
	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/mocker/server"
)

// loraFlags bind the router's LoRA adapter settings.
type loraFlags struct {
	dynamic bool
	modules []string
	poll    time.Duration
}

func (f *loraFlags) register(fs *pflag.FlagSet) {
	fs.BoolVar(&f.dynamic, "lora-dynamic-loading", false,
		"load a LoRA adapter no engine holds on the engine rendezvous hashing places it on (POST /v1/load_lora_adapter; vLLM needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), then route it there; the adapter must be one of --lora-modules")
	fs.StringArrayVar(&f.modules, "lora-modules", nil,
		`adapters the router may load, as vLLM's --lora-modules: name=path, or {"name": ..., "path": ..., "base_model_name": ...} when the engines serve several models (repeatable)`)
	fs.DurationVar(&f.poll, "lora-poll-interval", serve.DefaultLoRAPollInterval,
		"how often every engine's LoRA adapters are re-read from its /v1/models, besides when it joins and after the router loads one; 0: never")
}

// config is the frontend's LoRA settings and the poll interval serve
// takes (negative for never).
func (f *loraFlags) config() (frontend.LoRA, time.Duration, error) {
	var l frontend.LoRA
	if f.poll < 0 {
		return l, 0, fmt.Errorf("--lora-poll-interval must be at least 0, got %v", f.poll)
	}
	poll := f.poll
	if poll == 0 {
		poll = -1
	}
	mods, err := parseRouterLoRAModules(f.modules)
	if err != nil {
		return l, 0, err
	}
	if f.dynamic && len(mods) == 0 {
		return l, 0, fmt.Errorf("--lora-dynamic-loading loads only the adapters of --lora-modules: give at least one, e.g. --lora-modules sql-lora=/adapters/sql-lora")
	}
	l.DynamicLoading = f.dynamic
	if len(mods) > 0 {
		l.Modules = map[string]frontend.LoRAModule{}
		for _, m := range mods {
			l.Modules[m.Name] = m
		}
	}
	return l, poll, nil
}

// parseRouterLoRAModules reads --lora-modules in vLLM's two forms.
func parseRouterLoRAModules(specs []string) ([]frontend.LoRAModule, error) {
	var out []frontend.LoRAModule
	seen := map[string]bool{}
	for _, s := range specs {
		var m frontend.LoRAModule
		if strings.HasPrefix(strings.TrimSpace(s), "{") {
			var j struct {
				Name string `json:"name"`
				Path string `json:"path"`
				Base string `json:"base_model_name"`
			}
			if err := json.Unmarshal([]byte(s), &j); err != nil || j.Name == "" || j.Path == "" {
				return nil, fmt.Errorf(`--lora-modules %s: want {"name": ..., "path": ..., "base_model_name": ...} with name and path`, s)
			}
			m = frontend.LoRAModule{Name: j.Name, Path: j.Path, Base: j.Base}
		} else {
			sm, err := server.ParseLoRAModule(s)
			if err != nil {
				return nil, err
			}
			m = frontend.LoRAModule{Name: sm.Name, Path: sm.Path}
		}
		if seen[m.Name] {
			return nil, fmt.Errorf("--lora-modules names %q twice", m.Name)
		}
		seen[m.Name] = true
		out = append(out, m)
	}
	return out, nil
}

// mockerLoRAModules reads the mocker's --lora-modules (name=path).
func mockerLoRAModules(specs []string) ([]server.LoRAModule, error) {
	var out []server.LoRAModule
	for _, s := range specs {
		m, err := server.ParseLoRAModule(s)
		if err != nil {
			return nil, err
		}
		out = append(out, m)
	}
	return out, nil
}
