package server

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvrouter/kvrouter/adapters/jsonerr"
	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/mocker/engine"
	"github.com/kvrouter/kvrouter/mocker/tokenizer"
)

// Config describes one simulated engine as its HTTP clients see it.
type Config struct {
	Model       string
	Name        string // engine name, a metrics label
	MaxModelLen int    // prompt + max_tokens limit, as vLLM's --max-model-len
	// DefaultMaxTokens applies when a request sets none. Real engines stop
	// at an end-of-sequence token; the simulator has none, so it needs a
	// bound.
	DefaultMaxTokens int
	MaxBodyBytes     int64
	// KVEventsDump, when set, answers GET /kv_events/dump: a rank's cached
	// blocks as one KV event batch, consistent with the events published
	// before the sequence number next.
	KVEventsDump func(ctx context.Context, rank int) (next uint64, payload []byte, err error)
	// Role is the engine's part in disaggregated prefill/decode serving
	// (see Role); empty means RoleBoth.
	Role Role
	// EngineID names the engine in kv_transfer_params (vLLM's engine_id);
	// empty picks a random one.
	EngineID string
	// KVTransfer models the link a decode engine pulls KV blocks over;
	// zero fields take DefaultKVTransferConfig's.
	KVTransfer KVTransferConfig
	// Tokenizer, when set, tokenizes prompts and spells generated tokens
	// with a model's real tokenizer and chat template instead of the
	// mocker's own (mocker/tokenizer).
	Tokenizer *Tokenizer
	// MMTokensPerItem is the placeholder tokens each image or audio item
	// of a chat expands to with the mocker's own tokenizer, as a LLaVA-1.5
	// style model's fixed count (see multimodal.go); 0 takes no media.
	MMTokensPerItem int
	// LoRAModules are the LoRA adapters loaded at start (vLLM's
	// --lora-modules); more are loaded and unloaded at run time through
	// /v1/load_lora_adapter and /v1/unload_lora_adapter.
	LoRAModules []LoRAModule
}

// DefaultConfig mirrors vLLM's defaults where it has them.
func DefaultConfig() Config {
	return Config{Model: "kvrouter-mock", Name: "engine-0", MaxModelLen: 131072, DefaultMaxTokens: 16, MaxBodyBytes: 16 << 20,
		Role: RoleBoth, KVTransfer: DefaultKVTransferConfig(), MMTokensPerItem: DefaultMMTokensPerItem}
}

// Server is the HTTP face of one engine with one runner per
// data-parallel rank.
type Server struct {
	cfg     Config
	codec   codec
	ranks   []*Runner
	nextID  atomic.Uint64
	created int64
	reg     *prometheus.Registry
	m       serverMetrics
	// pullClient fetches KV blocks from prefill engines. Its timeout bounds
	// a pull from an engine that accepted the connection and hung: the
	// request then falls back to a local prefill.
	pullClient *http.Client
	loras      loras
	sessions   sessions
}

// MustRegister adds collectors to the engine's /metrics.
func (s *Server) MustRegister(cs ...prometheus.Collector) { s.reg.MustRegister(cs...) }

// New builds the server of an engine whose ranks are driven by ranks.
func New(cfg Config, ranks []*Runner) *Server {
	if cfg.Role == "" {
		cfg.Role = RoleBoth
	}
	if cfg.EngineID == "" {
		cfg.EngineID = newEngineID()
	}
	def := DefaultKVTransferConfig()
	cfg.KVTransfer.Bandwidth = cmp.Or(cfg.KVTransfer.Bandwidth, def.Bandwidth)
	cfg.KVTransfer.BytesPerToken = cmp.Or(cfg.KVTransfer.BytesPerToken, def.BytesPerToken)
	cfg.KVTransfer.Timeout = cmp.Or(cfg.KVTransfer.Timeout, def.Timeout)
	var c codec = fakeCodec{mmTokens: cfg.MMTokensPerItem}
	if cfg.Tokenizer != nil {
		c = cfg.Tokenizer
	}
	s := &Server{cfg: cfg, codec: c, ranks: ranks, created: time.Now().Unix(), reg: prometheus.NewRegistry(), pullClient: &http.Client{Timeout: 30 * time.Second}}
	for _, m := range cfg.LoRAModules {
		s.loras.load(m, true)
	}
	s.m = newServerMetrics(s)
	return s
}

// Handler routes the vLLM-compatible endpoints.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", s.completions)
	mux.HandleFunc("POST /v1/chat/completions", s.chatCompletions)
	mux.HandleFunc("GET /v1/models", s.models)
	mux.HandleFunc("POST /tokenize", s.tokenize)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /kv_events/dump", s.kvEventsDump)
	mux.HandleFunc("POST /kv_transfer/pull", s.kvTransferPull)
	mux.HandleFunc("GET /role", s.role)
	mux.HandleFunc("POST /v1/load_lora_adapter", s.loadLoRA)
	mux.HandleFunc("POST /v1/unload_lora_adapter", s.unloadLoRA)
	// SGLang's session API (it also answers GET, with the body as JSON).
	for _, m := range []string{"GET", "POST"} {
		mux.HandleFunc(m+" /open_session", s.openSession)
		mux.HandleFunc(m+" /close_session", s.closeSession)
	}
	return mux
}

// kvEventsDump answers a rank's whole cache: what a router that lost the
// rank's events rebuilds from, then following the events from the
// sequence number in vllmevents.DumpNextSeqHeader on.
func (s *Server) kvEventsDump(w http.ResponseWriter, r *http.Request) {
	if s.cfg.KVEventsDump == nil {
		writeError(w, http.StatusNotFound, "not_found_error", "this engine publishes no KV events")
		return
	}
	rank := 0
	if q := r.URL.Query().Get("dp_rank"); q != "" {
		n, err := strconv.Atoi(q)
		if err != nil || n < 0 || n >= len(s.ranks) {
			badRequest(w, "dp_rank %q: want an integer in [0, %d)", q, len(s.ranks))
			return
		}
		rank = n
	}
	next, payload, err := s.cfg.KVEventsDump(r.Context(), rank)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, "service_unavailable", "dumping rank %d: %v", rank, err)
		return
	}
	w.Header().Set("Content-Type", "application/msgpack")
	w.Header().Set(vllmevents.DumpNextSeqHeader, strconv.FormatUint(next, 10))
	_, _ = w.Write(payload)
}

// apiError is OpenAI's error shape.
type apiError struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    int     `json:"code"`
	} `json:"error"`
}

func writeError(w http.ResponseWriter, status int, typ, format string, args ...any) {
	var e apiError
	e.Error.Message = fmt.Sprintf(format, args...)
	e.Error.Type = typ
	e.Error.Code = status
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(e)
}

func badRequest(w http.ResponseWriter, format string, args ...any) {
	writeError(w, http.StatusBadRequest, "invalid_request_error", format, args...)
}

// decode reads a JSON body, answering 413 or 400 itself when it cannot.
func (s *Server) decode(w http.ResponseWriter, r *http.Request, v any) bool {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", "request body larger than %d bytes", tooBig.Limit)
		} else {
			badRequest(w, "reading the request body: %v", err)
		}
		return false
	}
	if err := json.Unmarshal(body, v); err != nil {
		badRequest(w, "%s", jsonerr.Describe(err, v, ""))
		return false
	}
	return true
}

// checkModel answers 404 as vLLM does for a model that is neither the
// base model nor a loaded adapter; lora is the adapter's name.
func (s *Server) checkModel(w http.ResponseWriter, model string) (lora string, ok bool) {
	if model == "" || model == s.cfg.Model {
		return "", true
	}
	if s.loras.has(model) {
		return model, true
	}
	writeError(w, http.StatusNotFound, "NotFoundError", "The model `%s` does not exist.", model)
	return "", false
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type commonParams struct {
	Model               string         `json:"model"`
	MaxTokens           *int           `json:"max_tokens"`
	MaxCompletionTokens *int           `json:"max_completion_tokens"`
	Stream              bool           `json:"stream"`
	StreamOptions       *streamOptions `json:"stream_options"`
	N                   *int           `json:"n"`
	DPRank              *int           `json:"data_parallel_rank"`
	// KVTransferParams makes the request one half of a disaggregated
	// prefill/decode pair.
	KVTransferParams *kvTransferParams `json:"kv_transfer_params"`
	// CacheSalt keys the prompt's blocks apart from other salts' (vLLM's
	// cache_salt).
	CacheSalt *string `json:"cache_salt"`
}

type completionRequest struct {
	commonParams
	Prompt           json.RawMessage `json:"prompt"`
	AddSpecialTokens *bool           `json:"add_special_tokens"`
}

// promptTokens reads an OpenAI prompt: a string, a list of token ids, or a
// one-element list of either.
func (s *Server) promptTokens(raw json.RawMessage, addSpecialTokens *bool) ([]uint32, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, errors.New("prompt is required")
	}
	var text string
	if json.Unmarshal(raw, &text) == nil {
		return s.codec.encodeText(text, addSpecialTokens)
	}
	var ids []int64
	if json.Unmarshal(raw, &ids) == nil {
		return s.checkIDs(ids)
	}
	var texts []string
	if json.Unmarshal(raw, &texts) == nil && len(texts) == 1 {
		return s.codec.encodeText(texts[0], addSpecialTokens)
	}
	var lists [][]int64
	if json.Unmarshal(raw, &lists) == nil && len(lists) == 1 {
		return s.checkIDs(lists[0])
	}
	return nil, errors.New("prompt must be a string, a list of token ids, or a list holding one of them (batched prompts are not supported)")
}

func (s *Server) checkIDs(ids []int64) ([]uint32, error) {
	n := int64(s.codec.vocabSize())
	out := make([]uint32, len(ids))
	for i, id := range ids {
		if id < 0 || id >= n {
			return nil, fmt.Errorf("token id %d at position %d is outside the vocabulary [0, %d)", id, i, n)
		}
		out[i] = uint32(id)
	}
	return out, nil
}

// job is a validated request ready for an engine.
type job struct {
	prompt    []uint32
	maxTokens int
	stream    bool
	usage     bool
	rank      *int
	chat      bool
	mm        []engine.MMFeature
	kv        *kvTransferParams
	salt      string
	lora      string // the adapter the request runs under, "" for the base model
}

func (s *Server) validate(w http.ResponseWriter, p *commonParams, prompt []uint32) (job, bool) {
	lora, ok := s.checkModel(w, p.Model)
	if !ok {
		return job{}, false
	}
	if p.N != nil && *p.N != 1 {
		badRequest(w, "n must be 1, got %d", *p.N)
		return job{}, false
	}
	if len(prompt) == 0 {
		badRequest(w, "prompt must not be empty")
		return job{}, false
	}
	maxTokens := s.cfg.DefaultMaxTokens
	if p.MaxCompletionTokens != nil {
		maxTokens = *p.MaxCompletionTokens
	}
	if p.MaxTokens != nil {
		maxTokens = *p.MaxTokens
	}
	if maxTokens < 1 {
		badRequest(w, "max_tokens must be at least 1, got %d", maxTokens)
		return job{}, false
	}
	if len(prompt)+maxTokens > s.cfg.MaxModelLen {
		badRequest(w, "This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.",
			s.cfg.MaxModelLen, len(prompt)+maxTokens, len(prompt), maxTokens)
		return job{}, false
	}
	if p.DPRank != nil && (*p.DPRank < 0 || *p.DPRank >= len(s.ranks)) {
		badRequest(w, "data_parallel_rank %d out of range [0, %d)", *p.DPRank, len(s.ranks))
		return job{}, false
	}
	if p.CacheSalt != nil && *p.CacheSalt == "" {
		badRequest(w, "cache_salt must be a non-empty string")
		return job{}, false
	}
	j := job{prompt: prompt, maxTokens: maxTokens, stream: p.Stream, usage: p.StreamOptions != nil && p.StreamOptions.IncludeUsage, rank: p.DPRank, kv: p.KVTransferParams, lora: lora}
	if p.CacheSalt != nil {
		j.salt = *p.CacheSalt
	}
	if s.consumes(j) {
		if err := checkKVParams(j.kv); err != nil {
			badRequest(w, "%v", err)
			return job{}, false
		}
	}
	return j, true
}

func (s *Server) completions(w http.ResponseWriter, r *http.Request) {
	var req completionRequest
	if !s.decode(w, r, &req) {
		return
	}
	if _, ok := s.checkModel(w, req.Model); !ok {
		return
	}
	prompt, err := s.promptTokens(req.Prompt, req.AddSpecialTokens)
	if err != nil {
		badRequest(w, "%v", err)
		return
	}
	if j, ok := s.validate(w, &req.commonParams, prompt); ok {
		s.serve(w, r, j)
	}
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// chatParams are the fields of vLLM's chat requests (completions and
// /tokenize) that shape the prompt.
type chatParams struct {
	Messages            []json.RawMessage `json:"messages"`
	AddGenerationPrompt *bool             `json:"add_generation_prompt"`
	AddSpecialTokens    *bool             `json:"add_special_tokens"`
	Tools               json.RawMessage   `json:"tools"`
	ChatTemplateKwargs  map[string]any    `json:"chat_template_kwargs"`
}

// chatTokens tokenizes a chat prompt; add_generation_prompt defaults to
// true, as in vLLM.
func (s *Server) chatTokens(p *chatParams) ([]uint32, []engine.MMFeature, error) {
	return s.codec.encodeChat(chatInput{
		messages:            p.Messages,
		addGenerationPrompt: p.AddGenerationPrompt == nil || *p.AddGenerationPrompt,
		addSpecialTokens:    p.AddSpecialTokens,
		tools:               p.Tools,
		kwargs:              p.ChatTemplateKwargs,
	})
}

type chatRequest struct {
	commonParams
	chatParams
}

// messagesText renders messages as the mocker's chat template sees them: a
// media part becomes its modality's placeholder (<image>, <audio>) where
// it stands, and its item is listed, in order.
func messagesText(raw []json.RawMessage) ([]tokenizer.Message, []mediaItem, error) {
	if len(raw) == 0 {
		return nil, nil, errors.New("messages must not be empty")
	}
	out := make([]tokenizer.Message, len(raw))
	var items []mediaItem
	for i, r := range raw {
		var m chatMessage
		if err := json.Unmarshal(r, &m); err != nil {
			return nil, nil, errors.New(jsonerr.Describe(err, &m, fmt.Sprintf("messages[%d]", i)))
		}
		if m.Role == "" {
			return nil, nil, fmt.Errorf("messages[%d].role is required", i)
		}
		out[i].Role = m.Role
		var text string
		if len(m.Content) == 0 || string(m.Content) == "null" || json.Unmarshal(m.Content, &text) == nil {
			out[i].Content = text
			continue
		}
		var parts []contentPart
		if err := json.Unmarshal(m.Content, &parts); err != nil {
			return nil, nil, fmt.Errorf("messages[%d].content must be a string or a list of content parts", i)
		}
		var sb strings.Builder
		for j, p := range parts {
			if p.Type == "text" {
				sb.WriteString(p.Text)
				continue
			}
			it, err := p.media()
			if err != nil {
				return nil, nil, fmt.Errorf("messages[%d].content[%d]: %v", i, j, err)
			}
			sb.WriteString(tokenizer.Word(it.placeholder))
			items = append(items, it)
		}
		out[i].Content = sb.String()
	}
	return out, items, nil
}

func (s *Server) chatCompletions(w http.ResponseWriter, r *http.Request) {
	var req chatRequest
	if !s.decode(w, r, &req) {
		return
	}
	if _, ok := s.checkModel(w, req.Model); !ok {
		return
	}
	prompt, mm, err := s.chatTokens(&req.chatParams)
	if err != nil {
		badRequest(w, "%v", err)
		return
	}
	if j, ok := s.validate(w, &req.commonParams, prompt); ok {
		j.chat, j.mm = true, mm
		s.serve(w, r, j)
	}
}

// pickRank chooses the rank with the fewest requests unless the client
// named one.
func (s *Server) pickRank(j job) int {
	if j.rank != nil {
		return *j.rank
	}
	best, bestLoad := 0, s.ranks[0].Load()
	for i, rr := range s.ranks[1:] {
		if l := rr.Load(); l < bestLoad {
			best, bestLoad = i+1, l
		}
	}
	return best
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (s *Server) serve(w http.ResponseWriter, r *http.Request, j job) {
	rank := s.pickRank(j)
	runner := s.ranks[rank]
	prefix := "cmpl-"
	if j.chat {
		prefix = "chatcmpl-"
	}
	id := prefix + strconv.FormatUint(s.nextID.Add(1), 36) + "-" + strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
	req := engine.Request{ID: id, Tokens: j.prompt, MaxTokens: j.maxTokens, CacheSalt: j.salt, MM: j.mm, LoRA: j.lora}
	var opts SubmitOptions
	if s.produces(j) {
		opts.HoldFor = s.cfg.KVTransfer.Timeout
	}
	if s.consumes(j) {
		opts.Arrived = runner.Now()
		loaded, err := s.pullKV(r.Context(), runner, j)
		if err != nil {
			return // the client went away during the transfer
		}
		req.KVLoadedBlocks = loaded
	}
	stream, err := runner.SubmitWith(req, opts)
	if err != nil {
		if errors.Is(err, engine.ErrPromptTooLong) {
			badRequest(w, "%v", err)
		} else {
			writeError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", "engine refused the request: %v", err)
		}
		return
	}
	s.m.prompt.Add(float64(len(j.prompt)))
	ctx := r.Context()
	out := &responder{s: s, w: w, j: j, id: id, created: time.Now().Unix()}
	if j.stream {
		out.startStream()
		out.flush() // headers now: the client sees the stream open
	}
	var u usage
	u.PromptTokens = len(j.prompt)
	var text strings.Builder
	for {
		outs, finished, err := stream.Next(ctx)
		if err != nil {
			runner.Abort(id) // client went away
			s.m.aborted.Inc()
			return
		}
		for _, o := range outs {
			if o.Index == 0 {
				u.PromptTokensDetails.CachedTokens = o.CachedTokens
			}
			u.CompletionTokens++
			word := s.codec.word(o.Token)
			if j.stream {
				if err := out.chunk(word, o.Finished); err != nil {
					runner.Abort(id)
					s.m.aborted.Inc()
					return
				}
			} else {
				text.WriteString(word)
			}
		}
		if j.stream {
			out.flush()
		}
		if finished {
			break
		}
	}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	s.m.generation.Add(float64(u.CompletionTokens))
	s.m.success.Inc()
	speed := runner.Speedup()
	s.m.ttft.Observe(stream.FirstAt.Sub(stream.Submitted).Seconds() * speed)
	s.m.e2e.Observe(stream.DoneAt.Sub(stream.Submitted).Seconds() * speed)
	if u.CompletionTokens > 1 {
		s.m.tpot.Observe(stream.DoneAt.Sub(stream.FirstAt).Seconds() * speed / float64(u.CompletionTokens-1))
	}
	if j.stream {
		out.finish(u)
		return
	}
	if s.produces(j) {
		kv, err := s.kvAnswer(r, rank, id, stream.HeldBlocks)
		if err != nil {
			writeError(w, http.StatusInternalServerError, "InternalServerError", "kv_transfer_params: %v", err)
			return
		}
		out.kv = kv
	}
	out.whole(text.String(), u)
}

// responder writes one response in the completion or chat shape.
type responder struct {
	s       *Server
	w       http.ResponseWriter
	j       job
	id      string
	created int64
	started bool
	head    []byte // the JSON of a chunk up to its choice
	buf     []byte
	kv      *kvTransferAnswer // a prefill's kv_transfer_params, top-level as in vLLM
}

func (o *responder) object(stream bool) string {
	switch {
	case o.j.chat && stream:
		return "chat.completion.chunk"
	case o.j.chat:
		return "chat.completion"
	}
	return "text_completion"
}

func (o *responder) envelope(stream bool, choices any) map[string]any {
	return map[string]any{"id": o.id, "object": o.object(stream), "created": o.created, "model": o.model(), "choices": choices}
}

// model is the model the answer names: the adapter's name for an
// adapter's request, as vLLM does.
func (o *responder) model() string {
	if o.j.lora != "" {
		return o.j.lora
	}
	return o.s.cfg.Model
}

func (o *responder) startStream() {
	h := o.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	o.w.WriteHeader(http.StatusOK)
}

func (o *responder) event(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(o.w, "data: %s\n\n", b)
	return err
}

// flush sends what the events wrote: once per batch of outputs, not per
// token, which at simulated speeds is the difference between keeping up
// and not.
func (o *responder) flush() {
	if f, ok := o.w.(http.Flusher); ok {
		f.Flush()
	}
}

// chunk writes one streamed token. The JSON around the token is the same
// for every chunk of a request, so it is rendered once: at simulated
// speeds a mocker streams over 100,000 tokens a second.
func (o *responder) chunk(text string, last bool) error {
	if o.head == nil {
		o.head = []byte(`data: {"id":` + quote(o.id) + `,"object":` + quote(o.object(true)) + `,"created":` + strconv.FormatInt(o.created, 10) + `,"model":` + quote(o.model()) + `,"choices":[{"index":0,`)
	}
	b := append(o.buf[:0], o.head...)
	switch {
	case o.j.chat && !o.started:
		b = append(b, `"delta":{"role":"assistant","content":`...)
	case o.j.chat:
		b = append(b, `"delta":{"content":`...)
	default:
		b = append(b, `"text":`...)
	}
	b = appendJSONString(b, text)
	if o.j.chat {
		b = append(b, '}')
	}
	if last {
		b = append(b, `,"logprobs":null,"finish_reason":"length"}]}`+"\n\n"...)
	} else {
		b = append(b, `,"logprobs":null,"finish_reason":null}]}`+"\n\n"...)
	}
	o.buf = b
	o.started = true
	_, err := o.w.Write(b)
	return err
}

// quote renders s as a JSON string.
func quote(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

func (o *responder) finish(u usage) {
	if o.j.usage {
		env := o.envelope(true, []any{})
		env["usage"] = u
		_ = o.event(env)
	}
	_, _ = io.WriteString(o.w, "data: [DONE]\n\n")
	o.flush()
}

func (o *responder) whole(text string, u usage) {
	var choice map[string]any
	if o.j.chat {
		choice = map[string]any{"index": 0, "message": map[string]any{"role": "assistant", "content": text}, "logprobs": nil, "finish_reason": "length"}
	} else {
		choice = map[string]any{"index": 0, "text": text, "logprobs": nil, "finish_reason": "length"}
	}
	env := o.envelope(false, []any{choice})
	env["usage"] = u
	if o.kv != nil {
		env["kv_transfer_params"] = o.kv
	}
	o.w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(o.w).Encode(env)
}

// models lists the base model and, as vLLM does, every loaded adapter
// with the base model as its parent.
func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	data := []any{map[string]any{
		"id": s.cfg.Model, "object": "model", "created": s.created, "owned_by": "kvrouter",
		"root": s.cfg.Model, "parent": nil, "max_model_len": s.cfg.MaxModelLen,
	}}
	for _, m := range s.loras.list() {
		data = append(data, map[string]any{
			"id": m.Name, "object": "model", "created": s.created, "owned_by": "kvrouter",
			"root": m.Path, "parent": s.cfg.Model, "max_model_len": nil,
		})
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": data})
}

type tokenizeRequest struct {
	Model  string          `json:"model"`
	Prompt json.RawMessage `json:"prompt"`
	chatParams
}

// tokenize answers as vLLM's /tokenize: a prompt, or chat messages with
// the chat template applied.
func (s *Server) tokenize(w http.ResponseWriter, r *http.Request) {
	var req tokenizeRequest
	if !s.decode(w, r, &req) {
		return
	}
	if _, ok := s.checkModel(w, req.Model); !ok {
		return
	}
	var ids []uint32
	var err error
	if req.Messages != nil {
		ids, _, err = s.chatTokens(&req.chatParams)
	} else {
		ids, err = s.promptTokens(req.Prompt, req.AddSpecialTokens)
	}
	if err != nil {
		badRequest(w, "%v", err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"count": len(ids), "max_model_len": s.cfg.MaxModelLen, "tokens": ids, "token_strs": nil})
}
