package serve

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

func getBody(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	_, _ = b.ReadFrom(resp.Body)
	return b.String()
}

// An engine whose KV events carry media the router does not know: counted
// per engine and field in /metrics, and shown in /health and on the
// dashboard, with the one bounded label whatever the engine sent.
func TestUnsupportedFieldsAreExported(t *testing.T) {
	pub, err := zmqevents.NewPublisher(zmqevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	tokens := make([]uint32, 16)
	for i := range tokens {
		tokens[i] = uint32(500 + i)
	}
	payload, err := vllmevents.EncodeBatch(&vllmevents.Batch{TS: 1, Events: []vllmevents.Event{
		&vllmevents.BlockStored{BlockHashes: []uint64{1}, TokenIDs: tokens, BlockSize: 16, Medium: "TAPE"},
		&vllmevents.BlockStored{BlockHashes: []uint64{2}, TokenIDs: tokens, BlockSize: 16, Medium: "MOON_\"BASE\""},
		&vllmevents.BlockStored{BlockHashes: []uint64{3}, TokenIDs: tokens, BlockSize: 16, Medium: "GPU", CacheSalt: "t"},
	}}, vllmevents.EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	// Published before the router starts: its source replays it.
	if _, err := pub.Publish(payload); err != nil {
		t.Fatal(err)
	}
	ws := spec(1, silentFleet(t))
	ws.Events, ws.Replay = pub.Endpoint(), pub.ReplayEndpoint()
	s := startServer(t, ws)
	testwait.Until(t, 10*time.Second, "the batch to be applied", func() bool { return s.Sources(1)[0].Stats().Batches >= 1 })

	if m := getBody(t, s.URL()+"/metrics"); !strings.Contains(m, `kvrouter_worker_kv_events_unsupported_total{field="medium=unknown",worker_id="1"} 2`) {
		t.Fatalf("metric missing:\n%s", m)
	}
	var h struct {
		Status  string `json:"status"`
		Workers []struct {
			ID          uint64            `json:"id"`
			Unsupported map[string]uint64 `json:"kv_events_unsupported"`
		} `json:"workers"`
		Notes []string `json:"notes"`
	}
	if body := getBody(t, s.URL()+"/health"); json.Unmarshal([]byte(body), &h) != nil || len(h.Workers) != 1 ||
		h.Workers[0].Unsupported["medium=unknown"] != 2 || len(h.Workers[0].Unsupported) != 1 || len(h.Notes) != 1 || strings.Contains(body, "MOON") {
		t.Fatalf("/health: %s", body)
	}
	if body := getBody(t, s.URL()+"/ui/api/state"); !strings.Contains(body, `"kv_events_unsupported":[{"field":"medium=unknown","count":2}]`) {
		t.Fatalf("/ui/api/state: %s", body)
	}
}
