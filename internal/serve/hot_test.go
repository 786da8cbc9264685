package serve

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
)

// Eight conversations cached on engine 1, twelve clients continuing them
// with 1,024-token turns over 3,072-token histories: every request on
// engine 1 would wait behind up to eleven others' turns, far more than the
// history it saves, so engine 2, idle and empty, must get a share.
func TestHotConversationsReachTheIdleEngine(t *testing.T) {
	a, b := engineFleetAt(t, 4), engineFleetAt(t, 4)
	s := startServer(t, spec(1, a), spec(2, b))
	const convs, history, turn = 8, 3072, 1024
	pin := uint64(1)
	for c := range convs {
		if _, err := tryCompleteOn(s, prompt(0, 10+c, history), &pin); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Sources(1)[0].WaitFor(ctx, func(st enginesource.Stats) bool { return st.BlocksStored >= convs*history/16 }); err != nil {
		t.Fatalf("engine 1's KV events never reached the router: %v", err)
	}

	const clients, each = 12, 8
	var (
		mu     sync.Mutex
		routed = map[uint64]int{}
		wg     sync.WaitGroup
		errs   = make(chan error, clients)
	)
	for c := range clients {
		wg.Go(func() {
			for i := range each {
				n := c*each + i
				id, err := tryComplete(s, append(prompt(0, 10+n%convs, history), prompt(0, 1000+n, turn)...))
				if err != nil {
					errs <- fmt.Errorf("client %d: %w", c, err)
					return
				}
				mu.Lock()
				routed[id]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	t.Logf("routed %v", routed)
	if routed[2] < clients*each/6 {
		t.Fatalf("the idle engine got %d of %d requests (%v)", routed[2], clients*each, routed)
	}
}
