package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
)

// routerProc is the router under test, a child process so that its memory
// is its own and a crash is a real one. It keeps its HTTP port across
// restarts so that clients find it again.
type routerProc struct {
	binary string
	args   []string
	log    io.Writer
	url    string

	mu          sync.Mutex
	cmd         *exec.Cmd
	exited      chan struct{}
	incarnation int
}

func newRouterProc(binary string, args []string, port int, log io.Writer) *routerProc {
	return &routerProc{binary: binary, args: args, log: log, url: fmt.Sprintf("http://127.0.0.1:%d", port)}
}

func (r *routerProc) start() error {
	cmd := exec.Command(r.binary, r.args...)
	cmd.Stdout, cmd.Stderr = r.log, r.log
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("router: %w", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	r.mu.Lock()
	r.cmd, r.exited = cmd, exited
	r.incarnation++
	r.mu.Unlock()
	return nil
}

// pid is the running child's process id, 0 when none runs.
func (r *routerProc) pid() (int, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cmd == nil {
		return 0, r.incarnation
	}
	select {
	case <-r.exited:
		return 0, r.incarnation
	default:
	}
	return r.cmd.Process.Pid, r.incarnation
}

// stop signals the child and waits for it to exit, SIGKILLing it after
// timeout.
func (r *routerProc) stop(sig syscall.Signal, timeout time.Duration) error {
	r.mu.Lock()
	cmd, exited := r.cmd, r.exited
	r.mu.Unlock()
	if cmd == nil {
		return nil
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-exited:
		return nil
	case <-time.After(timeout):
		_ = cmd.Process.Kill()
		<-exited
		return fmt.Errorf("router did not exit within %v of %v", timeout, sig)
	}
}

// exitedEarly reports a child that died without being told to.
func (r *routerProc) exitedEarly() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.exited == nil {
		return false
	}
	select {
	case <-r.exited:
		return true
	default:
		return false
	}
}

// rssMB reads the child's resident set from /proc.
func rssMB(pid int) (float64, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(v)
			if len(f) == 0 {
				return 0, false
			}
			kb, err := strconv.ParseFloat(f[0], 64)
			return kb / 1024, err == nil
		}
	}
	return 0, false
}

var probe = &http.Client{Timeout: 3 * time.Second}

// allRegistered reports whether every engine id is in the router's
// routing, per GET /health.
func (r *routerProc) allRegistered(ids []uint64) bool {
	resp, err := probe.Get(r.url + "/health")
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	var h struct {
		Workers []struct {
			ID         uint64 `json:"id"`
			Registered bool   `json:"registered"`
		} `json:"workers"`
	}
	if json.NewDecoder(resp.Body).Decode(&h) != nil {
		return false
	}
	in := map[uint64]bool{}
	for _, w := range h.Workers {
		if w.Registered {
			in[w.ID] = true
		}
	}
	for _, id := range ids {
		if !in[id] {
			return false
		}
	}
	return true
}

// waitFor polls cond every 50 ms until it holds or timeout passes.
func waitFor(ctx context.Context, timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
	return true
}

// LoadRow is one rank's booked load in the router.
type LoadRow struct {
	WorkerID            uint64  `json:"worker_id"`
	DPRank              uint32  `json:"dp_rank"`
	ActiveRequests      int     `json:"active_requests"`
	ActiveDecodeBlocks  float64 `json:"active_decode_blocks"`
	ActivePrefillTokens int     `json:"active_prefill_tokens"`
}

func (r *routerProc) loads(model string) ([]LoadRow, error) {
	body, _ := json.Marshal(map[string]any{"model": model, "tokens": []int{1, 2, 3}})
	resp, err := probe.Post(r.url+"/router/potential_loads", "application/json", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("potential_loads: status %d", resp.StatusCode)
	}
	var rows []LoadRow
	return rows, json.NewDecoder(resp.Body).Decode(&rows)
}

// heldBlocks is what an index or a cache holds for one engine: the blocks'
// contents, as sequence hashes (a block's tokens chained to its prefix's),
// and the engine's ids for them.
type heldBlocks struct {
	seqs map[uint64]bool
	ids  map[uint64]uint64 // engine id -> sequence hash
}

func newHeldBlocks() heldBlocks {
	return heldBlocks{seqs: map[uint64]bool{}, ids: map[uint64]uint64{}}
}

// index reads the router's index per worker.
func (r *routerProc) index() (map[uint64]heldBlocks, error) {
	c := &http.Client{Timeout: 30 * time.Second}
	resp, err := c.Get(r.url + "/router/dump_events")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("dump_events: status %d", resp.StatusCode)
	}
	return heldFromDump(bufio.NewReader(resp.Body))
}

// heldFromDump reads a router's /router/dump_events answer. The dump lists
// every held block below its parent, parents first; blocks that are only a
// path to a held one (bridges) are stored, then removed at the end.
func heldFromDump(dump io.Reader) (map[uint64]heldBlocks, error) {
	var evs []struct {
		WorkerID uint64 `json:"worker_id"`
		Event    struct {
			Data json.RawMessage `json:"data"`
		} `json:"event"`
	}
	if err := json.NewDecoder(dump).Decode(&evs); err != nil {
		return nil, err
	}
	type worker struct {
		seqOf   map[uint64]uint64 // engine id -> sequence hash
		bridges map[uint64]bool
	}
	workers := map[uint64]*worker{}
	for _, ev := range evs {
		var d struct {
			Stored *struct {
				Parent *uint64 `json:"parent_hash"`
				Blocks []struct {
					Hash  uint64 `json:"block_hash"`
					Local uint64 `json:"tokens_hash"`
				} `json:"blocks"`
			} `json:"stored"`
			Removed *struct {
				Hashes []uint64 `json:"block_hashes"`
			} `json:"removed"`
		}
		if err := json.Unmarshal(ev.Event.Data, &d); err != nil || (d.Stored == nil && d.Removed == nil) {
			return nil, errors.New("dump_events: an event other than stored or removed")
		}
		w := workers[ev.WorkerID]
		if w == nil {
			w = &worker{seqOf: map[uint64]uint64{}, bridges: map[uint64]bool{}}
			workers[ev.WorkerID] = w
		}
		if d.Removed != nil {
			for _, h := range d.Removed.Hashes {
				w.bridges[h] = true
			}
			continue
		}
		parent := d.Stored.Parent
		for _, b := range d.Stored.Blocks {
			seq := b.Local
			if parent != nil {
				ps, ok := w.seqOf[*parent]
				if !ok {
					return nil, fmt.Errorf("dump_events: worker %d: block %d listed before its parent %d", ev.WorkerID, b.Hash, *parent)
				}
				seq = blockhash.Chain(ps, b.Local)
			}
			w.seqOf[b.Hash] = seq
			h := b.Hash
			parent = &h
		}
	}
	out := map[uint64]heldBlocks{}
	for id, w := range workers {
		held := newHeldBlocks()
		for h, seq := range w.seqOf {
			if !w.bridges[h] {
				held.ids[h], held.seqs[seq] = seq, true
			}
		}
		out[id] = held
	}
	return out, nil
}
