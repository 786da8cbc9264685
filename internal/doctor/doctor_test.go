package doctor

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// window is the observation window of the tests: long enough for a probe
// completion on a loaded machine, short enough to keep the suite quick.
const window = 1500 * time.Millisecond

// vllmMetrics is the part of vLLM's exposition kvrouter reads.
const vllmMetrics = `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1
`

// fakeEngine is an engine that gets one thing wrong at a time: an HTTP
// server with vLLM's routes and a ZMQ publisher with a replay socket that
// publishes one batch of BlockStored per completion.
type fakeEngine struct {
	health, models, tokenize, metrics int // status codes; 0 means 200
	served                            []string
	metricsBody                       string
	blockSize                         int    // of the published blocks; 0 means 16
	tokenShortfall                    int    // token ids left out of each BlockStored
	silent                            bool   // completions publish nothing
	dpRank                            *int   // the rank the batches name
	onCompletion                      func() // replaces the publishing
	encoding                          vllmevents.Encoding
	servedBefore                      bool // published one batch before doctor starts
	medium                            vllmevents.Medium
	// groups, when set, makes it a hybrid model: each completion stores
	// two blocks in each group, group_idx i of groups[i].
	groups []fakeGroup

	pub *zmqevents.Publisher
	srv *httptest.Server
}

func (f *fakeEngine) start(t *testing.T) {
	t.Helper()
	pub, err := zmqevents.NewPublisher(zmqevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	f.pub = pub
	if f.served == nil {
		f.served = []string{"m"}
	}
	if f.metricsBody == "" {
		f.metricsBody = vllmMetrics
	}
	status := func(w http.ResponseWriter, code int) bool {
		if code != 0 && code != http.StatusOK {
			http.Error(w, "no", code)
			return false
		}
		return true
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { status(w, f.health) })
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		if status(w, f.models) {
			var data []map[string]string
			for _, m := range f.served {
				data = append(data, map[string]string{"id": m, "object": "model"})
			}
			_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": data})
		}
	})
	mux.HandleFunc("POST /tokenize", func(w http.ResponseWriter, _ *http.Request) {
		if status(w, f.tokenize) {
			_, _ = w.Write([]byte(`{"count": 3, "tokens": [1, 2, 3]}`))
		}
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		if status(w, f.metrics) {
			_, _ = w.Write([]byte(f.metricsBody))
		}
	})
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, _ *http.Request) {
		switch {
		case f.onCompletion != nil:
			f.onCompletion()
		case !f.silent:
			f.publish(t)
		}
		_, _ = w.Write([]byte(`{"choices": [{"text": "x"}]}`))
	})
	f.srv = httptest.NewServer(mux)
	t.Cleanup(f.srv.Close)
	if f.servedBefore {
		f.publish(t)
	}
}

func (f *fakeEngine) publish(t *testing.T) {
	bs := f.blockSize
	if bs == 0 {
		bs = 16
	}
	tokens := make([]uint32, 2*bs-f.tokenShortfall)
	events := []vllmevents.Event{&vllmevents.BlockStored{BlockHashes: []uint64{1, 2}, TokenIDs: tokens, BlockSize: bs, Medium: f.medium}}
	if f.groups != nil {
		events = events[:0]
		for i, g := range f.groups {
			events = append(events, &vllmevents.BlockStored{BlockHashes: []uint64{1, 2}, TokenIDs: make([]uint32, 2*g.blockSize), BlockSize: g.blockSize, GroupIdx: i, KVCacheSpecKind: g.kind})
		}
	}
	payload, err := vllmevents.EncodeBatch(&vllmevents.Batch{TS: 1, DPRank: f.dpRank, Events: events}, f.encoding)
	if err != nil {
		t.Error(err)
		return
	}
	if _, err := f.pub.Publish(payload); err != nil {
		t.Error(err)
	}
}

type fakeGroup struct {
	kind      string
	blockSize int
}

func (f *fakeEngine) engine() Engine {
	return Engine{Name: "fake", URL: f.srv.URL, Events: f.pub.Endpoint(), Replay: f.pub.ReplayEndpoint(), Model: "m", DPSize: 1}
}

func run(t *testing.T, cfg Config) Report {
	t.Helper()
	if cfg.Window == 0 {
		cfg.Window = window
	}
	if cfg.ReplayTimeout == 0 {
		cfg.ReplayTimeout = 500 * time.Millisecond
	}
	r := Run(context.Background(), cfg)
	var b strings.Builder
	_ = r.WriteText(&b)
	t.Logf("report:\n%s", b.String())
	return r
}

// expect asserts one check's status and that its detail and fix say what
// they must.
func expect(t *testing.T, r Report, name string, want Status, says ...string) {
	t.Helper()
	var c Check
	found := false
	for _, x := range r.Checks {
		if x.Name == name {
			c, found = x, true
			break
		}
	}
	if !found {
		t.Fatalf("no check %q", name)
	}
	if c.Status != want {
		t.Errorf("%s: status %s, want %s (%s; fix: %s)", name, c.Status, want, c.Detail, c.Fix)
	}
	text := c.Detail + " " + c.Fix
	for _, s := range says {
		if !strings.Contains(text, s) {
			t.Errorf("%s does not say %q: %s", name, s, text)
		}
	}
}

// A simulated engine set up as the docs say passes every check: events of
// the probe arrive with the router's block size, replay answers, and the
// metrics kvrouter reads are there.
func TestMockerPassesEveryCheck(t *testing.T) {
	cfg := fleet.DefaultConfig()
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
	cfg.SpeedupRatio = 100
	f, err := fleet.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	e := f.Engines()[0]
	r := run(t, Config{
		Engines:   []Engine{{Name: "mock", URL: e.HTTPURL, Events: e.Ranks[0].Events, Replay: e.Ranks[0].Replay, Model: cfg.Server.Model}},
		Probe:     true,
		BlockSize: cfg.Engine.BlockSize,
	})
	for _, c := range r.Checks {
		if c.Status != OK {
			t.Errorf("%s: %s: %s (fix: %s)", c.Name, c.Status, c.Detail, c.Fix)
		}
	}
	for _, name := range []string{"http", "models", "tokenize", "probe", "events", "replay", "block_size", "kv_fields", "metrics", "dp_ranks"} {
		if _, ok := r.Find("mock", name); !ok {
			t.Errorf("no %s check", name)
		}
	}
	expect(t, r, "block_size", OK, fmt.Sprintf("%d-token blocks", cfg.Engine.BlockSize))
}

// The fake engine done right passes, in each shape vLLM and SGLang have
// published batches in, so that each test below fails for the one thing it
// gets wrong.
func TestFakeEnginePassesEveryCheck(t *testing.T) {
	for _, enc := range []vllmevents.Encoding{vllmevents.EncodingArray, vllmevents.EncodingMap, vllmevents.EncodingMapBatch} {
		t.Run(enc.String(), func(t *testing.T) {
			t.Parallel()
			f := &fakeEngine{encoding: enc}
			f.start(t)
			r := run(t, Config{Engines: []Engine{f.engine()}, Probe: true, BlockSize: 16})
			if r.Count(Fail)+r.Count(Warn) != 0 {
				t.Errorf("%d failed, %d warnings on a well-configured engine", r.Count(Fail), r.Count(Warn))
			}
		})
	}
}

func TestEachMisconfigurationIsNamedWithItsFix(t *testing.T) {
	rank1 := 1
	cases := []struct {
		name  string
		fake  fakeEngine
		probe bool
		edit  func(*Engine)
		check string
		want  Status
		says  []string
	}{
		{name: "idle engine without probe", fake: fakeEngine{}, check: "events", want: Warn, says: []string{"no batch", "cannot tell", "--probe-request"}},
		{name: "idle engine that served before, without probe", fake: fakeEngine{servedBefore: true}, check: "events", want: Warn,
			says: []string{"no batch", "replay endpoint holds 1", "cannot tell", "--probe-request"}},
		{name: "no events endpoint", fake: fakeEngine{}, edit: func(e *Engine) { e.Events = "" }, check: "events", want: Fail, says: []string{"no events endpoint", "--no-router-kv-events"}},
		{name: "no events although probed", fake: fakeEngine{silent: true}, probe: true, check: "events", want: Fail,
			says: []string{"although a completion was sent", `"enable_kv_cache_events": true`, `"publisher": "zmq"`}},
		{name: "nothing listens on the events port", fake: fakeEngine{}, probe: true, edit: func(e *Engine) { e.Events = deadEndpoint(t) }, check: "events", want: Fail,
			says: []string{"could not connect", "tcp://*:"}},
		{name: "events endpoint of another engine", fake: fakeEngine{}, probe: true, edit: func(e *Engine) { e.Events = otherPublisher(t) }, check: "events", want: Fail,
			says: []string{"replay endpoint holds 1", "different engines or ranks"}},
		{name: "replay not answering", fake: fakeEngine{}, probe: true, edit: func(e *Engine) { e.Replay = deadEndpoint(t) }, check: "replay", want: Fail,
			says: []string{"did not answer", `"replay_endpoint"`}},
		{name: "no replay endpoint", fake: fakeEngine{}, probe: true, edit: func(e *Engine) { e.Replay = "" }, check: "replay", want: Warn,
			says: []string{"no replay endpoint", "replay=tcp://"}},
		{name: "another block size", fake: fakeEngine{blockSize: 32}, probe: true, check: "block_size", want: Warn,
			says: []string{"32-token blocks, the router uses 16", "--kv-cache-block-size 32", "--block-size 16", "--page-size 16"}},
		{name: "token ids that do not fill the blocks", fake: fakeEngine{tokenShortfall: 5}, probe: true, check: "block_size", want: Fail,
			says: []string{"2 blocks of 16 tokens with 27 token ids"}},
		{name: "hybrid model", fake: fakeEngine{groups: []fakeGroup{{"sliding_window", 32}, {"full_attention", 16}, {"mamba", 64}}}, probe: true, check: "block_size", want: OK,
			says: []string{"16-token blocks, as the router", "it indexes group 1 (full_attention)", "not honoured: kv_cache_spec_kind=mamba"}},
		{name: "sliding window only", fake: fakeEngine{groups: []fakeGroup{{"sliding_window", 16}}}, probe: true, check: "block_size", want: Fail,
			says: []string{"no KV-cache group the router can index, only kv_cache_spec_kind=sliding_window", "--no-router-kv-events"}},
		{name: "no block stored seen", fake: fakeEngine{silent: true}, probe: true, check: "block_size", want: Warn, says: []string{"not checked"}},
		{name: "no /tokenize", fake: fakeEngine{tokenize: http.StatusNotFound}, probe: true, check: "tokenize", want: Fail,
			says: []string{"status 404", "answers them 502", "token-id prompts"}},
		{name: "HTTP 404 everywhere", fake: fakeEngine{health: http.StatusNotFound, models: http.StatusNotFound}, check: "http", want: Fail,
			says: []string{"answers 404", "without /v1"}},
		{name: "no /health", fake: fakeEngine{health: http.StatusNotFound}, probe: true, check: "http", want: Fail,
			says: []string{"/health answers 404, /v1/models 200", "only while GET /health answers 200"}},
		{name: "engine down", fake: fakeEngine{}, edit: func(e *Engine) { e.URL = "http://" + deadAddr(t) }, check: "http", want: Fail,
			says: []string{"connection refused", "start the engine"}},
		{name: "metrics missing", fake: fakeEngine{metricsBody: "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 0\n"}, probe: true, check: "metrics", want: Warn,
			says: []string{"missing vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc"}},
		{name: "no /metrics", fake: fakeEngine{metrics: http.StatusNotFound}, probe: true, check: "metrics", want: Warn, says: []string{"status 404"}},
		{name: "wrong model name", fake: fakeEngine{served: []string{"llama-3"}}, probe: true, edit: func(e *Engine) { e.Model = "llama" }, check: "models", want: Fail,
			says: []string{`model="llama" is not served`, `"llama-3"`, "set model=llama-3"}},
		{name: "no model given", fake: fakeEngine{}, probe: true, edit: func(e *Engine) { e.Model = "" }, check: "models", want: Warn, says: []string{"add model=m"}},
		{name: "more ranks in the metrics than dp", fake: fakeEngine{metricsBody: vllmMetrics + `vllm:num_requests_running{engine="1",model_name="m"} 0` + "\n"}, probe: true,
			check: "dp_ranks", want: Fail, says: []string{"2 data-parallel ranks, the worker dp=1", "set dp=2"}},
		{name: "events naming another rank", fake: fakeEngine{dpRank: &rank1}, probe: true, check: "dp_ranks", want: Fail, says: []string{"carries rank 1"}},
		{name: "a medium the router does not know", fake: fakeEngine{medium: "TAPE"}, probe: true, check: "kv_fields", want: Warn,
			says: []string{"does not honour", "medium=unknown (", "docs/engines.md", "kvrouter_worker_kv_events_unsupported_total"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := tc.fake
			f.start(t)
			e := f.engine()
			if tc.edit != nil {
				tc.edit(&e)
			}
			r := run(t, Config{Engines: []Engine{e}, Probe: tc.probe, BlockSize: 16})
			expect(t, r, tc.check, tc.want, tc.says...)
		})
	}
}

// An engine routed without events (--no-router-kv-events) needs none: its
// HTTP side alone is checked.
func TestWithoutEventsOnlyHTTPIsChecked(t *testing.T) {
	f := &fakeEngine{}
	f.start(t)
	e := f.engine()
	e.Events, e.Replay = "", ""
	r := run(t, Config{Engines: []Engine{e}, NoEvents: true})
	if r.Count(OK) != len(r.Checks) {
		t.Errorf("%d of %d checks ok", r.Count(OK), len(r.Checks))
	}
	expect(t, r, "events", OK, "not checked")
	for _, name := range []string{"replay", "block_size", "dp_ranks"} {
		if _, ok := r.Find("fake", name); ok {
			t.Errorf("%s checked without events", name)
		}
	}
}

// A data-parallel engine is checked rank by rank, each on its own port.
func TestRanksAreCheckedOnConsecutivePorts(t *testing.T) {
	base := consecutivePorts(t, 2)
	var pubs []*zmqevents.Publisher
	for r := range 2 {
		pub, err := zmqevents.NewPublisher(zmqevents.PublisherConfig{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", base+r)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = pub.Close() })
		pubs = append(pubs, pub)
	}
	// Rank 1 stays silent: a rank without traffic.
	var once sync.Once
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, _ *http.Request) {
		once.Do(func() {
			zero := 0
			payload, _ := vllmevents.EncodeBatch(&vllmevents.Batch{DPRank: &zero, Events: []vllmevents.Event{&vllmevents.AllBlocksCleared{}}}, vllmevents.EncodingArray)
			_, _ = pubs[0].Publish(payload)
		})
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	r := run(t, Config{Engines: []Engine{{Name: "dp", URL: srv.URL, Events: fmt.Sprintf("tcp://127.0.0.1:%d", base), DPSize: 2}}, Probe: true})
	expect(t, r, "events[0]", OK, "1 AllBlocksCleared")
	expect(t, r, "events[1]", Warn, fmt.Sprintf("127.0.0.1:%d", base+1), "while other ranks published")
	expect(t, r, "dp_ranks", Warn, "events from ranks [0] of 2")
}

// A publisher that loses batches, or sends messages of another shape, is
// told apart from a healthy one.
func TestLossesAndForeignMessagesAreReported(t *testing.T) {
	payload, err := vllmevents.EncodeBatch(&vllmevents.Batch{Events: []vllmevents.Event{&vllmevents.AllBlocksCleared{}}}, vllmevents.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		frames [][][]byte
		want   Status
		says   []string
	}{
		{"gap", [][][]byte{{nil, zmqevents.EncodeSeq(0), payload}, {nil, zmqevents.EncodeSeq(5), payload}}, Warn, []string{"1 gaps (4 batches lost", `"hwm"`}},
		{"foreign", [][][]byte{{[]byte("x"), []byte("y")}, {nil, zmqevents.EncodeSeq(0), []byte("not msgpack")}}, Fail, []string{"2 messages", "none a KV-event batch"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pub := zmq4.NewPub(context.Background())
			t.Cleanup(func() { _ = pub.Close() })
			if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
				t.Fatal(err)
			}
			f := &fakeEngine{onCompletion: func() {
				for _, fr := range tc.frames {
					if err := pub.SendMulti(zmq4.NewMsgFrom(fr...)); err != nil {
						t.Error(err)
					}
				}
			}}
			f.start(t)
			e := f.engine()
			e.Events, e.Replay = "tcp://"+pub.Addr().String(), ""
			r := run(t, Config{Engines: []Engine{e}, Probe: true})
			expect(t, r, "events", tc.want, tc.says...)
		})
	}
}

// deadAddr is a loopback address nothing listens on.
func deadAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

func deadEndpoint(t *testing.T) string { return "tcp://" + deadAddr(t) }

// otherPublisher is the events endpoint of another engine, which holds
// nothing and publishes nothing.
func otherPublisher(t *testing.T) string {
	pub, err := zmqevents.NewPublisher(zmqevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub.Endpoint()
}

// consecutivePorts finds n free consecutive loopback ports, as a
// data-parallel engine binds them.
func consecutivePorts(t *testing.T, n int) int {
	for range 50 {
		first, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		base := first.Addr().(*net.TCPAddr).Port
		ls := []net.Listener{first}
		ok := true
		for i := 1; i < n; i++ {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", base+i))
			if err != nil {
				ok = false
				break
			}
			ls = append(ls, l)
		}
		for _, l := range ls {
			l.Close()
		}
		if ok {
			return base
		}
	}
	t.Fatal("no consecutive free ports")
	return 0
}
