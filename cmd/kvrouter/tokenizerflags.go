package main

import (
	"fmt"
	"strings"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/adapters/modeltok"
	"github.com/kvrouter/kvrouter/internal/serve"
)

// tokenizerFlags name the in-process tokenizers: --tokenizer PATH for
// every model, --tokenizer MODEL=PATH for one, and a worker's tokenizer=
// for its model.
type tokenizerFlags struct{ specs []string }

func (f *tokenizerFlags) register(fs *pflag.FlagSet) {
	fs.StringArrayVar(&f.specs, "tokenizer", nil, "tokenize prompts in process with this Hugging Face tokenizer (a model directory or its tokenizer.json; the chat template comes from the tokenizer_config.json beside it): PATH for every model or MODEL=PATH for one (repeatable); other models are tokenized by their engines' /tokenize")
}

// load reads every tokenizer once, by model ("" = every model); a file that
// does not load stops the start, named.
func (f *tokenizerFlags) load(workers []serve.WorkerSpec) (map[string]*modeltok.Model, error) {
	paths := map[string]string{}
	for _, spec := range f.specs {
		model, path, ok := strings.Cut(spec, "=")
		if !ok {
			model, path = "", spec
		}
		if path == "" {
			return nil, fmt.Errorf("--tokenizer %q: no path", spec)
		}
		paths[model] = path
	}
	for _, w := range workers {
		if w.Tokenizer == "" {
			continue
		}
		if p, ok := paths[w.Model]; ok && p != w.Tokenizer {
			return nil, fmt.Errorf("model %q has two tokenizers: %s and %s", w.Model, p, w.Tokenizer)
		}
		paths[w.Model] = w.Tokenizer
	}
	if len(paths) == 0 {
		return nil, nil
	}
	loaded := map[string]*modeltok.Model{}
	byPath := map[string]*modeltok.Model{}
	for model, path := range paths {
		m := byPath[path]
		if m == nil {
			var err error
			if m, err = modeltok.Load(path); err != nil {
				return nil, err
			}
			byPath[path] = m
		}
		loaded[model] = m
	}
	return loaded, nil
}
