package main

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/adapters/modeltok"
	"github.com/kvrouter/kvrouter/internal/serve"
)

// tokenizerFlags name the in-process tokenizers: --tokenizer PATH for
// every model, --tokenizer MODEL=PATH for one, and a worker's tokenizer=
// for its model; --model-path is the same flag.
type tokenizerFlags struct {
	specs       []string
	cacheLookup bool
	mm          []string
}

// tokenizerRef says what a tokenizer flag takes, for every command's help.
const tokenizerRef = "a model directory, its tokenizer.json, or a model id (org/name) in the local Hugging Face cache ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub); nothing is downloaded"

func (f *tokenizerFlags) register(fs *pflag.FlagSet) {
	fs.StringArrayVar(&f.specs, "tokenizer", nil, "tokenize prompts in process with this Hugging Face tokenizer ("+tokenizerRef+"): PATH for every model or MODEL=PATH for one (repeatable); other models are tokenized by their engines' /tokenize")
	registerModelPath(fs)
	fs.BoolVar(&f.cacheLookup, "tokenizer-cache-lookup", true, "look a model given no tokenizer up by its name (org/name) in the local Hugging Face cache; not found, its engines tokenize")
	fs.StringArrayVar(&f.mm, "mm-placeholder-token", nil, "MODALITY=ID: the placeholder token id of a chat's image, audio or video items in the prompts the engines tokenize (e.g. image=32000 for LLaVA-1.5), for models whose in-process tokenizer's config.json does not name it (repeatable); without it a chat with such media is matched only up to its first placeholder, or not at all")
}

// placeholders reads --mm-placeholder-token.
func (f *tokenizerFlags) placeholders() (map[string]uint32, error) {
	var out map[string]uint32
	for _, spec := range f.mm {
		modality, id, ok := strings.Cut(spec, "=")
		v, err := strconv.ParseUint(id, 10, 32)
		if !ok || modality == "" || err != nil {
			return nil, fmt.Errorf("--mm-placeholder-token %q: want MODALITY=TOKEN_ID, e.g. image=32000", spec)
		}
		if out == nil {
			out = map[string]uint32{}
		}
		out[modality] = uint32(v)
	}
	return out, nil
}

// registerModelPath adds --model-path, the flag SGLang users (and vLLM
// users, for a local model) give a model directory with, as another
// spelling of --tokenizer: one value, one way of loading it.
func registerModelPath(fs *pflag.FlagSet) {
	target := fs.Lookup("tokenizer")
	alias := fs.VarPF(&aliasValue{target: target}, "model-path", "", "a Hugging Face model directory (or model id) to tokenize with: another name for --tokenizer")
	alias.DefValue = ""
}

// load reads every tokenizer once, by model ("" = every model); a file that
// does not load, or a model id not in the local cache, stops the start,
// named.
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
