package frontend

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"slices"
)

// pieces is a request body made of slices of others, mostly of the client's
// body: a prompt of many megabytes goes on to /tokenize and to the engine
// without being copied or re-encoded.
type pieces [][]byte

func (p pieces) size() int64 {
	n := 0
	for _, b := range p {
		n += len(b)
	}
	return int64(n)
}

func (p pieces) reader() io.Reader {
	rs := make([]io.Reader, len(p))
	for i, b := range p {
		rs[i] = bytes.NewReader(b)
	}
	return io.MultiReader(rs...)
}

// post is a JSON POST of p to url; the transport may resend it on a
// connection that broke before the engine read it.
func (p pieces) post(ctx context.Context, url string) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, p.reader())
	if err != nil {
		return nil, err
	}
	req.ContentLength = p.size()
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(p.reader()), nil }
	req.Header.Set("Content-Type", "application/json")
	return req, nil
}

// objectOf builds a JSON object from members given as key (a plain name)
// and raw value; a nil value leaves the member out.
func objectOf(kvs ...[]byte) pieces {
	out := pieces{[]byte("{")}
	for i := 0; i+1 < len(kvs); i += 2 {
		if kvs[i+1] == nil {
			continue
		}
		if len(out) > 1 {
			out = append(out, []byte(","))
		}
		out = append(out, []byte(`"`+string(kvs[i])+`":`), kvs[i+1])
	}
	return append(out, []byte("}"))
}

// without is body, the JSON object made of ms, less the members named in
// drop, plus the extra members (key, raw value pairs) at its end. Members
// kept keep their order and bytes.
func without(body []byte, ms []member, drop []string, extra ...[]byte) pieces {
	out := pieces{[]byte("{")}
	sep := false
	for _, m := range ms {
		if slices.Contains(drop, m.key) {
			continue
		}
		if sep {
			out = append(out, []byte(","))
		}
		out, sep = append(out, body[m.start:m.end]), true
	}
	for i := 0; i+1 < len(extra); i += 2 {
		if sep {
			out = append(out, []byte(","))
		}
		out, sep = append(out, []byte(`"`+string(extra[i])+`":`), extra[i+1]), true
	}
	return append(out, []byte("}"))
}
