package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/mocker/engine"
)

// pdEngine is one engine of a disaggregated pair under test: its own
// process as far as the test can tell (its own engine, runner, virtual clock
// and HTTP server on 127.0.0.1).
type pdEngine struct {
	srv    *httptest.Server
	runner *Runner
	clock  *VirtualClock

	mu     sync.Mutex
	events []engine.BlockEvent
}

func startPD(t *testing.T, role Role, kv KVTransferConfig, speedup float64) *pdEngine {
	t.Helper()
	e := &pdEngine{clock: NewVirtualClock(time.Unix(0, 0))}
	eng, err := engine.New(engine.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	e.runner = NewRunner(eng, e.clock, speedup, func(_ time.Time, evs []engine.BlockEvent) {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.events = append(e.events, evs...)
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = e.runner.Run(ctx); close(done) }()
	cfg := DefaultConfig()
	cfg.Role, cfg.KVTransfer = role, kv
	e.srv = httptest.NewServer(New(cfg, []*Runner{e.runner}).Handler())
	t.Cleanup(func() {
		e.srv.Close()
		cancel()
		<-done
	})
	return e
}

// storedSince lists the tokens of every block Stored from event n on, one
// slice per block, and the number of events so far.
func (e *pdEngine) storedSince(n, blockSize int) ([][]uint32, int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	var blocks [][]uint32
	for _, ev := range e.events[n:] {
		if ev.Kind == engine.Stored {
			for i := range ev.BlockHashes {
				blocks = append(blocks, slices.Clone(ev.TokenIDs[i*blockSize:(i+1)*blockSize]))
			}
		}
	}
	return blocks, len(e.events)
}

// metric reads one unlabelled-by-us sample from an engine's /metrics; 0 when
// absent.
func metric(t *testing.T, base, name string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `(?:\{[^}]*\})? (\S+)$`).FindSubmatch(body)
	if m == nil {
		t.Fatalf("metric %s missing:\n%s", name, body)
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// step1 is the request a router sends a prefill engine, byte for byte the
// shape of vLLM's proxy: max_tokens 1 and do_remote_decode.
func step1(prompt []int) map[string]any {
	return map[string]any{
		"model": "kvrouter-mock", "prompt": prompt, "max_tokens": 1, "stream": false,
		"kv_transfer_params": map[string]any{
			"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
			"remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
		},
	}
}

// prefill sends step 1 and returns the answer's kv_transfer_params, raw, and
// the response's id.
func prefill(t *testing.T, p *pdEngine, prompt []int) (json.RawMessage, string) {
	t.Helper()
	resp, body := post(t, p.srv.URL+"/v1/completions", step1(prompt))
	var r struct {
		ID      string          `json:"id"`
		KV      json.RawMessage `json:"kv_transfer_params"`
		Usage   usage           `json:"usage"`
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if resp.StatusCode != 200 || json.Unmarshal(body, &r) != nil || r.Usage.CompletionTokens != 1 || len(r.Choices) != 1 || r.KV == nil {
		t.Fatalf("prefill answer %d %s", resp.StatusCode, body)
	}
	return r.KV, r.ID
}

// decodeReq is the client's own request with the prefill's params.
func decodeReq(prompt []int, kv json.RawMessage, stream bool) map[string]any {
	req := map[string]any{"model": "kvrouter-mock", "prompt": prompt, "max_tokens": 5, "stream": stream}
	if stream {
		req["stream_options"] = map[string]any{"include_usage": true}
	}
	if kv != nil {
		req["kv_transfer_params"] = kv
	}
	return req
}

// complete sends a request and returns its usage, streamed or not, after
// checking it produced its 5 tokens.
func complete(t *testing.T, base string, req map[string]any) usage {
	t.Helper()
	resp, body := post(t, base+"/v1/completions", req)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if req["stream"] != true {
		var c struct {
			Usage usage `json:"usage"`
		}
		if err := json.Unmarshal(body, &c); err != nil || c.Usage.CompletionTokens != 5 {
			t.Fatalf("completion %s", body)
		}
		if bytes.Contains(body, []byte("kv_transfer_params")) {
			t.Fatalf("a decode answer carries kv_transfer_params: %s", body)
		}
		return c.Usage
	}
	sc := bufio.NewScanner(bytes.NewReader(body))
	var lines []string
	for sc.Scan() {
		if sc.Text() != "" {
			lines = append(lines, sc.Text())
		}
	}
	if len(lines) != 7 || lines[6] != "data: [DONE]" {
		t.Fatalf("stream of 5 tokens, a usage chunk and [DONE]:\n%s", body)
	}
	var c struct {
		Usage usage `json:"usage"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(lines[5], "data: ")), &c); err != nil || c.Usage.CompletionTokens != 5 {
		t.Fatalf("usage chunk %q", lines[5])
	}
	return c.Usage
}

func roleOf(t *testing.T, base string) (role, engineID string) {
	t.Helper()
	resp, err := http.Get(base + "/role")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var r struct {
		Role     string `json:"role"`
		EngineID string `json:"engine_id"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		t.Fatal(err)
	}
	return r.Role, r.EngineID
}

func TestDisaggregatedPrefillThenDecode(t *testing.T) {
	p := startPD(t, RolePrefill, DefaultKVTransferConfig(), 1)
	d := startPD(t, RoleDecode, DefaultKVTransferConfig(), 1)
	const bs = 16
	pRole, pID := roleOf(t, p.srv.URL)
	if dRole, dID := roleOf(t, d.srv.URL); pRole != "prefill" || dRole != "decode" || pID == "" || pID == dID {
		t.Fatalf("roles %q %q, engine ids %q %q", pRole, dRole, pID, dID)
	}
	pulled := func() float64 { return metric(t, d.srv.URL, "kvrouter_mocker_kv_transfer_blocks_pulled_total") }
	failures := func() float64 { return metric(t, d.srv.URL, "vllm:nixl_num_failed_transfers_total") }
	held := func() float64 { return metric(t, p.srv.URL, "kvrouter_mocker_kv_transfer_held_blocks") }

	// Step 1 and 2: the prefill answers exactly NixlConnector's params.
	a := ids(1000, 1) // 62 full blocks and 8 tokens
	kv, respID := prefill(t, p, a)
	var got map[string]any
	if err := json.Unmarshal(kv, &got); err != nil {
		t.Fatal(err)
	}
	keys := slices.Sorted(func(yield func(string) bool) {
		for k := range got {
			if !yield(k) {
				return
			}
		}
	})
	if want := []string{"do_remote_decode", "do_remote_prefill", "remote_block_ids", "remote_engine_id", "remote_host", "remote_port", "remote_request_id", "tp_size"}; !slices.Equal(keys, want) {
		t.Fatalf("kv_transfer_params keys %v, want %v", keys, want)
	}
	u, _ := url.Parse(p.srv.URL)
	port, _ := strconv.Atoi(u.Port())
	blockIDs, _ := got["remote_block_ids"].([]any)
	distinct := map[float64]bool{}
	for _, b := range blockIDs {
		f, ok := b.(float64)
		if !ok || f != math.Trunc(f) || f < 0 {
			t.Fatalf("block id %v is not a non-negative integer", b)
		}
		distinct[f] = true
	}
	if got["do_remote_prefill"] != true || got["do_remote_decode"] != false || len(blockIDs) != 62 || len(distinct) != 62 ||
		got["remote_engine_id"] != pID || got["remote_request_id"] != respID || got["remote_host"] != "127.0.0.1" ||
		got["remote_port"] != float64(port) || got["tp_size"] != float64(1) {
		t.Fatalf("kv_transfer_params %s (engine %q, request %q, port %d)", kv, pID, respID, port)
	}
	if h := held(); h != 62 {
		t.Fatalf("the prefill holds %v blocks, want 62", h)
	}

	// Step 3: the decode pulls all 62 blocks, prefills only the 8 tokens
	// after them, and stores the pulled blocks.
	_, mark := d.storedSince(0, bs)
	if u := complete(t, d.srv.URL, decodeReq(a, kv, false)); u.PromptTokensDetails.CachedTokens != 992 {
		t.Fatalf("usage %+v: the pulled 992 tokens are not reported cached", u)
	}
	if n := pulled(); n != 62 {
		t.Fatalf("pulled %v blocks, want 62", n)
	}
	if h := held(); h != 0 {
		t.Fatalf("the prefill still holds %v blocks after the pull", h)
	}
	if b := metric(t, d.srv.URL, "vllm:nixl_bytes_transferred_sum"); b != 62*bs*131072 {
		t.Fatalf("%v bytes transferred, want %d", b, 62*bs*131072)
	}
	stored, mark := d.storedSince(mark, bs)
	if len(stored) != 62 || !slices.Equal(slices.Concat(stored...), toU32(a[:992])) {
		t.Fatalf("the decode stored %d blocks, want the 62 pulled ones", len(stored))
	}
	// A pull of blocks already taken fails, and the request is prefilled.
	if u := complete(t, d.srv.URL, decodeReq(ids(1000, 9), kv, false)); u.PromptTokensDetails.CachedTokens != 0 || failures() != 1 {
		t.Fatalf("usage %+v, %v failures: a second pull of the same hold must fail into a local prefill", u, failures())
	}
	_, mark = d.storedSince(mark, bs)

	// A prompt sharing 40 blocks with a: only the 22 others are pulled, and
	// stored; streamed this time.
	b := slices.Concat(a[:640], ids(360, 2))
	kv, _ = prefill(t, p, b)
	if u := complete(t, d.srv.URL, decodeReq(b, kv, true)); u.PromptTokensDetails.CachedTokens != 992 {
		t.Fatalf("streamed usage %+v", u)
	}
	if n := pulled(); n != 62+22 {
		t.Fatalf("pulled %v blocks in all, want 62 + 22", n)
	}
	if stored, _ = d.storedSince(mark, bs); len(stored) != 22 || !slices.Equal(slices.Concat(stored...), toU32(b[640:992])) {
		t.Fatalf("the decode stored %d blocks, want the 22 pulled ones", len(stored))
	}
	if h := held(); h != 0 {
		t.Fatalf("the prefill still holds %v blocks", h)
	}

	// The same prompt again: the decode has every block, pulls none, but
	// still releases the prefill's hold.
	kv, _ = prefill(t, p, b)
	pulls := metric(t, d.srv.URL, "kvrouter_mocker_kv_transfer_pulls_total")
	complete(t, d.srv.URL, decodeReq(b, kv, false))
	if n := pulled(); n != 84 || held() != 0 || metric(t, d.srv.URL, "kvrouter_mocker_kv_transfer_pulls_total") != pulls+1 {
		t.Fatalf("pulled %v blocks (want 84 still), prefill holds %v", n, held())
	}

	// Without params the decode engine prefills by itself.
	if u := complete(t, d.srv.URL, decodeReq(ids(800, 3), nil, true)); u.PromptTokensDetails.CachedTokens != 0 || pulled() != 84 {
		t.Fatalf("usage %+v, %v blocks pulled", u, pulled())
	}

	// An unknown request id: the pull fails, the decode prefills.
	var bad map[string]any
	_ = json.Unmarshal(kv, &bad)
	bad["remote_request_id"] = "cmpl-unknown"
	badKV, _ := json.Marshal(bad)
	if u := complete(t, d.srv.URL, decodeReq(b, badKV, false)); u.PromptTokensDetails.CachedTokens != 992 || failures() != 2 || pulled() != 84 {
		// b is cached on the decode from before: its local prefix hit.
		t.Fatalf("usage %+v, %v failures, %v pulled", u, failures(), pulled())
	}

	// A prompt shorter than a block: no block to hold or pull.
	kv, _ = prefill(t, p, ids(10, 4))
	if !strings.Contains(string(kv), `"remote_block_ids":[]`) || held() != 0 {
		t.Fatalf("short prompt: %s, %v held", kv, held())
	}
	complete(t, d.srv.URL, decodeReq(ids(10, 4), kv, false))
	if failures() != 2 || pulled() != 84 {
		t.Fatal("a prompt without full blocks must not pull")
	}

	// A prefill engine serves a plain request plainly: nothing held, no
	// params.
	resp, body := post(t, p.srv.URL+"/v1/completions", map[string]any{"prompt": ids(100, 5), "max_tokens": 3})
	if resp.StatusCode != 200 || bytes.Contains(body, []byte("kv_transfer_params")) || held() != 0 {
		t.Fatalf("plain request on a prefill engine: %d %s", resp.StatusCode, body)
	}
}

func toU32(v []int) []uint32 {
	out := make([]uint32, len(v))
	for i, x := range v {
		out[i] = uint32(x)
	}
	return out
}

// TestUnpulledHoldExpires: blocks nobody pulls within the timeout go back to
// the cache, counted, and a late pull fails into a local prefill.
func TestUnpulledHoldExpires(t *testing.T) {
	kvcfg := DefaultKVTransferConfig()
	kvcfg.Timeout = time.Second
	p := startPD(t, RolePrefill, kvcfg, 1)
	d := startPD(t, RoleDecode, kvcfg, 1)
	prompt := ids(500, 6)
	kv, _ := prefill(t, p, prompt)
	if h := metric(t, p.srv.URL, "kvrouter_mocker_kv_transfer_held_blocks"); h != 31 {
		t.Fatalf("holds %v blocks, want 31", h)
	}
	// Only the prefill's clock moves: 1 s passes there.
	if err := p.clock.SleepUntil(context.Background(), p.clock.Now().Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	if u := complete(t, d.srv.URL, decodeReq(prompt, kv, false)); u.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("usage %+v: an expired hold was pulled", u)
	}
	if f := metric(t, d.srv.URL, "vllm:nixl_num_failed_transfers_total"); f != 1 {
		t.Fatalf("%v failures, want 1", f)
	}
	if h, x := metric(t, p.srv.URL, "kvrouter_mocker_kv_transfer_held_blocks"), metric(t, p.srv.URL, "vllm:nixl_num_kv_expired_reqs_total"); h != 0 || x != 1 {
		t.Fatalf("after the timeout: %v blocks held, %v holds expired", h, x)
	}
	if m := p.runner.Metrics(); m.CachedBlocks < 31 || m.ActiveBlocks != 0 {
		t.Fatalf("expired blocks must stay cached, unused: %+v", m)
	}
}

// TestKVTransferTimeDelaysTheFirstToken: the decode's TTFT (simulated
// seconds, counted from its arrival) is the transfer time plus the
// prefill of the tokens after the last full block, on a virtual clock.
func TestKVTransferTimeDelaysTheFirstToken(t *testing.T) {
	for _, tc := range []struct {
		name    string
		bw      float64
		speedup float64
	}{
		// 62 blocks × 16 tokens × 131072 bytes = 130023424 bytes.
		{"2 s link", 130023424 / 2.0, 1},
		{"2 s link, speedup 10", 130023424 / 2.0, 10},
		{"RDMA", 25e9, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kvcfg := DefaultKVTransferConfig()
			kvcfg.Bandwidth = tc.bw
			p := startPD(t, RolePrefill, kvcfg, tc.speedup)
			d := startPD(t, RoleDecode, kvcfg, tc.speedup)
			prompt := ids(1000, 7)
			kv, _ := prefill(t, p, prompt)
			complete(t, d.srv.URL, decodeReq(prompt, kv, false))
			transfer := 130023424 / tc.bw
			want := transfer + engine.PrefillTime(8).Seconds()
			if got := ttftSum(t, d.srv.URL); math.Abs(got-want) > 1e-6 {
				t.Fatalf("decode TTFT %gs, want %gs of transfer + %gs of prefill", got, transfer, engine.PrefillTime(8).Seconds())
			}
			if got := metric(t, d.srv.URL, "vllm:nixl_xfer_time_seconds_sum"); math.Abs(got-transfer) > 1e-6 {
				t.Fatalf("transfer time %gs, want %gs", got, transfer)
			}
		})
	}
}

// TestEachRolePlaysItsHalves: a "both" engine prefills for a remote decode
// and decodes from a remote prefill (vLLM's kv_both); a prefill engine
// ignores a remote prefill's params, a decode engine a remote decode's.
func TestEachRolePlaysItsHalves(t *testing.T) {
	for _, tc := range []struct {
		role            Role
		produce, pulled bool
	}{
		{RoleBoth, true, true},
		{RolePrefill, true, false},
		{RoleDecode, false, true},
	} {
		t.Run(string(tc.role), func(t *testing.T) {
			src := startPD(t, RolePrefill, DefaultKVTransferConfig(), 1)
			e := startPD(t, tc.role, DefaultKVTransferConfig(), 1)
			resp, body := post(t, e.srv.URL+"/v1/completions", step1(ids(100, 8)))
			if resp.StatusCode != 200 || bytes.Contains(body, []byte("kv_transfer_params")) != tc.produce || (e.runner.Metrics().HeldBlocks == 6) != tc.produce {
				t.Fatalf("%s given do_remote_decode (want it to hold: %v): %d %s", tc.role, tc.produce, resp.StatusCode, body)
			}
			prompt := ids(200, 9)
			kv, _ := prefill(t, src, prompt)
			u := complete(t, e.srv.URL, decodeReq(prompt, kv, false))
			if pulled := metric(t, e.srv.URL, "kvrouter_mocker_kv_transfer_blocks_pulled_total"); (pulled == 12) != tc.pulled || (u.PromptTokensDetails.CachedTokens == 192) != tc.pulled {
				t.Fatalf("%s given do_remote_prefill (want a pull: %v): %v blocks pulled, usage %+v", tc.role, tc.pulled, pulled, u)
			}
			if role, _ := roleOf(t, e.srv.URL); role != string(tc.role) {
				t.Fatalf("role %q", role)
			}
		})
	}
}

func TestDecodeRefusesParamsItCannotPullWith(t *testing.T) {
	d := startPD(t, RoleDecode, DefaultKVTransferConfig(), 1)
	for _, tc := range []struct{ kv, want string }{
		{`{"do_remote_prefill": true, "remote_block_ids": [1, 2]}`, "needs remote_engine_id, remote_request_id, remote_host, remote_port"},
		{`{"do_remote_prefill": true, "remote_block_ids": ["a"]}`, "kv_transfer_params.remote_block_ids"},
	} {
		resp, body := post(t, d.srv.URL+"/v1/completions", decodeReq(ids(40, 1), json.RawMessage(tc.kv), false))
		if resp.StatusCode != 400 || !strings.Contains(string(body), tc.want) {
			t.Fatalf("%s: %d %s, want 400 with %q", tc.kv, resp.StatusCode, body, tc.want)
		}
	}
	// A pull endpoint asked for nothing it holds.
	resp, body := post(t, d.srv.URL+"/kv_transfer/pull", map[string]any{"remote_engine_id": "x", "remote_request_id": "y", "block_ids": []int{1}})
	if resp.StatusCode != 404 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
}
