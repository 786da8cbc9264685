package indexerapi

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

func checkPeerURL(u string) error {
	if u == "" {
		return errMissing("url")
	}
	p, err := url.Parse(u)
	if err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
		return &errBody{"url must be an indexer's base URL, e.g. http://indexer-b:8090; got " + strconv.Quote(u)}
	}
	return nil
}

// DumpGroup is one index of a peer's dump.
type DumpGroup struct {
	BlockSize int        `json:"block_size"`
	Events    []kv.Event `json:"events"`
	Error     string     `json:"error,omitempty"`
}

// FetchDump reads a peer's GET /dump, by model and routing group.
func FetchDump(ctx context.Context, client *http.Client, base string) (map[GroupKey]DumpGroup, error) {
	var raw map[string]DumpGroup
	if err := getJSON(ctx, client, base, "/dump", &raw); err != nil {
		return nil, err
	}
	out := make(map[GroupKey]DumpGroup, len(raw))
	for k, g := range raw {
		i := strings.LastIndexByte(k, ':')
		if i < 0 || g.Error != "" || g.BlockSize <= 0 {
			continue
		}
		out[GroupKey{k[:i], k[i+1:]}] = g
	}
	return out, nil
}

// FetchWorkers reads a peer's GET /workers.
func FetchWorkers(ctx context.Context, client *http.Client, base string) ([]WorkerView, error) {
	var out []WorkerView
	err := getJSON(ctx, client, base, "/workers", &out)
	return out, err
}

func getJSON(ctx context.Context, client *http.Client, base, path string, v any) error {
	url := strings.TrimSuffix(base, "/") + path
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, bytes.TrimSpace(b))
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	return nil
}

// RemoteConfig configures a Remote.
type RemoteConfig struct {
	// URL is the indexer's base URL: a standalone indexer's
	// (http://host:8090) or a router's that serves its index
	// (http://host:8000/indexer).
	URL string
	// BlockSize is the router's; the indexer's counts of tokens are
	// turned back into blocks of it.
	BlockSize    int
	RoutingGroup string
	// Timeout bounds one query; 0 means DefaultRemoteTimeout.
	Timeout time.Duration
	Client  *http.Client
	Logger  *slog.Logger
	// Now is the clock of the back-off; nil means time.Now.
	Now func() time.Time
}

// DefaultRemoteTimeout bounds one query to a remote indexer: a decision
// waits for it, and an answer from a healthy indexer on the same network
// takes well under a millisecond.
const DefaultRemoteTimeout = 250 * time.Millisecond

// Back-off of a remote indexer that stopped answering: while it lasts no
// decision waits for it; then one request asks again.
const (
	minRemoteBackoff = 500 * time.Millisecond
	maxRemoteBackoff = 8 * time.Second
)

// Remote asks a remote indexer for overlaps (router.RemoteIndex, for
// --use-remote-indexer). An indexer that does not answer within the
// timeout, or answers an error other than an unknown model, is left alone
// for a growing back-off, during which Overlaps fails at once: the router
// then reads its approximate index. One warning is logged when it stops
// answering and one line when it answers again.
type Remote struct {
	cfg   RemoteConfig
	query string

	mu      sync.Mutex
	down    bool
	until   time.Time
	backoff time.Duration
	probing bool
	lastErr error
	since   time.Time
}

var _ router.RemoteIndex = (*Remote)(nil)

// NewRemote returns a Remote.
func NewRemote(cfg RemoteConfig) (*Remote, error) {
	if err := checkPeerURL(cfg.URL); err != nil {
		return nil, fmt.Errorf("--use-remote-indexer: %w", err)
	}
	if cfg.BlockSize <= 0 {
		return nil, fmt.Errorf("indexerapi: block size must be positive, got %d", cfg.BlockSize)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultRemoteTimeout
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	cfg.RoutingGroup = groupOr(cfg.RoutingGroup)
	return &Remote{cfg: cfg, query: strings.TrimSuffix(cfg.URL, "/") + "/query_by_hash"}, nil
}

// errBackingOff: the remote is not asked during its back-off.
type errBackingOff struct{ last error }

func (e errBackingOff) Error() string { return "remote indexer not answering: " + e.last.Error() }

// Overlaps implements router.RemoteIndex.
func (c *Remote) Overlaps(q router.RemoteQuery) ([]index.Overlap, []index.TierOverlap, error) {
	c.mu.Lock()
	if c.down && (c.probing || c.cfg.Now().Before(c.until)) {
		err := c.lastErr
		c.mu.Unlock()
		return nil, nil, errBackingOff{err}
	}
	probing := c.down
	c.probing = probing
	c.mu.Unlock()

	dev, tiers, err := c.ask(q)
	c.mu.Lock()
	defer c.mu.Unlock()
	if probing {
		c.probing = false
	}
	if err != nil {
		if !c.down {
			c.down, c.since, c.backoff = true, c.cfg.Now(), minRemoteBackoff
			c.cfg.Logger.Warn("remote indexer stopped answering; routing by the local approximate index until it answers again", "url", c.cfg.URL, "err", err)
		} else {
			c.backoff = min(2*c.backoff, maxRemoteBackoff)
		}
		c.until, c.lastErr = c.cfg.Now().Add(c.backoff), err
		return nil, nil, err
	}
	if c.down {
		c.cfg.Logger.Info("remote indexer answers again", "url", c.cfg.URL, "down_for", c.cfg.Now().Sub(c.since).Round(time.Millisecond))
		c.down, c.lastErr = false, nil
	}
	return dev, tiers, nil
}

// Health is "" while the remote answers, else why the router routes by
// its approximate index.
func (c *Remote) Health() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.down {
		return ""
	}
	return fmt.Sprintf("degraded: remote indexer %s not answering for %s (%v); routing by the local approximate index",
		c.cfg.URL, c.cfg.Now().Sub(c.since).Round(time.Second), c.lastErr)
}

func (c *Remote) ask(q router.RemoteQuery) ([]index.Overlap, []index.TierOverlap, error) {
	hashes := make([]Hash, len(q.Local))
	for i, h := range q.Local {
		hashes[i] = Hash(h)
	}
	var body bytes.Buffer
	e := msgpack.NewEncoder(&body)
	e.SetCustomStructTag("json")
	if err := e.Encode(QueryByHashRequest{BlockHashes: hashes, ModelName: q.Model, RoutingGroup: c.cfg.RoutingGroup}); err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.query, &body)
	if err != nil {
		return nil, nil, err
	}
	req.Header.Set("Content-Type", contentMsgpack)
	req.Header.Set("Accept", contentMsgpack)
	resp, err := c.cfg.Client.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, nil, err
	}
	switch {
	case resp.StatusCode == http.StatusNotFound:
		// No index for the model (yet): nothing of it is cached anywhere.
		return nil, nil, nil
	case resp.StatusCode != http.StatusOK:
		return nil, nil, fmt.Errorf("POST %s: %s: %s", c.query, resp.Status, bytes.TrimSpace(b[:min(len(b), 256)]))
	}
	var sc Score
	d := msgpack.NewDecoder(bytes.NewReader(b))
	d.SetCustomStructTag("json")
	if err := d.Decode(&sc); err != nil {
		return nil, nil, fmt.Errorf("POST %s: the answer does not decode: %w", c.query, err)
	}
	return c.blocks(sc)
}

// blocks turns an answer in tokens back into the router's blocks.
func (c *Remote) blocks(sc Score) ([]index.Overlap, []index.TierOverlap, error) {
	bs := uint32(c.cfg.BlockSize)
	var dev []index.Overlap
	var tiers []index.TierOverlap
	for k, ranks := range sc.Scores {
		id, err := strconv.ParseUint(k, 10, 64)
		if err != nil {
			return nil, nil, fmt.Errorf("the answer names instance %q", k)
		}
		in := sc.Instances[k]
		lower := in.CPU > in.GPU || in.Disk > in.GPU
		for rk, tokens := range ranks {
			rank, err := strconv.ParseUint(rk, 10, 32)
			if err != nil {
				return nil, nil, fmt.Errorf("the answer names dp rank %q", rk)
			}
			w := kv.Worker{ID: id, DPRank: uint32(rank)}
			if tokens/bs > 0 {
				dev = append(dev, index.Overlap{Worker: w, Blocks: tokens / bs})
			}
			if lower {
				tiers = append(tiers, index.TierOverlap{Worker: w, Device: tokens / bs, Host: in.CPU / bs, Disk: in.Disk / bs})
			}
		}
	}
	return dev, tiers, nil
}
