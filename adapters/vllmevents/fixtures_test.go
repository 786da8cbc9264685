package vllmevents

import (
	"encoding/hex"
	"reflect"
	"strings"
	"testing"
)

// hx builds a payload by hand: hex bytes separated by spaces, 'quoted'
// ASCII for the raw bytes of string bodies (their msgpack header is written
// as hex), and # comments to the end of the line.
func hx(t testing.TB, src string) []byte {
	t.Helper()
	var out []byte
	for _, line := range strings.Split(src, "\n") {
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		for len(line) > 0 {
			line = strings.TrimLeft(line, " \t")
			if line == "" {
				break
			}
			if line[0] == '\'' {
				end := strings.IndexByte(line[1:], '\'')
				if end < 0 {
					t.Fatalf("unterminated quote in %q", line)
				}
				out = append(out, line[1:1+end]...)
				line = line[2+end:]
				continue
			}
			tok := line
			if i := strings.IndexAny(line, " \t"); i >= 0 {
				tok, line = line[:i], line[i:]
			} else {
				line = ""
			}
			b, err := hex.DecodeString(tok)
			if err != nil {
				t.Fatalf("bad hex %q: %v", tok, err)
			}
			out = append(out, b...)
		}
	}
	return out
}

func u64(v uint64) *uint64 { return &v }
func iptr(v int) *int      { return &v }

// normalize makes nil and empty slices compare equal.
func normalize(b *Batch) *Batch {
	c := *b
	if len(c.Events) == 0 {
		c.Events = nil
	}
	if len(c.Skipped) == 0 {
		c.Skipped = nil
	}
	evs := make([]Event, len(c.Events))
	for i, ev := range c.Events {
		switch ev := ev.(type) {
		case *BlockStored:
			s := *ev
			if len(s.BlockHashes) == 0 {
				s.BlockHashes = nil
			}
			if len(s.TokenIDs) == 0 {
				s.TokenIDs = nil
			}
			if len(s.ExtraKeys) == 0 {
				s.ExtraKeys = nil
			}
			evs[i] = &s
		case *BlockRemoved:
			r := *ev
			if len(r.BlockHashes) == 0 {
				r.BlockHashes = nil
			}
			evs[i] = &r
		default:
			evs[i] = ev
		}
	}
	if c.Events != nil {
		c.Events = evs
	}
	return &c
}

func mustDecode(t *testing.T, payload []byte, opts DecodeOptions) *Batch {
	t.Helper()
	b, err := DecodeBatchWith(payload, opts)
	if err != nil {
		t.Fatalf("DecodeBatch: %v", err)
	}
	return b
}

func checkBatch(t *testing.T, got, want *Batch) {
	t.Helper()
	g, w := normalize(got), normalize(want)
	if !reflect.DeepEqual(g, w) {
		t.Fatalf("batch mismatch\n got: %s\nwant: %s", dump(g), dump(w))
	}
}

func dump(b *Batch) string {
	var sb strings.Builder
	sb.WriteString("ts=")
	sb.WriteString(strings.TrimSpace(strings.ReplaceAll(strings.TrimSpace(fmtAny(b.TS)), "\n", " ")))
	if b.DPRank != nil {
		sb.WriteString(" rank=" + fmtAny(*b.DPRank))
	}
	for _, ev := range b.Events {
		sb.WriteString(" " + fmtAny(ev))
	}
	for _, s := range b.Skipped {
		sb.WriteString(" skipped:" + s.Error())
	}
	return sb.String()
}

// ---- fixtures: real vLLM / SGLang shapes, written by hand ----

const (
	// [1.5, [BlockStored(7 fields), BlockRemoved, AllBlocksCleared], 1]
	fixArray3 = `
93                                  # batch [ts, events, dp_rank]
  cb 3f f8 00 00 00 00 00 00        # ts 1.5
  93                                # 3 events
    97 ab 'BlockStored'             # vLLM 0.10: type + 6 fields
      92 cf ff ff ff ff ff ff ff fe 01   # block_hashes [0xfffffffffffffffe, 1]
      c0                            # parent_block_hash nil
      94 01 02 03 04                # token_ids
      02                            # block_size
      c0                            # lora_id nil
      a3 'GPU'                      # medium
    93 ac 'BlockRemoved'
      91 cd 01 00                   # [256]
      a3 'CPU'
    91 b0 'AllBlocksCleared'
  01                                # data_parallel_rank 1
`
	// Old 2-element batch, negative int hashes, positional fields up to lora_id.
	fixArray2Neg = `
92 cb 3f f8 00 00 00 00 00 00
  91
    96 ab 'BlockStored'
      92 ff d3 80 00 00 00 00 00 00 00  # [-1, MinInt64]
      d0 9c                             # parent -100 (int8)
      94 01 02 03 04
      02
      c0
`
	// 32-byte bin hashes (vLLM without int hashes): 00 01 .. 1f.
	fixBin = `
93 cb 3f f8 00 00 00 00 00 00
  92
    98 ab 'BlockStored'
      91 c4 20 00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f 10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f
      c4 20 ff 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f 10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e ee
      92 05 06
      02
      c0
      a3 'GPU'
      c0
    93 ac 'BlockRemoved'
      91 c4 20 00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f 10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f
      c0                                # medium nil
  c0                                    # dp_rank nil
`
	// Current vLLM: map batch, map events, every field plus an unknown key.
	fixMapBatch = `
83
  a2 'ts' cb 3f f8 00 00 00 00 00 00
  a6 'events' 92
    8d
      a4 'type' ab 'BlockStored'
      ac 'block_hashes' 91 2a
      b1 'parent_block_hash' 07
      a9 'token_ids' 92 05 06
      aa 'block_size' 02
      a7 'lora_id' 03
      a6 'medium' aa 'CPU_PINNED'
      a9 'lora_name' a4 'sql1'
      aa 'extra_keys' 91 c0
      a9 'group_idx' 01
      b2 'kv_cache_spec_kind' ae 'full_attention'
      bc 'kv_cache_spec_sliding_window' cd 10 00
      ac 'future_field' 81 a1 'x' 01
    84
      a4 'type' ac 'BlockRemoved'
      ac 'block_hashes' 91 2a
      a6 'medium' a4 'DISK'
      a9 'group_idx' 02
  b2 'data_parallel_rank' 02
`
	// SGLang: map batch with attn_dp_rank, keys in another order, map
	// events, EAGLE [a,b] token pairs, int64 hashes.
	fixSGLang = `
83
  a6 'events' 92
    85
      ac 'block_hashes' 92 d3 ff ff ff ff ff ff ff fe 05
      a9 'token_ids' 94 92 0a 0b 92 0c 0d 92 0e 0f 92 cd 01 00 cd 01 01
      a4 'type' ab 'BlockStored'
      aa 'block_size' 02
      b1 'parent_block_hash' c0
    81 a4 'type' b0 'AllBlocksCleared'
  a2 'ts' cb 3f f8 00 00 00 00 00 00
  ac 'attn_dp_rank' 03
`
	// Trailing fields missing: BlockStored [type, hashes], BlockRemoved
	// [type, hashes]; map BlockStored without optional keys.
	fixTrailingMissing = `
92 cb 3f f8 00 00 00 00 00 00
  93
    92 ab 'BlockStored' 91 05
    92 ac 'BlockRemoved' 91 05
    82 a4 'type' ab 'BlockStored' ac 'block_hashes' 91 06
`
	// Extra trailing elements everywhere: 15-field BlockStored, 5-field
	// BlockRemoved, AllBlocksCleared with a payload, a 4-element batch.
	fixExtraTrailing = `
94 cb 3f f8 00 00 00 00 00 00
  93
    9f ab 'BlockStored'
      91 05 c0 92 01 02 02 c0 a3 'GPU' c0 c0
      03                            # group_idx 3
      a6 'window'
      cd 01 00                      # sliding window 256
      a5 'LOCAL'                    # locality
      a5 'extra' 81 a1 'k' 92 01 02 # two extra trailing elements
    95 ac 'BlockRemoved' 91 05 a3 'GPU' 03 c3
    92 b0 'AllBlocksCleared' 07
  04
  a4 'more'
`
	// Unknown and malformed events between good ones.
	fixUnknown = `
92 cb 3f f8 00 00 00 00 00 00
  97
    92 ad 'NewFancyEvent' 01             # 0 unknown positional
    92 ab 'BlockStored' 91 05            # 1 ok
    81 a4 'type' a7 'Another'            # 2 unknown map
    92 ab 'BlockStored' a3 'abc'         # 3 malformed: hashes a string
    2a                                   # 4 malformed: an integer
    81 a1 'x' 01                         # 5 malformed: map without type
    91 b0 'AllBlocksCleared'             # 6 ok
`
)

func TestDecodeFixtures(t *testing.T) {
	cases := []struct {
		name string
		src  string
		opts DecodeOptions
		want *Batch
	}{
		{"array3", fixArray3, DecodeOptions{}, &Batch{TS: 1.5, DPRank: iptr(1), Events: []Event{
			&BlockStored{BlockHashes: []uint64{0xfffffffffffffffe, 1}, TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 2, Medium: "GPU"},
			&BlockRemoved{BlockHashes: []uint64{256}, Medium: "CPU"},
			&AllBlocksCleared{},
		}}},
		{"array2-negative", fixArray2Neg, DecodeOptions{}, &Batch{TS: 1.5, Events: []Event{
			&BlockStored{BlockHashes: []uint64{0xffffffffffffffff, 0x8000000000000000}, ParentBlockHash: u64(0xffffffffffffff9c),
				TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 2},
		}}},
		{"bin-last8", fixBin, DecodeOptions{}, &Batch{TS: 1.5, Events: []Event{
			&BlockStored{BlockHashes: []uint64{0x18191a1b1c1d1e1f}, ParentBlockHash: u64(0x18191a1b1c1d1eee), TokenIDs: []uint32{5, 6}, BlockSize: 2, Medium: "GPU"},
			&BlockRemoved{BlockHashes: []uint64{0x18191a1b1c1d1e1f}},
		}}},
		{"bin-first8", fixBin, DecodeOptions{HashBytes: HashFirst8}, &Batch{TS: 1.5, Events: []Event{
			&BlockStored{BlockHashes: []uint64{0x0001020304050607}, ParentBlockHash: u64(0xff01020304050607), TokenIDs: []uint32{5, 6}, BlockSize: 2, Medium: "GPU"},
			&BlockRemoved{BlockHashes: []uint64{0x0001020304050607}},
		}}},
		{"map-batch", fixMapBatch, DecodeOptions{}, &Batch{TS: 1.5, DPRank: iptr(2), Events: []Event{
			&BlockStored{BlockHashes: []uint64{42}, ParentBlockHash: u64(7), TokenIDs: []uint32{5, 6}, BlockSize: 2,
				LoRAID: iptr(3), Medium: "CPU_PINNED", LoRAName: "sql1", ExtraKeys: []byte{0x91, 0xc0}, GroupIdx: 1,
				KVCacheSpecKind: "full_attention", KVCacheSpecSlidingWindow: iptr(4096)},
			&BlockRemoved{BlockHashes: []uint64{42}, Medium: "DISK", GroupIdx: 2},
		}}},
		{"sglang", fixSGLang, DecodeOptions{HashBytes: HashFirst8}, &Batch{TS: 1.5, DPRank: iptr(3), Events: []Event{
			&BlockStored{BlockHashes: []uint64{0xfffffffffffffffe, 5}, TokenIDs: []uint32{10, 12, 14, 256}, BlockSize: 2},
			&AllBlocksCleared{},
		}}},
		{"trailing-missing", fixTrailingMissing, DecodeOptions{}, &Batch{TS: 1.5, Events: []Event{
			&BlockStored{BlockHashes: []uint64{5}},
			&BlockRemoved{BlockHashes: []uint64{5}},
			&BlockStored{BlockHashes: []uint64{6}},
		}}},
		{"extra-trailing", fixExtraTrailing, DecodeOptions{}, &Batch{TS: 1.5, DPRank: iptr(4), Events: []Event{
			&BlockStored{BlockHashes: []uint64{5}, TokenIDs: []uint32{1, 2}, BlockSize: 2, Medium: "GPU", GroupIdx: 3,
				KVCacheSpecKind: "window", KVCacheSpecSlidingWindow: iptr(256), Locality: "LOCAL"},
			&BlockRemoved{BlockHashes: []uint64{5}, Medium: "GPU", GroupIdx: 3},
			&AllBlocksCleared{},
		}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := mustDecode(t, hx(t, tc.src), tc.opts)
			checkBatch(t, b, tc.want)
		})
	}
}

func TestDecodeUnknownAndMalformedEvents(t *testing.T) {
	b := mustDecode(t, hx(t, fixUnknown), DecodeOptions{})
	checkBatch(t, &Batch{TS: b.TS, Events: b.Events}, &Batch{TS: 1.5, Events: []Event{
		&BlockStored{BlockHashes: []uint64{5}},
		&AllBlocksCleared{},
	}})
	type skip struct {
		idx     int
		typ     string
		unknown bool
	}
	want := []skip{{0, "NewFancyEvent", true}, {2, "Another", true}, {3, "BlockStored", false}, {4, "", false}, {5, "", false}}
	if len(b.Skipped) != len(want) {
		t.Fatalf("skipped %d events, want %d: %v", len(b.Skipped), len(want), b.Skipped)
	}
	for i, w := range want {
		s := b.Skipped[i]
		if s.Index != w.idx || s.Type != w.typ || s.Unknown() != w.unknown {
			t.Errorf("skipped[%d] = %+v (%v), want %+v", i, s, s, w)
		}
		if !w.unknown && !isMalformedEvent(s) {
			t.Errorf("skipped[%d] does not wrap ErrMalformedEvent: %v", i, s)
		}
	}
}

func TestDecodeMalformedBatch(t *testing.T) {
	for name, src := range map[string]string{
		"empty":          ``,
		"string":         `a3 'abc'`,
		"array-1":        `91 cb 3f f8 00 00 00 00 00 00`,
		"ts-string":      `92 a1 'x' 90`,
		"ts-nil":         `92 c0 90`,
		"events-int":     `92 cb 3f f8 00 00 00 00 00 00 05`,
		"trailing-bytes": `92 cb 3f f8 00 00 00 00 00 00 90 00`,
		"truncated":      `92 cb 3f f8 00 00 00 00 00 00 91 92 ab 'BlockStored'`,
		"map-no-events":  `81 a2 'ts' 01`,
		"map-no-ts":      `81 a6 'events' 90`,
		"rank-negative":  `93 01 90 ff`,
		"rank-string":    `93 01 90 a1 'x'`,
		"huge-array":     `dd ff ff ff ff`,
		"huge-map":       `df ff ff ff ff`,
		"reserved-code":  `92 01 91 c1`,
	} {
		t.Run(name, func(t *testing.T) {
			b, err := DecodeBatch(hx(t, src))
			if err == nil || !isMalformedBatch(err) {
				t.Fatalf("DecodeBatch = %v, %v; want ErrMalformedBatch", b, err)
			}
		})
	}
}

func TestTier(t *testing.T) {
	for m, want := range map[Medium]string{
		"": "device", "GPU": "device", "gpu": "device", "DEVICE": "device",
		"CPU": "host_pinned", "CPU_PINNED": "host_pinned", "cpu_tier1": "host_pinned", "CPU_TIER1": "host_pinned",
		"CPU_TIER2": "disk", "DISK": "disk", "NVME": "disk", "STORAGE": "disk",
		"EXTERNAL": "external", "NETWORK": "external", "REMOTE": "external", "SHARED": "external",
	} {
		if got, ok := m.Tier(); !ok || string(got) != want {
			t.Errorf("Tier(%q) = %s, %v; want %s", m, got, ok, want)
		}
	}
	// A medium Tier does not know is not guessed from its prefix.
	for _, m := range []Medium{"nvme0", "S3", "LMCACHE", "GPU_HBM", "CPU_TIER3", " GPU"} {
		if got, ok := m.Tier(); ok {
			t.Errorf("Tier(%q) = %s, want not ok", m, got)
		}
	}
}

// vLLM 0.26 on names the locality of its storage tiers' blocks.
func TestDecodeLocality(t *testing.T) {
	for _, tc := range []struct {
		src       string
		blockSize int
	}{
		{`92 01 91 84 a4 'type' ab 'BlockStored' ac 'block_hashes' 91 05 a6 'medium' a7 'STORAGE' a8 'locality' a6 'REMOTE'`, 0},
		{`92 01 91 9d ab 'BlockStored' 91 05 c0 90 02 c0 a7 'STORAGE' c0 c0 c0 c0 c0 a6 'REMOTE'`, 2},
	} {
		b := mustDecode(t, hx(t, tc.src), DecodeOptions{})
		checkBatch(t, b, &Batch{TS: 1, Events: []Event{&BlockStored{BlockHashes: []uint64{5}, BlockSize: tc.blockSize, Medium: "STORAGE", Locality: "REMOTE"}}})
	}
}

// TestDecodeVLLM026: a batch vLLM 0.26 published, as reported by a user.
func TestDecodeVLLM026(t *testing.T) {
	checkBatch(t, mustDecode(t, readFixture(t, "vllm/v0.26-map-events.hx"), DecodeOptions{}), &Batch{TS: 1789095808.8378847, DPRank: iptr(0), Events: []Event{
		&BlockStored{BlockHashes: []uint64{15760518052499183552}, BlockSize: 16, Medium: "GPU", ExtraKeys: []byte{0x91, 0xc0},
			KVCacheSpecKind: "full_attention",
			TokenIDs:        []uint32{151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198, 151667}},
	}})
}
