// Package indexerapi speaks the HTTP API of a standalone KV indexer, as
// Dynamo's (python -m dynamo.indexer) does after the Mooncake KV-indexer
// RFC (kvcache-ai/Mooncake#1403): engines are registered with their ZMQ
// event endpoints, and clients ask which instance caches how much of a
// prompt, by token ids or by block hashes. Server answers it over a
// Backend (the standalone indexer's registry, or a serving router's own
// index); Remote asks it, for a router that uses a remote primary.
//
// Bodies are JSON or, with Content-Type application/msgpack, MessagePack
// with the same field names; an answer is in the request's format unless
// its Accept header names the other. Errors are {"error": "..."} with the
// reference's status codes: 400 for a body that does not decode or lacks
// a required field, 404 for an unknown model, routing group, instance or
// peer, 409 for a registration that contradicts an earlier one.
package indexerapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"reflect"
	"strconv"
	"strings"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/adapters/jsonerr"
)

// DefaultRoutingGroup is the routing group of a request that names none.
const DefaultRoutingGroup = "default"

// RegisterRequest is the body of POST /register.
type RegisterRequest struct {
	InstanceID     *uint64 `json:"instance_id"`
	Endpoint       string  `json:"endpoint"`
	ModelName      string  `json:"model_name"`
	BlockSize      int     `json:"block_size"`
	RoutingGroup   string  `json:"routing_group,omitempty"`
	DPRank         *uint32 `json:"dp_rank,omitempty"`
	ReplayEndpoint string  `json:"replay_endpoint,omitempty"`
	AdditionalSalt string  `json:"additional_salt,omitempty"`
	// AdditionalSaltRFC is the RFC's spelling of the same field.
	AdditionalSaltRFC string `json:"additionalsalt,omitempty"`
	// TenantID is accepted and ignored, as the reference does since it
	// became routing_group.
	TenantID string `json:"tenant_id,omitempty"`
}

// UnregisterRequest is the body of POST /unregister.
type UnregisterRequest struct {
	InstanceID   *uint64 `json:"instance_id"`
	ModelName    string  `json:"model_name"`
	RoutingGroup *string `json:"routing_group,omitempty"`
	DPRank       *uint32 `json:"dp_rank,omitempty"`
	TenantID     string  `json:"tenant_id,omitempty"`
}

// QueryRequest is the body of POST /query.
type QueryRequest struct {
	TokenIDs     []uint32 `json:"token_ids"`
	ModelName    string   `json:"model_name"`
	RoutingGroup string   `json:"routing_group,omitempty"`
	LoRAName     string   `json:"lora_name,omitempty"`
	CacheSalt    string   `json:"cache_salt,omitempty"`
	TenantID     string   `json:"tenant_id,omitempty"`
}

// QueryByHashRequest is the body of POST /query_by_hash. BlockHashes are
// local block hashes (one block's tokens, keyed by the adapter and the
// salt), signed or unsigned 64-bit: Dynamo sends them as i64.
type QueryByHashRequest struct {
	BlockHashes  []Hash  `json:"block_hashes"`
	ModelName    string  `json:"model_name"`
	RoutingGroup string  `json:"routing_group,omitempty"`
	CacheSalt    *string `json:"cache_salt,omitempty"`
	TenantID     string  `json:"tenant_id,omitempty"`
}

// PeerRequest is the body of POST /register_peer and /deregister_peer.
type PeerRequest struct {
	URL string `json:"url"`
}

// Hash is a 64-bit block hash written as a signed or an unsigned integer.
type Hash uint64

// UnmarshalJSON reads a signed or unsigned 64-bit integer.
func (h *Hash) UnmarshalJSON(b []byte) error {
	s := string(b)
	if u, err := strconv.ParseUint(s, 10, 64); err == nil {
		*h = Hash(u)
		return nil
	}
	i, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return &json.UnmarshalTypeError{Value: "number " + s, Type: hashType}
	}
	*h = Hash(uint64(i))
	return nil
}

var hashType = reflect.TypeOf(uint64(0))

// DecodeMsgpack reads a signed or unsigned integer.
func (h *Hash) DecodeMsgpack(d *msgpack.Decoder) error {
	v, err := d.DecodeInterface()
	if err != nil {
		return err
	}
	switch n := v.(type) {
	case int64:
		*h = Hash(uint64(n))
	case uint64:
		*h = Hash(n)
	case int8:
		*h = Hash(uint64(int64(n)))
	case int16:
		*h = Hash(uint64(int64(n)))
	case int32:
		*h = Hash(uint64(int64(n)))
	case uint8:
		*h = Hash(n)
	case uint16:
		*h = Hash(n)
	case uint32:
		*h = Hash(n)
	default:
		return fmt.Errorf("block_hashes must be a list of integers, got %T", v)
	}
	return nil
}

// Score is the answer to /query and /query_by_hash, every count in
// tokens (blocks × the block size).
type Score struct {
	// Scores are the device-tier overlaps by instance id, then dp rank.
	Scores map[string]map[string]uint32 `json:"scores"`
	// Frequencies[i] is how many ranks hold the prompt's block i.
	Frequencies []int `json:"frequencies"`
	// Instances break each instance's overlap down by tier.
	Instances map[string]Instance `json:"instances"`
}

// Instance is one instance's overlap on every tier. CPU and Disk are
// cumulative (the device match continued on the host tier, then on disk),
// so GPU <= CPU <= Disk; LongestMatched is the largest of the three.
type Instance struct {
	LongestMatched uint32            `json:"longest_matched"`
	GPU            uint32            `json:"gpu"`
	DP             map[string]uint32 `json:"dp"`
	CPU            uint32            `json:"cpu"`
	Disk           uint32            `json:"disk"`
}

// WorkerView is one registered instance of one routing group, as GET
// /workers lists it.
type WorkerView struct {
	InstanceID   uint64              `json:"instance_id"`
	Source       string              `json:"source"`
	Status       string              `json:"status"`
	ModelName    string              `json:"model_name"`
	RoutingGroup string              `json:"routing_group"`
	BlockSize    int                 `json:"block_size"`
	Endpoints    map[string]string   `json:"endpoints"`
	Listeners    map[string]Listener `json:"listeners"`
}

// Listener is one rank's event subscription. ReplayEndpoint is kvrouter's
// addition: a peer recovering from this list needs it to replay what its
// copy of the index missed (the batches published before its subscription
// joined the engine's stream).
type Listener struct {
	Endpoint       string `json:"endpoint"`
	ReplayEndpoint string `json:"replay_endpoint,omitempty"`
	Status         string `json:"status"`
	LastError      string `json:"last_error,omitempty"`
}

// Listener statuses.
const (
	StatusPending = "pending"
	StatusActive  = "active"
	StatusFailed  = "failed"
)

const (
	contentJSON    = "application/json"
	contentMsgpack = "application/msgpack"
)

// isMsgpack says whether a media type names MessagePack, in any of its
// spellings.
func isMsgpack(mediaType string) bool {
	switch strings.ToLower(strings.TrimSpace(mediaType)) {
	case contentMsgpack, "application/x-msgpack", "application/vnd.msgpack":
		return true
	}
	return false
}

// errBody is a request body that did not decode.
type errBody struct{ msg string }

func (e *errBody) Error() string { return e.msg }

// decode reads r's body into v, as MessagePack when its Content-Type says
// so and as JSON otherwise. Unknown fields are ignored, as the reference
// does.
func decode(r *http.Request, v any, maxBytes int64) error {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBytes+1))
	if err != nil {
		return &errBody{"the body could not be read: " + err.Error()}
	}
	if int64(len(body)) > maxBytes {
		return &errBody{fmt.Sprintf("the body is larger than %d bytes", maxBytes)}
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return &errBody{"the body is empty"}
	}
	mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if isMsgpack(mt) {
		d := msgpack.NewDecoder(bytes.NewReader(body))
		d.SetCustomStructTag("json")
		if err := d.Decode(v); err != nil {
			return &errBody{"the body is not valid MessagePack for this request: " + err.Error()}
		}
		return nil
	}
	if err := json.Unmarshal(body, v); err != nil {
		return &errBody{jsonerr.Describe(err, v, "")}
	}
	return nil
}

// answerMsgpack says whether the answer to r is MessagePack: when r's
// body was, unless Accept asks for JSON, or when Accept asks for it.
func answerMsgpack(r *http.Request) bool {
	accept := r.Header.Get("Accept")
	for _, part := range strings.Split(accept, ",") {
		mt, _, _ := mime.ParseMediaType(part)
		if isMsgpack(mt) {
			return true
		}
		if mt == contentJSON {
			return false
		}
	}
	mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	return isMsgpack(mt)
}

// write answers v with status, in the format answerMsgpack chooses.
func write(w http.ResponseWriter, r *http.Request, status int, v any) {
	if answerMsgpack(r) {
		var buf bytes.Buffer
		e := msgpack.NewEncoder(&buf)
		e.SetCustomStructTag("json")
		if err := e.Encode(v); err == nil {
			w.Header().Set("Content-Type", contentMsgpack)
			w.WriteHeader(status)
			_, _ = w.Write(buf.Bytes())
			return
		}
	}
	b, err := json.Marshal(v)
	if err != nil {
		status, b = http.StatusInternalServerError, []byte(`{"error":"the answer could not be encoded"}`)
	}
	w.Header().Set("Content-Type", contentJSON)
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

// fail answers {"error": msg}.
func fail(w http.ResponseWriter, r *http.Request, status int, format string, args ...any) {
	write(w, r, status, map[string]string{"error": fmt.Sprintf(format, args...)})
}

var ok = map[string]string{"status": "ok"}

// errMissing names a required field the body lacks.
func errMissing(field string) error { return &errBody{field + " is required"} }

// isBodyErr says whether err is the client's body's fault.
func isBodyErr(err error) bool {
	var eb *errBody
	return errors.As(err, &eb)
}
