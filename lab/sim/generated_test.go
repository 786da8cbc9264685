package sim

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/lab/workload"
)

// generated are small generated workloads: shared-prefix sessions, with
// and without tenants' salts, and closed-loop agent sessions.
func generated(t testing.TB) map[string]Requests {
	t.Helper()
	out := map[string]Requests{}
	for _, tenants := range []int{0, 3} {
		reqs, err := workload.Synthetic(workload.SyntheticConfig{
			Requests: 150, Groups: 4, SystemTokens: 520, QuestionTokens: 77, OutputTokens: 23,
			Rate: 40, Turns: 4, ThinkTime: 2 * time.Second, Tenants: tenants, Seed: 5,
		})
		if err != nil {
			t.Fatal(err)
		}
		out[fmt.Sprintf("synthetic, %d tenants", tenants)] = FromRequests(reqs)
	}
	ac := workload.DefaultAgenticConfig()
	ac.Requests, ac.SystemTokens, ac.ToolResultTokens, ac.MaxTurns = 150, 700, 150, 8
	reqs, err := workload.Agentic(ac)
	if err != nil {
		t.Fatal(err)
	}
	out["agentic"] = FromRequests(reqs)
	return out
}

// generatedRun is one run of a generated workload, and what its prompts
// and hashes did.
type generatedRun struct {
	p                          Point
	skipped, hits, made, given int
	// pooled: the engines took over the prompts; hashed: the loop
	// hashed them.
	pooled, hashed bool
}

func runGenerated(t *testing.T, w Requests, tc lazyCase, fill skippedTokens, how promptDisposal, share bool) generatedRun {
	t.Helper()
	cfg := smallConfig()
	cfg.Engine.NumGPUBlocks = 1024
	cfg.skipped, cfg.prompts = fill, how
	tc.set(&cfg)
	s, err := newSim(cfg, tc.mode, w, tc.speedup)
	if err != nil {
		t.Fatal(err)
	}
	if !share {
		s.ids.prev = nil
	}
	if err := s.run(); err != nil {
		t.Fatal(err)
	}
	return generatedRun{s.point(), s.prompts.skipped, s.ids.hits, s.prompts.made, s.prompts.made + s.prompts.reused, s.prompts.given != nil, s.ids.on}
}

// A generated workload's run whose engines take over pooled copies of
// the prompts, holding only the tokens the engines read, and whose turns
// take their previous turn's block hashes, gives the results of one that
// copies every prompt whole and hashes every prompt from its first
// block, whatever the blocks not copied hold (an earlier prompt's
// tokens, tokens of no prompt, other tokens of the vocabulary) and
// whatever becomes of a finished prompt.
func TestGeneratedPromptsChangeNothing(t *testing.T) {
	for name, w := range generated(t) {
		for _, tc := range lazyCases(t) {
			t.Run(name+", "+tc.name, func(t *testing.T) {
				want := runGenerated(t, w, tc, generateSkipped, dropPrompts, false)
				if want.hits != 0 || want.given != 0 {
					t.Fatalf("the reference took %d blocks' hashes and pooled %d prompts", want.hits, want.given)
				}
				for _, how := range []promptDisposal{reusePrompts, poisonPrompts} {
					fills := []skippedTokens{generateSkipped, leaveSkipped, poisonSkipped, scrambleSkipped}
					if how == poisonPrompts {
						fills = fills[1:2]
					}
					for _, fill := range fills {
						got := runGenerated(t, w, tc, fill, how, true)
						if !reflect.DeepEqual(got.p, want.p) {
							t.Fatalf("prompts %d, skipped blocks %d:\n%+v\ncopied whole and hashed afresh:\n%+v", how, fill, got.p, want.p)
						}
						if got.pooled && got.given < w.Len()-got.p.Errors {
							t.Fatalf("%d prompts pooled for %d requests", got.given, w.Len())
						}
						if got.pooled && how == reusePrompts && got.made > w.Len()/2 {
							t.Fatalf("%d of %d pooled prompts in fresh memory", got.made, got.given)
						}
						if fill == generateSkipped || !tc.lazy || !got.pooled {
							if got.skipped != 0 {
								t.Fatalf("%d blocks not copied in a run that reads them", got.skipped)
							}
						} else if got.skipped < w.Len() {
							t.Fatalf("%d blocks not copied in %d prompts", got.skipped, w.Len())
						}
						// A finished prompt's hashes are overwritten
						// with it (poisonPrompts), and salted turns
						// take none.
						if got.hashed && how == reusePrompts && name != "synthetic, 3 tenants" && got.hits < w.Len()/2 {
							t.Fatalf("%d blocks' hashes taken in %d prompts", got.hits, w.Len())
						}
					}
				}
			})
		}
	}
}

// Every hash the loop hands over for a generated workload is the
// router's, for requests hashed in any order and under salts: a turn
// that took more blocks than it shares with its previous turn, or took
// them from another salt's, would hand over other blocks' hashes.
func TestGeneratedHandedHashesAreTheRouters(t *testing.T) {
	w := generated(t)["agentic"]
	for _, bs := range []int{16, 48, 512} {
		rng := rand.New(rand.NewPCG(1, uint64(bs)))
		hits := 0
		for range 20 {
			cfg := smallConfig()
			cfg.Engine.BlockSize = bs
			s, err := newSim(cfg, "kv", w, 1)
			if err != nil {
				t.Fatal(err)
			}
			order := rng.Perm(w.Len())
			if rng.IntN(2) == 0 {
				slices.Sort(order)
			}
			for _, i := range order {
				req := w.Request(i)
				if rng.IntN(8) == 0 {
					req.CacheSalt = "s"
				}
				if rng.IntN(2) == 0 {
					s.startHashes(i, &req)
				}
				local, seq := s.hashes(i, &req)
				wantLocal, wantSeq := blockhash.NewKeyed(bs, "", req.CacheSalt).Hashes(req.Tokens)
				if !slices.Equal(local, wantLocal) || !slices.Equal(seq, wantSeq) {
					t.Fatalf("%d-token blocks, request %d: hashes %x %x, the router's %x %x", bs, i, local, seq, wantLocal, wantSeq)
				}
			}
			hits += s.ids.hits
		}
		if hits == 0 {
			t.Fatalf("%d-token blocks: no hash was taken", bs)
		}
	}
}

// BenchmarkGenerated runs the generated workloads with their prompts
// pooled and their turns' hashes taken, and copied and hashed afresh
// (the loop before either).
func BenchmarkGenerated(b *testing.B) {
	for _, name := range []string{"synthetic, 0 tenants", "agentic"} {
		w := generated(b)[name]
		for _, shared := range []bool{true, false} {
			b.Run(fmt.Sprintf("%s, shared %v", name, shared), func(b *testing.B) {
				cfg := smallConfig()
				if !shared {
					cfg.prompts = dropPrompts
				}
				b.ReportAllocs()
				for range b.N {
					s, err := newSim(cfg, "kv", w, 1)
					if err != nil {
						b.Fatal(err)
					}
					if !shared {
						s.ids.prev = nil
					}
					if err := s.run(); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*w.Len()), "ns/request")
			})
		}
	}
}
