package indexerapi

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/core/router"
)

// A remote that fails is left alone for its back-off: decisions in that
// window do not wait for it; after it, one asks again, and an answer ends
// the degraded state.
func TestRemoteBacksOffAndRecovers(t *testing.T) {
	var calls atomic.Int32
	var failing atomic.Bool
	failing.Store(true)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if failing.Load() {
			http.Error(w, `{"error":"boom"}`, http.StatusInternalServerError)
			return
		}
		var q QueryByHashRequest
		d := msgpack.NewDecoder(r.Body)
		d.SetCustomStructTag("json")
		if err := d.Decode(&q); err != nil || q.ModelName != "m" || len(q.BlockHashes) != 2 || q.RoutingGroup != "default" {
			t.Errorf("request %+v %v", q, err)
		}
		write(w, r, http.StatusOK, Score{Scores: map[string]map[string]uint32{"5": {"1": 32}}, Instances: map[string]Instance{"5": {GPU: 32, CPU: 48, Disk: 48}}})
	}))
	defer srv.Close()
	now := time.Unix(0, 0)
	c, err := NewRemote(RemoteConfig{URL: srv.URL, BlockSize: 16, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	q := router.RemoteQuery{Model: "m", Local: []uint64{1, 1 << 63}}
	if _, _, err := c.Overlaps(q); err == nil || c.Health() == "" {
		t.Fatalf("a failing remote: %v, health %q", err, c.Health())
	}
	for range 5 {
		if _, _, err := c.Overlaps(q); err == nil {
			t.Fatal("answered during the back-off")
		}
	}
	if calls.Load() != 1 {
		t.Errorf("%d calls during the back-off, want 1", calls.Load())
	}
	failing.Store(false)
	now = now.Add(minRemoteBackoff)
	dev, tiers, err := c.Overlaps(q)
	if err != nil || len(dev) != 1 || dev[0].Worker.ID != 5 || dev[0].Worker.DPRank != 1 || dev[0].Blocks != 2 || c.Health() != "" {
		t.Fatalf("after the back-off: %+v %v, health %q", dev, err, c.Health())
	}
	if len(tiers) != 1 || tiers[0].Host != 3 || tiers[0].Device != 2 {
		t.Errorf("tiers %+v", tiers)
	}
}

// Block hashes are read signed or unsigned, in JSON and MessagePack.
func TestHashesSignedOrUnsigned(t *testing.T) {
	var q QueryByHashRequest
	if err := json.Unmarshal([]byte(`{"block_hashes":[-1, 18446744073709551615, 7]}`), &q); err != nil || q.BlockHashes[0] != q.BlockHashes[1] || q.BlockHashes[2] != 7 {
		t.Errorf("JSON: %v %v", q.BlockHashes, err)
	}
	var buf bytes.Buffer
	_ = msgpack.NewEncoder(&buf).Encode(map[string]any{"block_hashes": []any{int64(-1), uint64(1<<64 - 1), int8(3)}})
	d := msgpack.NewDecoder(&buf)
	d.SetCustomStructTag("json")
	q = QueryByHashRequest{}
	if err := d.Decode(&q); err != nil || q.BlockHashes[0] != q.BlockHashes[1] || q.BlockHashes[2] != 3 {
		t.Errorf("msgpack: %v %v", q.BlockHashes, err)
	}
}
