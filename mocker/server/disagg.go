package server

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Disaggregated prefill and decode, as vLLM's NixlConnector does it (the
// Mooncake and LMCache connectors share its proxy protocol). A router sends
// a prefill engine the request with max_tokens 1 and kv_transfer_params
// {"do_remote_decode": true}; the engine prefills, answers with the
// parameters a decode engine needs to find the prompt's KV blocks, and holds
// those blocks. The router then sends the decode engine the client's request
// with those parameters; it pulls the blocks it lacks from the prefill
// engine over HTTP (POST /kv_transfer/pull, the simulated NIXL read), waits
// the time the transfer would take, and decodes without prefilling them.
// The router owns every policy; an engine only plays its role.

// Role is an engine's part in disaggregated serving, as vLLM's kv_role
// (kv_producer, kv_consumer, kv_both). A request without kv_transfer_params
// is served whole by every role, which is what lets a router prefill on the
// decode engine when it chooses to, or fall back to it.
type Role string

const (
	// RoleBoth plays either half: a router treats it as decode-capable and
	// may send it a decode with a remote prefill, and it may prefill for
	// another engine. The zero Role means RoleBoth.
	RoleBoth Role = "both"
	// RolePrefill holds the prompt blocks of requests asking for a remote
	// decode and tells the router where they are; it ignores a remote
	// prefill's parameters.
	RolePrefill Role = "prefill"
	// RoleDecode pulls the prompt blocks of requests naming a remote
	// prefill; it ignores a request for a remote decode.
	RoleDecode Role = "decode"
)

// ParseRole reads a --role value.
func ParseRole(s string) (Role, error) {
	switch r := Role(s); r {
	case RoleBoth, RolePrefill, RoleDecode:
		return r, nil
	case "":
		return RoleBoth, nil
	}
	return "", fmt.Errorf("role must be prefill, decode or both, got %q", s)
}

// KVTransferConfig models the link KV blocks cross between engines.
type KVTransferConfig struct {
	// Bandwidth of the link, bytes per second. The default, 25e9, is one
	// 200 Gb/s RDMA NIC, the usual NIXL fabric per GPU.
	Bandwidth float64
	// BytesPerToken is the KV of one token over all layers. The default,
	// 131072, is Llama-3.1-8B in bf16: 32 layers × 8 KV heads × 128 dims ×
	// 2 (K and V) × 2 bytes.
	BytesPerToken int
	// Timeout is how long a prefill engine holds blocks nobody pulls, on
	// the engine's clock: vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s. A
	// router that gave up on the decode must not pin them forever.
	Timeout time.Duration
}

// DefaultKVTransferConfig is an 8B model over RDMA with vLLM's timeout.
func DefaultKVTransferConfig() KVTransferConfig {
	return KVTransferConfig{Bandwidth: 25e9, BytesPerToken: 131072, Timeout: 480 * time.Second}
}

// Validate refuses negative settings; zero ones take the defaults.
func (c KVTransferConfig) Validate() error {
	switch {
	case !(c.Bandwidth >= 0):
		return fmt.Errorf("KV transfer bandwidth must be positive, got %v bytes/s", c.Bandwidth)
	case c.BytesPerToken < 0:
		return fmt.Errorf("KV bytes per token must be positive, got %d", c.BytesPerToken)
	case c.Timeout < 0:
		return fmt.Errorf("KV transfer timeout must be positive, got %v", c.Timeout)
	}
	return nil
}

// transferTime is the model time of moving blocks KV blocks of blockSize
// tokens.
func (c KVTransferConfig) transferTime(blocks, blockSize int) time.Duration {
	bytes := float64(blocks) * float64(blockSize) * float64(c.BytesPerToken)
	return time.Duration(bytes / c.Bandwidth * float64(time.Second))
}

// kvTransferParams is a request's kv_transfer_params, as a router sends
// them to either engine. Null and missing fields are alike.
type kvTransferParams struct {
	DoRemoteDecode  bool    `json:"do_remote_decode"`
	DoRemotePrefill bool    `json:"do_remote_prefill"`
	RemoteEngineID  *string `json:"remote_engine_id"`
	RemoteRequestID *string `json:"remote_request_id"`
	RemoteBlockIDs  []int   `json:"remote_block_ids"`
	RemoteHost      *string `json:"remote_host"`
	RemotePort      *int    `json:"remote_port"`
}

// kvTransferAnswer is the kv_transfer_params a prefill engine answers, as
// vLLM's NixlConnector.request_finished returns them: what the router hands
// the decode engine unchanged.
type kvTransferAnswer struct {
	DoRemotePrefill bool   `json:"do_remote_prefill"`
	DoRemoteDecode  bool   `json:"do_remote_decode"`
	RemoteBlockIDs  []int  `json:"remote_block_ids"`
	RemoteEngineID  string `json:"remote_engine_id"`
	RemoteRequestID string `json:"remote_request_id"`
	RemoteHost      string `json:"remote_host"`
	RemotePort      int    `json:"remote_port"`
	TPSize          int    `json:"tp_size"`
}

// pullRequest asks a prefill engine for a held request's blocks.
type pullRequest struct {
	RemoteEngineID  string `json:"remote_engine_id"`
	RemoteRequestID string `json:"remote_request_id"`
	BlockIDs        []int  `json:"block_ids"`
}

// pullAnswer is what a pull served.
type pullAnswer struct {
	Blocks int `json:"blocks"`
}

// produces reports that j is the prefill half of a disaggregated request:
// its blocks are held for a decode engine. A stream has no place for the
// answer's kv_transfer_params (vLLM returns them in whole responses only),
// so a streamed request holds nothing that nobody could ever pull.
func (s *Server) produces(j job) bool {
	return s.cfg.Role != RoleDecode && j.kv != nil && j.kv.DoRemoteDecode && !j.stream
}

// consumes reports that j is the decode half of a disaggregated request.
func (s *Server) consumes(j job) bool {
	return s.cfg.Role != RolePrefill && j.kv != nil && j.kv.DoRemotePrefill
}

// checkKVParams refuses the parameters a decode engine could not pull with.
func checkKVParams(kv *kvTransferParams) error {
	if len(kv.RemoteBlockIDs) == 0 {
		return nil // nothing to pull: the prompt had no full block
	}
	var missing []string
	if kv.RemoteEngineID == nil {
		missing = append(missing, "remote_engine_id")
	}
	if kv.RemoteRequestID == nil {
		missing = append(missing, "remote_request_id")
	}
	if kv.RemoteHost == nil {
		missing = append(missing, "remote_host")
	}
	if kv.RemotePort == nil {
		missing = append(missing, "remote_port")
	}
	if len(missing) > 0 {
		return fmt.Errorf("kv_transfer_params with do_remote_prefill and remote_block_ids needs %s", strings.Join(missing, ", "))
	}
	return nil
}

// rankEngineID names rank i in kv_transfer_params: the engine id, with
// vLLM's "_dp<rank>" suffix when there are several ranks, each its own
// pool of blocks.
func (s *Server) rankEngineID(i int) string {
	if len(s.ranks) == 1 {
		return s.cfg.EngineID
	}
	return s.cfg.EngineID + "_dp" + strconv.Itoa(i)
}

// newEngineID is a random UUID, as vLLM names its engines: ids must differ
// across processes, and every mocker process numbers its engines from 0.
func newEngineID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// kvAnswer builds the prefill's kv_transfer_params for request id on rank.
// The host and port are where the router reached this engine, so the decode
// engine reaches it the same way.
func (s *Server) kvAnswer(r *http.Request, rank int, id string, held []int) (*kvTransferAnswer, error) {
	addr, _ := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
	if addr == nil {
		return nil, errors.New("the connection has no local address to advertise")
	}
	host, portStr, err := net.SplitHostPort(addr.String())
	if err != nil {
		return nil, err
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, err
	}
	if held == nil {
		held = []int{}
	}
	return &kvTransferAnswer{
		DoRemotePrefill: true, RemoteBlockIDs: held,
		RemoteEngineID: s.rankEngineID(rank), RemoteRequestID: id,
		RemoteHost: host, RemotePort: port, TPSize: 1,
	}, nil
}

// pullKV gets the request's prompt KV for a decode engine: it keeps the
// leading blocks the rank caches, pulls the rest from the prefill engine,
// and waits the transfer time. It returns how many leading prompt blocks
// are now present (engine.Request.KVLoadedBlocks); 0 when the pull failed,
// and the engine prefills the prompt itself, as vLLM recomputes what it
// could not load. It fails only when ctx ends.
func (s *Server) pullKV(ctx context.Context, runner *Runner, j job) (int, error) {
	kv := j.kv
	if len(kv.RemoteBlockIDs) == 0 {
		return 0, nil
	}
	bs := runner.BlockSize()
	full := len(j.prompt) / bs
	if len(kv.RemoteBlockIDs) != full {
		// Another block size, or another prompt: the blocks do not fit.
		s.m.pullFailures.Inc()
		return 0, nil
	}
	have := runner.CachedPrefixBlocks(j.prompt)
	missing := kv.RemoteBlockIDs[have:]
	served, err := s.pull(ctx, net.JoinHostPort(*kv.RemoteHost, strconv.Itoa(*kv.RemotePort)),
		pullRequest{RemoteEngineID: *kv.RemoteEngineID, RemoteRequestID: *kv.RemoteRequestID, BlockIDs: missing})
	if err != nil || served != len(missing) {
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		s.m.pullFailures.Inc()
		return 0, nil
	}
	d := s.cfg.KVTransfer.transferTime(served, bs)
	if err := runner.Delay(ctx, d); err != nil {
		return 0, err
	}
	s.m.pulls.Inc()
	s.m.blocksPulled.Add(float64(served))
	if served > 0 {
		s.m.bytesTransferred.Observe(float64(served * bs * s.cfg.KVTransfer.BytesPerToken))
		s.m.xferTime.Observe(d.Seconds())
	}
	return full, nil
}

// pull asks the prefill engine at addr for blocks. An empty list only
// releases the hold, as vLLM's decode notifies a prefill whose blocks it
// all had.
func (s *Server) pull(ctx context.Context, addr string, p pullRequest) (int, error) {
	if p.BlockIDs == nil {
		p.BlockIDs = []int{}
	}
	body, err := json.Marshal(p)
	if err != nil {
		return 0, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/kv_transfer/pull", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.pullClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("pull from %s: %s: %s", addr, resp.Status, b)
	}
	var a pullAnswer
	if err := json.Unmarshal(b, &a); err != nil {
		return 0, fmt.Errorf("pull from %s: %w", addr, err)
	}
	return a.Blocks, nil
}

// kvTransferPull serves a decode engine's pull: 200 with the blocks served
// (the hold ends), 404 when the request holds nothing here (unknown,
// already pulled, or expired).
func (s *Server) kvTransferPull(w http.ResponseWriter, r *http.Request) {
	var p pullRequest
	if !s.decode(w, r, &p) {
		return
	}
	if p.RemoteRequestID == "" {
		badRequest(w, "remote_request_id is required")
		return
	}
	rank := -1
	for i := range s.ranks {
		if s.rankEngineID(i) == p.RemoteEngineID {
			rank = i
		}
	}
	if rank < 0 {
		writeError(w, http.StatusNotFound, "NotFoundError", "no engine %q here (this is %q)", p.RemoteEngineID, s.cfg.EngineID)
		return
	}
	n, err := s.ranks[rank].Pull(p.RemoteRequestID, p.BlockIDs)
	if err != nil {
		writeError(w, http.StatusNotFound, "NotFoundError", "%v", err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(pullAnswer{Blocks: n})
}

// role answers GET /role: the engine's part in disaggregated serving and the
// id its kv_transfer_params carry.
func (s *Server) role(w http.ResponseWriter, _ *http.Request) {
	ids := make([]string, len(s.ranks))
	for i := range s.ranks {
		ids[i] = s.rankEngineID(i)
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{
		"role": s.cfg.Role, "engine_id": s.cfg.EngineID, "rank_engine_ids": ids,
		"kv_transfer": map[string]any{
			"bandwidth_bytes_per_second": s.cfg.KVTransfer.Bandwidth,
			"bytes_per_token":            s.cfg.KVTransfer.BytesPerToken,
			"timeout_seconds":            s.cfg.KVTransfer.Timeout.Seconds(),
		},
	})
}
