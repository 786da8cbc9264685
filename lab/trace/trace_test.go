package trace

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
)

const sample = `{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}

{"timestamp": 5, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]}
{"timestamp": 9, "input_length": 1, "output_length": 0, "hash_ids": [0]}
{"timestamp": 12, "input_length": 530, "output_length": 7, "hash_ids": [0, 14]}
`

func mustParse(t *testing.T, s string) *Trace {
	t.Helper()
	tr, err := Parse(strings.NewReader(s))
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func TestParse(t *testing.T) {
	tr := mustParse(t, sample)
	if len(tr.Requests) != 4 {
		t.Fatalf("got %d requests, want 4", len(tr.Requests))
	}
	r := tr.Requests[0]
	if r.Timestamp != 0 || r.InputLength != 6758 || r.OutputLength != 500 || len(r.HashIDs) != 14 {
		t.Errorf("request 0 = %+v", r)
	}
	if r := tr.Requests[3]; r.Timestamp != 12 || r.InputLength != 530 || !slices.Equal(r.HashIDs, []uint64{0, 14}) {
		t.Errorf("request 3 = %+v", r)
	}
	if len(tr.IDs) != 15 {
		t.Errorf("got %d distinct ids, want 15", len(tr.IDs))
	}
	for _, r := range tr.Requests {
		for i, d := range r.idx {
			if tr.IDs[d] != r.HashIDs[i] {
				t.Errorf("dense index %d names %d, want %d", d, tr.IDs[d], r.HashIDs[i])
			}
		}
	}
}

func TestParseErrors(t *testing.T) {
	good := `{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0]}`
	for _, tc := range []struct {
		name, line, want string
	}{
		{"not json", `{"timestamp": 0,`, "unexpected EOF"},
		{"wrong type", `{"timestamp": "x", "input_length": 1, "output_length": 1, "hash_ids": [0]}`, "timestamp"},
		{"missing timestamp", `{"input_length": 1, "output_length": 1, "hash_ids": [0]}`, "missing timestamp"},
		{"missing input", `{"timestamp": 0, "output_length": 1, "hash_ids": [0]}`, "missing input_length"},
		{"missing output", `{"timestamp": 0, "input_length": 1, "hash_ids": [0]}`, "missing output_length"},
		{"missing ids", `{"timestamp": 0, "input_length": 1, "output_length": 1}`, "missing hash_ids"},
		{"zero input", `{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}`, "not positive"},
		{"negative output", `{"timestamp": 0, "input_length": 1, "output_length": -1, "hash_ids": [0]}`, "negative output_length"},
		{"negative timestamp", `{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [0]}`, "negative timestamp"},
		{"too few ids", `{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [0]}`, "want ceil(513/512) = 2"},
		{"too many ids", `{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0, 1]}`, "want ceil(512/512) = 1"},
		{"negative id", `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [-1]}`, "hash_ids"},
		{"huge id", `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1099511627776]}`, "exceeds"},
		{"trailing", `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]} {}`, "trailing"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse(strings.NewReader(good + "\n\n" + tc.line + "\n" + good + "\n"))
			if err == nil {
				t.Fatal("no error")
			}
			if !errors.Is(err, ErrBadLine) {
				t.Errorf("error %v does not wrap ErrBadLine", err)
			}
			if !strings.HasPrefix(err.Error(), "line 3: ") || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q, want line 3 and %q", err, tc.want)
			}
		})
	}
}

func TestCeilRule(t *testing.T) {
	for _, tc := range []struct {
		input, ids int
	}{{1, 1}, {511, 1}, {512, 1}, {513, 2}, {1024, 2}, {1025, 3}, {6758, 14}} {
		ids := make([]string, tc.ids)
		for i := range ids {
			ids[i] = "7"
		}
		line := `{"timestamp": 0, "output_length": 0, "input_length": ` + itoa(tc.input) + `, "hash_ids": [` + strings.Join(ids, ",") + `]}`
		if _, err := Parse(strings.NewReader(line)); err != nil {
			t.Errorf("input %d with %d ids: %v", tc.input, tc.ids, err)
		}
		line = `{"timestamp": 0, "output_length": 0, "input_length": ` + itoa(tc.input) + `, "hash_ids": [` + strings.Join(append(ids, "7"), ",") + `]}`
		if _, err := Parse(strings.NewReader(line)); err == nil {
			t.Errorf("input %d with %d ids accepted", tc.input, tc.ids+1)
		}
	}
}

func itoa(n int) string {
	var b []byte
	for {
		b = append([]byte{byte('0' + n%10)}, b...)
		if n /= 10; n == 0 {
			return string(b)
		}
	}
}

func TestTokens(t *testing.T) {
	tr := mustParse(t, sample)
	for _, tc := range []struct {
		req, copy int
	}{{0, 0}, {1, 0}, {2, 0}, {3, 0}, {0, 1}, {3, 7}} {
		r := &tr.Requests[tc.req]
		toks := r.Tokens(tc.copy)
		if len(toks) != r.InputLength {
			t.Errorf("request %d: %d tokens, want input_length %d", tc.req, len(toks), r.InputLength)
		}
		for _, tk := range toks {
			if tk >= Vocab {
				t.Fatalf("token %d out of vocab", tk)
			}
		}
		// Truncation: every id's full 512 tokens, cut at input_length.
		var full []uint32
		for _, id := range r.HashIDs {
			full = AppendBlockTokens(full, ContentID(id, tc.copy))
		}
		if !slices.Equal(toks, full[:r.InputLength]) {
			t.Errorf("request %d copy %d: tokens are not the ids' blocks cut to input_length", tc.req, tc.copy)
		}
		// Determinism.
		if !slices.Equal(toks, r.Tokens(tc.copy)) {
			t.Errorf("request %d copy %d: tokens differ between calls", tc.req, tc.copy)
		}
	}
	// Equal ids give equal content across requests; different ids differ.
	a, b := tr.Requests[0].Tokens(0), tr.Requests[1].Tokens(0)
	if !slices.Equal(a[:1024], b) {
		t.Error("shared ids 0, 1 do not give shared tokens")
	}
	if slices.Equal(a[:512], a[512:1024]) {
		t.Error("ids 0 and 1 give the same tokens")
	}
}

func TestBlockTokensFixed(t *testing.T) {
	// Pin the generator so that a change to it (which would change every
	// benchmark's content) is deliberate.
	got := AppendBlockTokens(nil, 0)[:4]
	again := AppendBlockTokens(nil, 0)[:4]
	if !slices.Equal(got, again) {
		t.Fatal("not deterministic")
	}
	want := []uint32{118809, 73534, 6632, 108629}
	if !slices.Equal(got, want) {
		t.Errorf("tokens of id 0 = %v, want %v", got, want)
	}
}

func TestCopiesDisjoint(t *testing.T) {
	tr := mustParse(t, sample)
	h := blockhash.New(16, "")
	seen := map[uint64]int{}
	for cp := range 4 {
		c, err := NewHashCache(tr, h, 0)
		if err != nil {
			t.Fatal(err)
		}
		for i := range tr.Requests {
			local := c.AppendLocal(nil, &tr.Requests[i], cp)
			for _, l := range local {
				if prev, ok := seen[l]; ok && prev != cp {
					t.Fatalf("copy %d shares local hash %x with copy %d", cp, l, prev)
				}
				seen[l] = cp
			}
		}
	}
	if ContentID(5, 0) != 5 || ContentID(5, 1) == 5 || ContentID(5, 1) == ContentID(5, 2) {
		t.Error("content ids of copies are not disjoint")
	}
}

func TestHashCacheMatchesBlockhash(t *testing.T) {
	tr := mustParse(t, sample)
	for _, tc := range []struct {
		blockSize, entries int
	}{{16, 0}, {16, 1}, {32, 4}, {64, 0}, {512, 2}, {1, 1}} {
		h := blockhash.New(tc.blockSize, "")
		c, err := NewHashCache(tr, h, tc.entries)
		if err != nil {
			t.Fatal(err)
		}
		for round := range 2 { // second round hits the cache
			for cp := range 3 {
				for i := range tr.Requests {
					r := &tr.Requests[i]
					wantLocal, wantSeq := h.Hashes(r.Tokens(cp))
					if len(wantLocal) != r.Blocks(tc.blockSize) {
						t.Fatalf("blockhash gave %d blocks, want %d", len(wantLocal), r.Blocks(tc.blockSize))
					}
					prefix := []uint64{42}
					seq, local := c.AppendSequence(prefix, prefix, r, cp)
					if !slices.Equal(local[1:], wantLocal) || !slices.Equal(seq[1:], wantSeq) {
						t.Fatalf("bs %d round %d copy %d request %d: hashes differ from blockhash of the tokens", tc.blockSize, round, cp, i)
					}
				}
			}
		}
		if tc.entries == 0 && c.Hits == 0 {
			t.Errorf("bs %d: no cache hits", tc.blockSize)
		}
	}
	if _, err := NewHashCache(tr, blockhash.New(24, ""), 0); err == nil {
		t.Error("block size 24 accepted")
	}
}

func TestLoadMooncake(t *testing.T) {
	const path = "/work/shared/traces/mooncake_conversation.jsonl"
	if _, err := os.Stat(path); err != nil {
		t.Skip("trace not available")
	}
	tr, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.Requests) != 12031 {
		t.Errorf("got %d requests, want 12031", len(tr.Requests))
	}
	for _, r := range tr.Requests {
		if r.HashIDs[0] != 0 {
			t.Fatal("a request does not start with the system prompt block 0")
		}
	}
}

func TestLoadMissing(t *testing.T) {
	if _, err := Load(t.TempDir() + "/none.jsonl"); err == nil {
		t.Error("no error for a missing file")
	}
}

func BenchmarkHashCache(b *testing.B) {
	tr := mustParseB(b)
	c, _ := NewHashCache(tr, blockhash.New(16, ""), 0)
	var seq, local []uint64
	i := 0
	b.ReportAllocs()
	for b.Loop() {
		seq, local = c.AppendSequence(seq[:0], local[:0], &tr.Requests[i%len(tr.Requests)], 0)
		i++
	}
}

func mustParseB(b *testing.B) *Trace {
	tr, err := Parse(strings.NewReader(sample))
	if err != nil {
		b.Fatal(err)
	}
	return tr
}

func TestParseSkippingReportsAndSkipsBadLines(t *testing.T) {
	in := `{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1]}
not json
{"timestamp": 2, "input_length": 10, "output_length": 1, "hash_ids": [3]}
`
	var bad []int
	tr, err := ParseSkipping(strings.NewReader(in), func(line int, err error) {
		if !errors.Is(err, ErrBadLine) || !strings.Contains(err.Error(), fmt.Sprintf("line %d", line)) {
			t.Errorf("line %d: error %v does not name it", line, err)
		}
		bad = append(bad, line)
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.Requests) != 2 || tr.Requests[1].Timestamp != 2 {
		t.Fatalf("kept %+v", tr.Requests)
	}
	if !slices.Equal(bad, []int{2, 3}) {
		t.Fatalf("reported lines %v, want [2 3]", bad)
	}
	if _, err := Parse(strings.NewReader(in)); err == nil || !strings.Contains(err.Error(), "line 2") {
		t.Fatalf("strict parse: %v", err)
	}
}

func TestStretch(t *testing.T) {
	tr, err := Parse(strings.NewReader(`{"timestamp":0,"input_length":1100,"output_length":1,"hash_ids":[0,1,2]}
{"timestamp":1,"input_length":2048,"output_length":1,"hash_ids":[0,1,3,4]}
`))
	if err != nil {
		t.Fatal(err)
	}
	if same, err := tr.Stretch(1); err != nil || same != tr {
		t.Fatalf("factor 1: %v %v", same, err)
	}
	st, err := tr.Stretch(2)
	if err != nil {
		t.Fatal(err)
	}
	want := [][]uint64{{0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 6, 7, 8, 9}}
	for i, r := range st.Requests {
		if !slices.Equal(r.HashIDs, want[i]) {
			t.Errorf("request %d: ids %v, want %v", i, r.HashIDs, want[i])
		}
		// The ceil rule still holds, and only the last block is cut.
		if got := (r.InputLength + BlockTokens - 1) / BlockTokens; got != len(r.HashIDs) {
			t.Errorf("request %d: input length %d for %d ids", i, r.InputLength, len(r.HashIDs))
		}
	}
	if st.Requests[0].InputLength != 5*BlockTokens+76 || st.Requests[1].InputLength != 8*BlockTokens {
		t.Errorf("input lengths %d, %d", st.Requests[0].InputLength, st.Requests[1].InputLength)
	}
	if len(st.IDs) != 10 || tr.Requests[0].HashIDs[2] != 2 {
		t.Errorf("ids %v; the original changed: %v", st.IDs, tr.Requests[0].HashIDs)
	}
	// Shared prefixes stay shared: the dense indices agree on them.
	if !slices.Equal(st.Requests[0].idx[:4], st.Requests[1].idx[:4]) {
		t.Errorf("dense indices %v / %v", st.Requests[0].idx, st.Requests[1].idx)
	}
	if _, err := tr.Stretch(0); err == nil {
		t.Error("factor 0 accepted")
	}
}

// Tokens appended into room that holds old values are those appended
// into a fresh array: the room is overwritten, not assumed zero.
func TestAppendBlockTokensOverwritesRoom(t *testing.T) {
	want := AppendBlockTokens([]uint32{7}, 42)
	room := make([]uint32, 1, 1+2*BlockTokens)
	room[0] = 7
	for i := range room[:cap(room)] {
		room[:cap(room)][i+0] = ^uint32(i)
	}
	room[0] = 7
	if got := AppendBlockTokens(room, 42); !slices.Equal(got, want) {
		t.Fatal("tokens appended into used room differ from a fresh append")
	}
}

// BenchmarkAppendBlockTokens: one block's tokens into presized room, as a
// request's prompt is built.
func BenchmarkAppendBlockTokens(b *testing.B) {
	buf := make([]uint32, 0, 64*BlockTokens)
	b.SetBytes(BlockTokens * 4)
	for i := 0; i < b.N; i++ {
		if len(buf) == cap(buf) {
			buf = buf[:0]
		}
		buf = AppendBlockTokens(buf, uint64(i))
	}
}

// parseLineJSON is parseLine with encoding/json alone, the reference
// scanLine must agree with.
func parseLineJSON(b []byte) (Request, error) {
	req, err := decodeLine(b)
	if err != nil {
		return Request{}, err
	}
	return validate(req)
}

// sameLine holds parseLine on b to the reference: the same request, or
// the same error.
func sameLine(t *testing.T, b []byte) {
	t.Helper()
	var ids idArena
	got, gerr := parseLine(b, &ids)
	want, werr := parseLineJSON(b)
	switch {
	case (gerr == nil) != (werr == nil) || gerr != nil && gerr.Error() != werr.Error():
		t.Fatalf("%q: error %v, encoding/json says %v", b, gerr, werr)
	case got.Timestamp != want.Timestamp || got.InputLength != want.InputLength ||
		got.OutputLength != want.OutputLength || !slices.Equal(got.HashIDs, want.HashIDs):
		t.Fatalf("%q: parsed %+v, encoding/json says %+v", b, got, want)
	}
}

var scanSeeds = []string{
	`{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}`,
	`{"timestamp":5,"input_length":1024,"output_length":3,"hash_ids":[0,1]}`,
	"{\t\"hash_ids\" :\r\n[ 7 ] , \"output_length\" : 0 ,\"input_length\": 1, \"timestamp\": 12 }",
	`{"timestamp": -0, "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
	`{"timestamp": 01, "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
	`{"timestamp": 1.0, "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
	`{"timestamp": 1e3, "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
	`{"timestamp": 9223372036854775807, "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
	`{"timestamp": 9223372036854775808, "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
	`{"timestamp": -9223372036854775808, "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [18446744073709551615]}`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [18446744073709551616]}`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [-1]}`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": []}`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0,]}`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0 1]}`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": null}`,
	`{"timestamp": null, "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0], "extra": "x"}`,
	`{"Timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
	`{"timestamp": 3, "timestamp": 4, "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
	`{"time\u0073tamp": 3, "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]} {}`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}}`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1 "hash_ids": [0]}`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]`,
	`{"timestamp": 0, "input_length": 1, "output_length": 1}`,
	`{}`,
	`[]`,
	`{"timestamp": "0", "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
}

func TestScanLineAgreesWithJSON(t *testing.T) {
	for _, s := range scanSeeds {
		sameLine(t, []byte(s))
	}
	// Every prefix, and every line with one byte changed to a byte JSON
	// gives a meaning to.
	for _, s := range scanSeeds[:3] {
		for i := range len(s) {
			sameLine(t, []byte(s[:i]))
			for _, c := range []byte(` "-,.:[]{}019eEn\u00ff`) {
				b := []byte(s)
				b[i] = c
				sameLine(t, b)
			}
		}
	}
}

func FuzzScanLine(f *testing.F) {
	for _, s := range scanSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) { sameLine(t, b) })
}

func TestParseMooncakeAgreesWithJSON(t *testing.T) {
	const path = "/work/shared/traces/mooncake_conversation.jsonl"
	b, err := os.ReadFile(path)
	if err != nil {
		t.Skip("trace not available")
	}
	for l := range bytes.Lines(b) {
		if l = bytes.TrimSpace(l); len(l) > 0 {
			sameLine(t, l)
		}
	}
}

func BenchmarkParse(b *testing.B) {
	var sb strings.Builder
	for range 1000 {
		sb.WriteString(sample)
	}
	in := sb.String()
	b.SetBytes(int64(len(in)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Parse(strings.NewReader(in)); err != nil {
			b.Fatal(err)
		}
	}
}

// TestDenseIDsMatchesMap holds denseIDs to a map: ids in order of first
// appearance get consecutive indices, whether they index its slice or
// land in its map (ids far beyond those seen, which the slice then grows
// past).
func TestDenseIDsMatchesMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var m denseIDs
	ref := map[uint64]uint32{}
	for range 200_000 {
		var id uint64
		switch rng.IntN(4) {
		case 0:
			id = rng.Uint64N(1 << 40)
		case 1:
			id = rng.Uint64N(4*uint64(len(ref)) + 2*denseSlack)
		default:
			id = rng.Uint64N(uint64(len(ref)) + 10)
		}
		d, ok := m.get(id)
		w, wok := ref[id]
		if ok != wok || d != w {
			t.Fatalf("id %d: got %d %v, want %d %v", id, d, ok, w, wok)
		}
		if !ok {
			ref[id] = uint32(len(ref))
			m.put(id, ref[id])
		}
	}
	if len(m.large) == 0 || len(m.small) == 0 {
		t.Fatalf("slice %d, map %d: both should be used", len(m.small), len(m.large))
	}
}

// TestBlockTokensMatchesGeneric holds the tokens blockTokens writes (in
// AVX-512 lanes where the CPU has them) to the scalar stream's.
func TestBlockTokensMatchesGeneric(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	var got, want [BlockTokens]uint32
	for i := range 20_000 {
		cid := rng.Uint64()
		if i < 1000 {
			cid = uint64(i)
		}
		blockTokens(&got, cid)
		blockTokensGeneric(&want, cid)
		if got != want {
			t.Fatalf("content id %d: tokens differ from the scalar stream's", cid)
		}
	}
}

func BenchmarkBlockTokensGeneric(b *testing.B) {
	var out [BlockTokens]uint32
	b.SetBytes(BlockTokens * 4)
	i := uint64(0)
	for b.Loop() {
		blockTokensGeneric(&out, i)
		i++
	}
}

// AppendTokensFrom writes the blocks from skip on as AppendTokens does,
// leaves the room of the first skip blocks as it was, and gives the
// prompt its length, with or without room in dst.
func TestAppendTokensFromSkipsLeadingBlocks(t *testing.T) {
	r := Request{InputLength: 3*BlockTokens + 100, HashIDs: []uint64{4, 8, 15, 16}}
	full := r.Tokens(2)
	for skip := -1; skip <= len(r.HashIDs)+1; skip++ {
		for _, room := range []bool{true, false} {
			var dst []uint32
			if room {
				dst = make([]uint32, 0, len(r.HashIDs)*BlockTokens+7)
				for k := range dst[:cap(dst)] {
					dst[:cap(dst)][k] = 7
				}
			}
			got := r.AppendTokensFrom(dst, 2, skip)
			if len(got) != r.InputLength {
				t.Fatalf("skip %d: %d tokens, want %d", skip, len(got), r.InputLength)
			}
			from := min(max(skip, 0), len(r.HashIDs)) * BlockTokens
			from = min(from, r.InputLength)
			if !slices.Equal(got[from:], full[from:]) {
				t.Fatalf("skip %d: the blocks after the skipped ones differ", skip)
			}
			want := uint32(0)
			if room {
				want = 7
			}
			for k, tok := range got[:from] {
				if tok != want {
					t.Fatalf("skip %d: skipped token %d is %d, want %d as the room held", skip, k, tok, want)
				}
			}
		}
	}
}
