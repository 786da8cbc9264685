package sim

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/lab/workload"
)

// Eight tenants share one system prompt, each salted with its own
// cache_salt, so an engine holds a tenant's copy only once one of its
// sessions ran there. A router that ignores salts credits a new tenant's
// session with another tenant's copy, which the engine never reuses; one
// that honours them credits nothing the engine does not reuse (phantom
// blocks 0, where the decision and the scheduling see the same cache),
// and its engines reuse at least as much.
func TestSaltedTenantsHaveNoPhantomHits(t *testing.T) {
	reqs, err := workload.Synthetic(workload.SyntheticConfig{
		Requests: 400, Groups: 1, Tenants: 8, SystemTokens: 1024, QuestionTokens: 128, OutputTokens: 24,
		Rate: 20, Turns: 4, ThinkTime: 2 * time.Second, Seed: 3,
	})
	if err != nil {
		t.Fatal(err)
	}
	w := FromRequests(reqs)
	cfg := smallConfig()
	cfg.KVEventDelay = 0 // the router sees what the engine holds
	cfg.Router.PredictedTTL = 0
	honoured, err := Run(cfg, "kv", w, 1)
	if err != nil {
		t.Fatal(err)
	}
	cfg.IgnoreCacheSalt = true
	ignored, err := Run(cfg, "kv", w, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("honoured: hit rate %.3f, %d blocks credited, %d phantom; ignored: hit rate %.3f, %d credited, %d phantom",
		honoured.HitRate, honoured.CreditedBlocks, honoured.PhantomBlocks, ignored.HitRate, ignored.CreditedBlocks, ignored.PhantomBlocks)
	if honoured.PhantomBlocks != 0 || ignored.PhantomBlocks == 0 {
		t.Errorf("phantom blocks: %d with salts honoured (want 0), %d ignored (want some)", honoured.PhantomBlocks, ignored.PhantomBlocks)
	}
	if honoured.HitRate < ignored.HitRate {
		t.Errorf("hit rate %.3f with salts honoured, below %.3f ignored", honoured.HitRate, ignored.HitRate)
	}
}
