package indexer

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// mockFleet starts n fast simulated engines publishing KV events.
func mockFleet(t *testing.T, n int) (*fleet.Fleet, fleet.Config) {
	t.Helper()
	cfg := fleet.DefaultConfig()
	cfg.NumWorkers = n
	cfg.SpeedupRatio = 100
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
	f, err := fleet.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return f, cfg
}

func startIndexer(t *testing.T, cfg Config) *Service {
	t.Helper()
	cfg.Addr = "127.0.0.1:0"
	s, err := Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// call sends body (JSON unless it is already bytes) and returns the status
// and the answer.
func call(t *testing.T, method, url, contentType string, body any) (int, []byte) {
	t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case []byte:
		rd = bytes.NewReader(b)
	case string:
		rd = strings.NewReader(b)
	default:
		j, _ := json.Marshal(b)
		rd = bytes.NewReader(j)
	}
	req, _ := http.NewRequest(method, url, rd)
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, out
}

type score struct {
	Scores      map[string]map[string]uint32 `json:"scores" msgpack:"scores"`
	Frequencies []int                        `json:"frequencies" msgpack:"frequencies"`
	Instances   map[string]struct {
		LongestMatched uint32            `json:"longest_matched" msgpack:"longest_matched"`
		GPU            uint32            `json:"gpu" msgpack:"gpu"`
		DP             map[string]uint32 `json:"dp" msgpack:"dp"`
		CPU            uint32            `json:"cpu" msgpack:"cpu"`
		Disk           uint32            `json:"disk" msgpack:"disk"`
	} `json:"instances" msgpack:"instances"`
}

func query(t *testing.T, base string, body any) score {
	t.Helper()
	code, b := call(t, "POST", base+"/query", "application/json", body)
	if code != http.StatusOK {
		t.Fatalf("query: %d %s", code, b)
	}
	var s score
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatalf("query answer %s: %v", b, err)
	}
	return s
}

// complete sends prompt to an engine directly, as a gateway would once it
// has chosen.
func complete(t *testing.T, e fleet.Engine, model string, prompt []uint32) {
	t.Helper()
	code, b := call(t, "POST", e.HTTPURL+"/v1/completions", "application/json", map[string]any{"model": model, "prompt": prompt, "max_tokens": 1})
	if code != http.StatusOK {
		t.Fatalf("completion: %d %s", code, b)
	}
}

func prompt(seed uint32, n int) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = seed*1000 + uint32(i)%900 + 1
	}
	return p
}

func register(t *testing.T, base string, id uint64, e fleet.Engine, model string, blockSize int) {
	t.Helper()
	code, b := call(t, "POST", base+"/register", "application/json", map[string]any{
		"instance_id": id, "endpoint": e.Ranks[0].Events, "replay_endpoint": e.Ranks[0].Replay,
		"model_name": model, "block_size": blockSize,
	})
	if code != http.StatusCreated {
		t.Fatalf("register: %d %s", code, b)
	}
}

// Two real engines registered over the API: the prompts each served are
// credited to it alone, in tokens, by token ids, by block hashes and in
// MessagePack.
func TestIndexerScoresRegisteredEngines(t *testing.T) {
	f, cfg := mockFleet(t, 2)
	bs := cfg.Engine.BlockSize
	model := cfg.Server.Model
	s := startIndexer(t, Config{})
	base := s.URL()
	es := f.Engines()
	register(t, base, 11, es[0], model, bs)
	register(t, base, 22, es[1], model, bs)

	pa, pb := prompt(1, 4*bs), prompt(2, 2*bs)
	complete(t, es[0], model, pa)
	complete(t, es[1], model, pb)
	testwait.Until(t, 30*time.Second, "both prompts indexed", func() bool {
		sa, sb := query(t, base, map[string]any{"token_ids": pa, "model_name": model}), query(t, base, map[string]any{"token_ids": pb, "model_name": model})
		return sa.Scores["11"]["0"] == uint32(4*bs) && sb.Scores["22"]["0"] == uint32(2*bs)
	})
	sa := query(t, base, map[string]any{"token_ids": pa, "model_name": model, "routing_group": "default"})
	if sa.Scores["22"]["0"] != 0 || len(sa.Frequencies) != 4 || sa.Frequencies[0] != 1 {
		t.Errorf("engine 22 never saw prompt a: %+v", sa)
	}
	in := sa.Instances["11"]
	if in.GPU != uint32(4*bs) || in.LongestMatched != in.GPU || in.CPU != in.GPU || in.Disk != in.GPU || in.DP["0"] != in.GPU {
		t.Errorf("instance 11's breakdown: %+v", in)
	}
	if _, listed := sa.Instances["22"]; listed {
		t.Errorf("an instance holding nothing of the prompt is listed: %+v", sa.Instances)
	}

	// A longer prompt sharing a's first two blocks matches two blocks.
	long := append(append([]uint32{}, pa[:2*bs]...), prompt(9, 3*bs)...)
	if got := query(t, base, map[string]any{"token_ids": long, "model_name": model}).Scores["11"]["0"]; got != uint32(2*bs) {
		t.Errorf("shared prefix: %d tokens, want %d", got, 2*bs)
	}

	// By block hashes: the local hashes the engine's tokens give, signed
	// as Dynamo sends them.
	local := blockhash.New(bs, "").LocalHashes(pa)
	signed := make([]int64, len(local))
	for i, h := range local {
		signed[i] = int64(h)
	}
	code, b := call(t, "POST", base+"/query_by_hash", "application/json", map[string]any{"block_hashes": signed, "model_name": model})
	var byHash score
	if code != http.StatusOK || json.Unmarshal(b, &byHash) != nil || byHash.Scores["11"]["0"] != uint32(4*bs) {
		t.Errorf("query_by_hash: %d %s", code, b)
	}

	// MessagePack in, MessagePack out.
	mp, _ := msgpack.Marshal(map[string]any{"token_ids": pa, "model_name": model})
	req, _ := http.NewRequest("POST", base+"/query", bytes.NewReader(mp))
	req.Header.Set("Content-Type", "application/msgpack")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var viaMP score
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/msgpack" || msgpack.Unmarshal(body, &viaMP) != nil || viaMP.Scores["11"]["0"] != uint32(4*bs) {
		t.Errorf("msgpack query: %d %q %v", resp.StatusCode, resp.Header.Get("Content-Type"), viaMP)
	}

	// A salted query does not match unsalted blocks.
	if got := query(t, base, map[string]any{"token_ids": pa, "model_name": model, "cache_salt": "tenant-a"}).Scores["11"]["0"]; got != 0 {
		t.Errorf("salted query matched %d unsalted tokens", got)
	}

	// /workers lists both, active; /dump holds engine 11's blocks.
	code, b = call(t, "GET", base+"/workers?model_name="+model, "", nil)
	var ws []struct {
		InstanceID uint64            `json:"instance_id"`
		Status     string            `json:"status"`
		BlockSize  int               `json:"block_size"`
		Endpoints  map[string]string `json:"endpoints"`
	}
	if code != http.StatusOK || json.Unmarshal(b, &ws) != nil || len(ws) != 2 || ws[0].InstanceID != 11 || ws[0].Status != "active" || ws[0].BlockSize != bs || ws[0].Endpoints["0"] != es[0].Ranks[0].Events {
		t.Errorf("workers: %d %s", code, b)
	}
	code, b = call(t, "GET", base+"/dump", "", nil)
	var dump map[string]struct {
		BlockSize int               `json:"block_size"`
		Events    []json.RawMessage `json:"events"`
	}
	if code != http.StatusOK || json.Unmarshal(b, &dump) != nil || dump[model+":default"].BlockSize != bs || len(dump[model+":default"].Events) < 6 {
		t.Errorf("dump: %d %.300s", code, b)
	}

	// Unregistering drops the instance's blocks.
	if code, b := call(t, "POST", base+"/unregister", "application/json", map[string]any{"instance_id": 11, "model_name": model}); code != http.StatusOK {
		t.Fatalf("unregister: %d %s", code, b)
	}
	if got := query(t, base, map[string]any{"token_ids": pa, "model_name": model}); got.Scores["11"] != nil {
		t.Errorf("unregistered instance still scored: %+v", got.Scores)
	}
	if code, _ := call(t, "POST", base+"/unregister", "application/json", map[string]any{"instance_id": 11, "model_name": model}); code != http.StatusNotFound {
		t.Errorf("unregistering twice: %d, want 404", code)
	}
}

// Malformed input gets a clear 4xx with {"error": ...}; nothing panics.
func TestIndexerRejectsMalformedInput(t *testing.T) {
	f, cfg := mockFleet(t, 1)
	s := startIndexer(t, Config{})
	base := s.URL()
	e := f.Engines()[0]
	register(t, base, 1, e, "m", cfg.Engine.BlockSize)
	cases := []struct {
		method, path, ctype string
		body                any
		want                int
		says                string
	}{
		{"POST", "/query", "application/json", `{"token_ids": [1, 2`, 400, "not valid JSON"},
		{"POST", "/query", "application/json", `{"token_ids": "abc", "model_name": "m"}`, 400, "token_ids"},
		{"POST", "/query", "application/json", `{"token_ids": [-1], "model_name": "m"}`, 400, "token_ids"},
		{"POST", "/query", "application/json", `{"model_name": "m"}`, 400, "token_ids is required"},
		{"POST", "/query", "application/json", `{"token_ids": [1]}`, 400, "model_name is required"},
		{"POST", "/query", "application/json", ``, 400, "empty"},
		{"POST", "/query", "application/msgpack", []byte{0xc1, 0xff}, 400, "MessagePack"},
		{"POST", "/query", "application/json", `{"token_ids": [1], "model_name": "other"}`, 404, "no indexer for model=other"},
		{"POST", "/query", "application/json", `{"token_ids": [1], "model_name": "m", "routing_group": "g2"}`, 404, "routing_group=g2"},
		{"POST", "/query_by_hash", "application/json", `{"block_hashes": [1], "model_name": "m", "cache_salt": ""}`, 400, "cache_salt must be omitted"},
		{"POST", "/query_by_hash", "application/json", `{"block_hashes": [1.5], "model_name": "m"}`, 400, "block_hashes"},
		{"POST", "/query_by_hash", "application/json", `{"block_hashes": [18446744073709551616], "model_name": "m"}`, 400, "block_hashes"},
		{"POST", "/register", "application/json", `{"endpoint": "tcp://x:1", "model_name": "m", "block_size": 16}`, 400, "instance_id is required"},
		{"POST", "/register", "application/json", `{"instance_id": 2, "endpoint": "tcp://x:1", "model_name": "m"}`, 400, "block_size"},
		{"POST", "/register", "application/json", `{"instance_id": 2, "endpoint": "http://x:1", "model_name": "m", "block_size": 16}`, 400, "ZMQ address"},
		{"POST", "/register", "application/json", `{"instance_id": 2, "endpoint": "tcp://x:1", "model_name": "m", "block_size": 32}`, 409, "blocks of 16 tokens"},
		{"POST", "/register", "application/json", `{"instance_id": 1, "endpoint": "tcp://127.0.0.1:1", "model_name": "m", "block_size": 16}`, 409, "is registered with endpoint"},
		{"POST", "/unregister", "application/json", `{"instance_id": 7, "model_name": "m"}`, 404, "not registered"},
		{"POST", "/unregister", "application/json", `{"model_name": "m"}`, 400, "instance_id is required"},
		{"POST", "/register_peer", "application/json", `{"url": "peer:8090"}`, 400, "base URL"},
		{"POST", "/deregister_peer", "application/json", `{"url": "http://nobody:1"}`, 404, "peer not found"},
		{"GET", "/query", "", nil, 405, "use POST"},
		{"POST", "/workers", "", nil, 405, "use GET"},
		{"GET", "/nothing", "", nil, 404, "no route"},
	}
	for _, c := range cases {
		code, b := call(t, c.method, base+c.path, c.ctype, c.body)
		var e struct {
			Error string `json:"error" msgpack:"error"`
		}
		unmarshal := json.Unmarshal
		if c.ctype == "application/msgpack" { // answered in the request's format
			unmarshal = msgpack.Unmarshal
		}
		if code != c.want || unmarshal(b, &e) != nil || !strings.Contains(e.Error, c.says) {
			t.Errorf("%s %s %v: %d %s, want %d saying %q", c.method, c.path, c.body, code, b, c.want, c.says)
		}
	}
	if code, b := call(t, "GET", base+"/health", "", nil); code != http.StatusOK || !strings.Contains(string(b), `"ok"`) {
		t.Errorf("health: %d %s", code, b)
	}
	code, b := call(t, "GET", base+"/metrics", "", nil)
	if code != http.StatusOK || !strings.Contains(string(b), `dynamo_kvindexer_errors_total{endpoint="/query",status_class="4xx"}`) || !strings.Contains(string(b), "dynamo_kvindexer_workers 1") {
		t.Errorf("metrics: %d %.2000s", code, b)
	}
}

// An engine registered after it cached a prompt: the indexer asks the
// engine's replay endpoint for the history it missed, as serve does.
func TestIndexerReplaysHistoryFromTheEngine(t *testing.T) {
	f, cfg := mockFleet(t, 1)
	bs, model := cfg.Engine.BlockSize, cfg.Server.Model
	e := f.Engines()[0]
	p := prompt(5, 3*bs)
	complete(t, e, model, p)
	s := startIndexer(t, Config{})
	register(t, s.URL(), 3, e, model, bs)
	testwait.Until(t, 30*time.Second, "the replayed history is indexed", func() bool {
		return query(t, s.URL(), map[string]any{"token_ids": p, "model_name": model}).Scores["3"]["0"] == uint32(3*bs)
	})
}

// indexedPeer starts one engine and indexer a following it as instance 4,
// and has the engine serve p, a prompt of 2 blocks, until a indexes it.
// indexed reports whether an indexer credits instance 4 with all of a
// prompt.
func indexedPeer(t *testing.T) (e fleet.Engine, model string, a *Service, p []uint32, indexed func(base string, pr []uint32) bool) {
	t.Helper()
	f, cfg := mockFleet(t, 1)
	bs := cfg.Engine.BlockSize
	e, model = f.Engines()[0], cfg.Server.Model
	a = startIndexer(t, Config{})
	register(t, a.URL(), 4, e, model, bs)
	indexed = func(base string, pr []uint32) bool {
		return query(t, base, map[string]any{"token_ids": pr, "model_name": model}).Scores["4"]["0"] == uint32(len(pr))
	}
	p = prompt(6, 2*bs)
	complete(t, e, model, p)
	testwait.Until(t, 30*time.Second, "indexer a indexes p", func() bool { return indexed(a.URL(), p) })
	return e, model, a, p, indexed
}

// A peer's dump is older than the engine's stream whenever the engine
// publishes between the dump and the new indexer's subscription joining
// the stream (ZeroMQ delivers nothing published before a subscriber has
// joined). Those batches reach the recovered indexer only by replay from
// the engine, so recovery takes each rank's replay endpoint from the
// peer's workers. Here the peer answers with a dump taken before q was
// served: q is in no dump and on no live stream b can see.
func TestIndexerRecoveredFromAStaleDumpReplaysTheRest(t *testing.T) {
	e, model, a, p, indexed := indexedPeer(t)
	q := prompt(7, len(p))
	code, staleDump := call(t, "GET", a.URL()+"/dump", "", nil)
	if code != http.StatusOK {
		t.Fatalf("dump: %d %s", code, staleDump)
	}
	complete(t, e, model, q)
	testwait.Until(t, 30*time.Second, "indexer a indexes q", func() bool { return indexed(a.URL(), q) })

	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/dump" {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(staleDump)
			return
		}
		resp, err := http.Get(a.URL() + r.URL.Path)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, resp.Body)
	}))
	t.Cleanup(peer.Close)
	b := startIndexer(t, Config{Peers: []string{peer.URL}})
	if !indexed(b.URL(), p) {
		t.Errorf("b did not recover p from the peer's dump")
	}
	testwait.Until(t, 15*time.Second, "indexer b replays q from the engine", func() bool { return indexed(b.URL(), q) })
	code, body := call(t, "GET", b.URL()+"/workers", "", nil)
	if code != http.StatusOK || !strings.Contains(string(body), `"replay_endpoint":"`+e.Ranks[0].Replay+`"`) {
		t.Errorf("b's workers do not pass the replay endpoint on: %d %s", code, body)
	}
}

// A second indexer started with --peers recovers the first one's
// workers and index before the engine publishes anything new, and lists
// its peers; peers registered later are listed too.
func TestIndexerRecoversFromAPeer(t *testing.T) {
	e, model, a, p, indexed := indexedPeer(t)
	b := startIndexer(t, Config{Peers: []string{"http://127.0.0.1:1", a.URL()}})
	// Recovery runs before b serves: its first answer already holds p.
	if !indexed(b.URL(), p) {
		t.Errorf("b did not recover p")
	}
	code, body := call(t, "GET", b.URL()+"/workers", "", nil)
	if code != http.StatusOK || !strings.Contains(string(body), e.Ranks[0].Events) {
		t.Errorf("b's workers: %d %s", code, body)
	}
	// b follows the engine from its first moment: a prompt served before
	// b's subscription has joined the engine's stream is replayed from
	// the engine.
	q := prompt(7, len(p))
	complete(t, e, model, q)
	testwait.Until(t, 30*time.Second, "indexer b indexes q", func() bool { return indexed(b.URL(), q) })
	if code, body := call(t, "POST", b.URL()+"/register_peer", "application/json", map[string]any{"url": "http://peer-c:8090"}); code != http.StatusCreated {
		t.Fatalf("register_peer: %d %s", code, body)
	}
	code, body = call(t, "GET", b.URL()+"/peers", "", nil)
	var peers []string
	if code != http.StatusOK || json.Unmarshal(body, &peers) != nil || len(peers) != 3 || peers[1] != a.URL() || peers[2] != "http://peer-c:8090" {
		t.Errorf("peers: %d %s", code, body)
	}
	if code, body := call(t, "POST", b.URL()+"/deregister_peer", "application/json", map[string]any{"url": "http://peer-c:8090"}); code != http.StatusOK {
		t.Errorf("deregister_peer: %d %s", code, body)
	}
}

// A batch the engine publishes after the indexer's start-up catch-up and
// before its subscription has joined the engine's stream (ZeroMQ sends a
// subscriber nothing from before it joined) is indexed as the subscription
// joins, with the silence probe off. The engine's PUB socket binds only
// after the catch-up, so the subscription cannot join earlier.
func TestIndexerCatchesUpWhenItsSubscriptionJoins(t *testing.T) {
	const bs = 16
	engine, err := zmqevents.NewPublisher(zmqevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = engine.Close() })
	// The indexer subscribes to a port nothing listens on yet; the
	// engine's replay endpoint answers from the start.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	events := "tcp://" + l.Addr().String()
	_ = l.Close()
	p := prompt(8, 2*bs)
	publish := func(block int) {
		t.Helper()
		var parent *uint64
		if block > 0 {
			parent = kv.Ptr(uint64(900 + block - 1))
		}
		payload, err := vllmevents.EncodeBatch(&vllmevents.Batch{TS: 1, Events: []vllmevents.Event{&vllmevents.BlockStored{
			BlockHashes: []uint64{uint64(900 + block)}, ParentBlockHash: parent, TokenIDs: p[block*bs : (block+1)*bs], BlockSize: bs, Medium: "GPU",
		}}}, vllmevents.EncodingArray)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := engine.Publish(payload); err != nil {
			t.Fatal(err)
		}
	}
	publish(0)
	s := startIndexer(t, Config{SilenceProbe: -1})
	code, b := call(t, "POST", s.URL()+"/register", "application/json", map[string]any{
		"instance_id": 9, "endpoint": events, "replay_endpoint": engine.ReplayEndpoint(), "model_name": "m", "block_size": bs,
	})
	if code != http.StatusCreated {
		t.Fatalf("register: %d %s", code, b)
	}
	matched := func() uint32 {
		return query(t, s.URL(), map[string]any{"token_ids": p, "model_name": "m"}).Scores["9"]["0"]
	}
	testwait.Until(t, 10*time.Second, "the start-up catch-up indexes the first block", func() bool { return matched() == bs })
	publish(1) // nobody subscribed: only the replay ring has it
	pub := zmq4.NewPub(context.Background(), zmq4.WithLogger(log.New(io.Discard, "", 0)))
	t.Cleanup(func() { _ = pub.Close() })
	if err := pub.Listen(events); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 10*time.Second, "the block published before the subscription joined is indexed", func() bool { return matched() == 2*bs })
}
