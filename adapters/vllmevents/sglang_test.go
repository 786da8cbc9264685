package vllmevents

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// SGLang's current event shapes, from the fixtures in testdata/sglang (each
// says which SGLang source it was derived from).

// sglangPageHashes is SGLang's KV-event block hash of each full page of
// tokens (as its sglang_hashes.py generator describes it): a SHA-256 chain
// over the previous page's digest and the page's token ids (4 bytes little
// endian), seeded, for a salted prompt, by SHA-256("sglang-cache-salt-v1\0"
// + salt); the event carries the first 8 digest bytes big-endian.
func sglangPageHashes(salt *string, pageSize int, tokens []uint32) []uint64 {
	var prior []byte
	if salt != nil {
		seed := sha256.Sum256(append([]byte("sglang-cache-salt-v1\x00"), *salt...))
		prior = seed[:]
	}
	var out []uint64
	for start := 0; start+pageSize <= len(tokens); start += pageSize {
		h := sha256.New()
		h.Write(prior)
		for _, t := range tokens[start : start+pageSize] {
			h.Write(binary.LittleEndian.AppendUint32(nil, t))
		}
		prior = h.Sum(nil)
		out = append(out, binary.BigEndian.Uint64(prior[:8]))
	}
	return out
}

type sglangVector struct {
	Salt     *string  `json:"salt"`
	PageSize int      `json:"page_size"`
	Tokens   []uint32 `json:"tokens"`
	Hashes   []string `json:"hashes"`
}

func sglangVectors(t *testing.T) []sglangVector {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", "sglang", "sglang-hashes.json"))
	if err != nil {
		t.Fatal(err)
	}
	var vs []sglangVector
	if err := json.Unmarshal(raw, &vs); err != nil {
		t.Fatal(err)
	}
	if len(vs) == 0 {
		t.Fatal("no vectors")
	}
	return vs
}

// TestSGLangSaltedBlockHashes: our reading of SGLang's salted block hash
// agrees with the vectors hashlib computed (testdata/sglang/sglang_hashes.py).
func TestSGLangSaltedBlockHashes(t *testing.T) {
	for _, v := range sglangVectors(t) {
		got := sglangPageHashes(v.Salt, v.PageSize, v.Tokens)
		if len(got) != len(v.Hashes) {
			t.Fatalf("%+v: %d hashes, want %d", v, len(got), len(v.Hashes))
		}
		for i, h := range v.Hashes {
			b, err := hex.DecodeString(h)
			if err != nil || len(b) != 8 {
				t.Fatalf("bad vector hash %q", h)
			}
			if want := binary.BigEndian.Uint64(b); got[i] != want {
				t.Errorf("salt %v page %d: hash %d = %016x, want %016x", v.Salt, v.PageSize, i, got[i], want)
			}
		}
	}
	// The salt separates tenants from each other and from unsalted prompts,
	// from the first page on.
	a, b := "tenant-a", "tenant-b"
	toks := []uint32{1, 2, 7, 8}
	ha, hb, hu := sglangPageHashes(&a, 2, toks), sglangPageHashes(&b, 2, toks), sglangPageHashes(nil, 2, toks)
	if ha[0] == hb[0] || ha[0] == hu[0] || hb[0] == hu[0] {
		t.Fatalf("first pages collide: %x %x %x", ha[0], hb[0], hu[0])
	}
}

func readFixture(t testing.TB, name string) []byte {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", filepath.FromSlash(name)))
	if err != nil {
		t.Fatal(err)
	}
	return hx(t, string(raw))
}

func sp(s string) *string { return &s }

// TestDecodeSGLangFixtures: SGLang's salted positional BlockStored puts a
// metadata map where vLLM has lora_name (position 7): it is the salt (and
// session), not a malformed event. After SGLang's PR #37482 events are
// tagged maps with cache_salt and session_id at the top level.
func TestDecodeSGLangFixtures(t *testing.T) {
	toks := []uint32{1, 2, 7, 8}
	a, b := sglangPageHashes(sp("tenant-a"), 2, toks), sglangPageHashes(sp("tenant-b"), 2, toks)
	u := sglangPageHashes(nil, 2, toks)
	for _, tc := range []struct {
		file string
		want *Batch
	}{
		{"sglang/positional-metadata.hx", &Batch{TS: 1.5, DPRank: iptr(0), Events: []Event{
			&BlockStored{BlockHashes: a, TokenIDs: toks, BlockSize: 2, Medium: "GPU", CacheSalt: "tenant-a"},
			&BlockStored{BlockHashes: u[:1], TokenIDs: toks[:2], BlockSize: 2, Medium: "GPU"},
			&BlockStored{BlockHashes: b, TokenIDs: toks, BlockSize: 2, Medium: "CPU_TIER1", CacheSalt: "tenant-b", SessionID: "sess-7"},
			&BlockStored{BlockHashes: u[1:], ParentBlockHash: u64(u[0]), TokenIDs: toks[2:], BlockSize: 2, Medium: "GPU", SessionID: "sess-9"},
			&BlockRemoved{BlockHashes: a[1:], Medium: "CPU_TIER2"},
		}}},
		{"sglang/tagged-map.hx", &Batch{TS: 1.5, DPRank: iptr(1), Events: []Event{
			&BlockStored{BlockHashes: a, TokenIDs: toks, BlockSize: 2, Medium: "GPU", CacheSalt: "tenant-a", SessionID: "sess-7"},
			&BlockStored{BlockHashes: u[:1], TokenIDs: toks[:2], BlockSize: 2, Medium: "GPU"},
			&BlockRemoved{BlockHashes: b[1:], Medium: "CPU_TIER2"},
			&AllBlocksCleared{},
		}}},
	} {
		t.Run(tc.file, func(t *testing.T) {
			checkBatch(t, mustDecode(t, readFixture(t, tc.file), DecodeOptions{HashBytes: HashFirst8}), tc.want)
		})
	}
}

// TestDecodeSGLangMetadataMalformed: a metadata map whose salt is not a
// string is a malformed event, skipped alone.
func TestDecodeSGLangMetadataMalformed(t *testing.T) {
	for name, src := range map[string]string{
		"salt-int":       `92 01 92 98 ab 'BlockStored' 91 05 c0 90 02 c0 a3 'GPU' 81 aa 'cache_salt' 07 91 b0 'AllBlocksCleared'`,
		"session-array":  `92 01 92 98 ab 'BlockStored' 91 05 c0 90 02 c0 a3 'GPU' 81 aa 'session_id' 90 91 b0 'AllBlocksCleared'`,
		"top-salt-array": `92 01 92 83 a4 'type' ab 'BlockStored' ac 'block_hashes' 91 05 aa 'cache_salt' 91 01 91 b0 'AllBlocksCleared'`,
	} {
		t.Run(name, func(t *testing.T) {
			b := mustDecode(t, hx(t, src), DecodeOptions{})
			if len(b.Events) != 1 || len(b.Skipped) != 1 || !isMalformedEvent(b.Skipped[0]) {
				t.Fatalf("events %v skipped %v; want the clear kept and the store skipped as malformed", b.Events, b.Skipped)
			}
		})
	}
	// Keys the router does not know are ignored, nil values read as unset.
	b := mustDecode(t, hx(t, `92 01 91 98 ab 'BlockStored' 91 05 c0 90 02 c0 a3 'GPU' 83 aa 'cache_salt' c0 a3 'new' 01 aa 'session_id' a1 's'`), DecodeOptions{})
	checkBatch(t, b, &Batch{TS: 1, Events: []Event{&BlockStored{BlockHashes: []uint64{5}, BlockSize: 2, Medium: "GPU", SessionID: "s"}}})
}

// TestEncodeSGLangShapes: CacheSalt and SessionID are written as SGLang
// writes them, byte for byte in the array shape, and round-trip in every
// encoding; the array shape refuses what it cannot place.
func TestEncodeSGLangShapes(t *testing.T) {
	a := sglangPageHashes(sp("tenant-a"), 2, []uint32{1, 2, 7, 8})
	salted := &BlockStored{BlockHashes: a, TokenIDs: []uint32{1, 2, 7, 8}, BlockSize: 2, Medium: "GPU", CacheSalt: "tenant-a"}
	p, err := EncodeBatch(&Batch{TS: 1.5, Events: []Event{salted}}, EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	want := hx(t, `92 cb 3f f8 00 00 00 00 00 00 91
		98 ab 'BlockStored' 92 cf 00 6f eb 30 6a 14 6e ed cf 41 d4 e9 80 98 72 fe 28 c0 94 01 02 07 08 02 c0 a3 'GPU'
		81 aa 'cache_salt' a8 'tenant-a'`)
	if hex.EncodeToString(p) != hex.EncodeToString(want) {
		t.Fatalf("array encoding\n got %x\nwant %x", p, want)
	}
	b := &Batch{TS: 2, DPRank: iptr(3), Events: []Event{
		salted,
		&BlockStored{BlockHashes: []uint64{9}, ParentBlockHash: u64(a[1]), TokenIDs: []uint32{3, 4}, BlockSize: 2, SessionID: "sess-1"},
		&BlockStored{BlockHashes: []uint64{10}, CacheSalt: "s", SessionID: "t"},
	}}
	for _, enc := range []Encoding{EncodingArray, EncodingMap, EncodingMapBatch} {
		p, err := EncodeBatch(b, enc)
		if err != nil {
			t.Fatalf("%v: %v", enc, err)
		}
		checkBatch(t, mustDecode(t, p, DecodeOptions{}), b)
	}
	for _, ev := range []*BlockStored{
		{BlockHashes: []uint64{1}, CacheSalt: "s", LoRAName: "sql"},
		{BlockHashes: []uint64{1}, SessionID: "s", GroupIdx: 1},
		{BlockHashes: []uint64{1}, CacheSalt: "s", ExtraKeys: []byte{0x90}},
	} {
		if _, err := EncodeBatch(&Batch{Events: []Event{ev}}, EncodingArray); !errors.Is(err, ErrNoPosition) {
			t.Errorf("%+v: err %v, want ErrNoPosition", ev, err)
		}
		if _, err := EncodeBatch(&Batch{Events: []Event{ev}}, EncodingMap); err != nil {
			t.Errorf("%+v as a map: %v", ev, err)
		}
	}
}
