package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/lab/replay"
	"github.com/kvrouter/kvrouter/lab/workload"
)

// Error classes of a failed request, as a client sees them.
const (
	ClassTransport   = "transport"    // no HTTP response: refused, reset, closed
	ClassStatus5xx   = "status-5xx"   // the router answered 5xx
	ClassStatus4xx   = "status-4xx"   // the router answered 4xx: never explained by a fault
	ClassStreamError = "stream-error" // an error event in the stream
	ClassStreamCut   = "stream-cut"   // the stream ended without [DONE]
	ClassTimeout     = "timeout"      // no answer within the request timeout
)

// Outcome is one failed request; successes are only counted.
type Outcome struct {
	Start  float64 `json:"start_s"` // seconds since the start of traffic
	End    float64 `json:"end_s"`
	Class  string  `json:"class"`
	Detail string  `json:"detail"`
	// Fault is the fault whose window explains the error, "" if none.
	Fault string `json:"fault,omitempty"`
}

// traffic is N closed-loop streaming clients.
type traffic struct {
	url, model string
	reqs       []workload.Request
	client     *http.Client
	t0         time.Time
	timeout    time.Duration

	next                 atomic.Uint64
	ok, failed, inflight atomic.Int64
	mu                   sync.Mutex
	okPerSec, errPerSec  []int
	errors               []Outcome
}

func newTraffic(url, model string, reqs []workload.Request, clients int, timeout time.Duration) *traffic {
	return &traffic{
		url: url, model: model, reqs: reqs, timeout: timeout,
		client: &http.Client{Transport: &http.Transport{
			MaxIdleConns: clients, MaxIdleConnsPerHost: clients, IdleConnTimeout: time.Minute,
			DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		}},
	}
}

// run drives clients until stop is closed, then lets every request in
// flight finish; ctx aborts them.
func (t *traffic) run(ctx context.Context, clients int, stop <-chan struct{}) {
	t.t0 = time.Now()
	var wg sync.WaitGroup
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				case <-ctx.Done():
					return
				default:
				}
				r := &t.reqs[int(t.next.Add(1)-1)%len(t.reqs)]
				if !t.one(ctx, r) {
					// A client that failed backs off a little, so that 500 of
					// them do not spin against a router that is down.
					select {
					case <-time.After(200 * time.Millisecond):
					case <-ctx.Done():
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	t.client.CloseIdleConnections()
}

func (t *traffic) since(at time.Time) float64 { return at.Sub(t.t0).Seconds() }

func (t *traffic) record(start time.Time, class, detail string) bool {
	end := time.Now()
	sec := int(t.since(end))
	t.mu.Lock()
	defer t.mu.Unlock()
	for len(t.okPerSec) <= sec {
		t.okPerSec = append(t.okPerSec, 0)
		t.errPerSec = append(t.errPerSec, 0)
	}
	if class == "" {
		t.okPerSec[sec]++
		t.ok.Add(1)
		return true
	}
	t.errPerSec[sec]++
	t.failed.Add(1)
	t.errors = append(t.errors, Outcome{Start: t.since(start), End: t.since(end), Class: class, Detail: detail})
	return false
}

// one streams one request and records how it ended.
func (t *traffic) one(ctx context.Context, r *workload.Request) bool {
	t.inflight.Add(1)
	defer t.inflight.Add(-1)
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, t.timeout)
	defer cancel()
	class, detail := t.send(ctx, r)
	if class != "" && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		class = ClassTimeout
	}
	return t.record(start, class, detail)
}

func (t *traffic) send(ctx context.Context, r *workload.Request) (class, detail string) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, t.url+"/v1/completions", bytes.NewReader(replay.RequestBody(t.model, r)))
	if err != nil {
		return ClassTransport, err.Error()
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := t.client.Do(req)
	if err != nil {
		return ClassTransport, err.Error()
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		class = ClassStatus5xx
		if resp.StatusCode < 500 {
			class = ClassStatus4xx
		}
		return class, fmt.Sprintf("status %d: %s", resp.StatusCode, bytes.TrimSpace(b))
	}
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	for {
		line, err := br.ReadSlice('\n')
		if data, ok := bytes.CutPrefix(line, []byte("data: ")); ok {
			data = bytes.TrimSpace(data)
			if bytes.Equal(data, []byte("[DONE]")) {
				return "", ""
			}
			if bytes.Contains(data, []byte(`"error"`)) {
				var c struct {
					Error *struct {
						Message string `json:"message"`
					} `json:"error"`
				}
				if json.Unmarshal(data, &c) == nil && c.Error != nil {
					return ClassStreamError, c.Error.Message
				}
			}
		}
		for err == bufio.ErrBufferFull {
			_, err = br.ReadSlice('\n')
		}
		if err != nil {
			if err == io.EOF {
				return ClassStreamCut, "stream ended without [DONE]"
			}
			return ClassStreamCut, err.Error()
		}
	}
}
