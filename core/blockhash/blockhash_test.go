package blockhash

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/zeebo/xxh3"
)

func TestXXH3ReferenceVector(t *testing.T) {
	if got := xxh3.HashSeed([]byte("test data"), Seed); got != 13226331709069118873 {
		t.Fatalf("XXH3-64(seed 1337, \"test data\") = %d, want 13226331709069118873", got)
	}
}

// leBytes is the reference encoding: tokens as little-endian uint32.
func leBytes(tokens []uint32) []byte {
	b := make([]byte, 4*len(tokens))
	for i, tok := range tokens {
		binary.LittleEndian.PutUint32(b[4*i:], tok)
	}
	return b
}

func TestLocalHashesMatchReferenceEncoding(t *testing.T) {
	tests := []struct {
		name      string
		blockSize int
		tokens    int
		wantBlock int
	}{
		{"exact blocks", 4, 12, 3},
		{"partial tail ignored", 4, 14, 3},
		{"shorter than a block", 16, 15, 0},
		{"empty", 16, 0, 0},
		{"large block uses heap scratch", 128, 300, 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tokens := make([]uint32, tc.tokens)
			for i := range tokens {
				tokens[i] = uint32(i*7919 + 3)
			}
			h := New(tc.blockSize, "")
			got := h.LocalHashes(tokens)
			if len(got) != tc.wantBlock {
				t.Fatalf("got %d blocks, want %d", len(got), tc.wantBlock)
			}
			for i, g := range got {
				want := xxh3.HashSeed(leBytes(tokens[i*tc.blockSize:(i+1)*tc.blockSize]), 1337)
				if g != want {
					t.Fatalf("block %d: got %d want %d", i, g, want)
				}
				if one := h.LocalHash(tokens[i*tc.blockSize : (i+1)*tc.blockSize]); one != want {
					t.Fatalf("LocalHash block %d: got %d want %d", i, one, want)
				}
			}
		})
	}
}

func TestKnownTokenVectors(t *testing.T) {
	// Pinned values: a change here breaks compatibility with every engine
	// event and every router dump already written.
	h := New(4, "")
	got := h.LocalHashes([]uint32{1, 2, 3, 4, 5, 6, 7, 8})
	want0 := xxh3.HashSeed([]byte{1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0}, 1337)
	if got[0] != want0 {
		t.Fatalf("block 0: %d want %d", got[0], want0)
	}
	seq := SequenceHashes(got)
	if seq[0] != got[0] {
		t.Fatalf("seq[0] must equal local[0]")
	}
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], seq[0])
	binary.LittleEndian.PutUint64(b[8:], got[1])
	if want := xxh3.HashSeed(b[:], 1337); seq[1] != want {
		t.Fatalf("seq[1] = %d want %d", seq[1], want)
	}
}

func TestLoRASeed(t *testing.T) {
	if LoRASeed("") != 1337 {
		t.Fatal("empty adapter must be the base model seed")
	}
	name := "my-adapter"
	if want := 1337 + xxh3.HashString(name); LoRASeed(name) != want {
		t.Fatalf("LoRASeed = %d want %d", LoRASeed(name), want)
	}
	tokens := []uint32{9, 8, 7, 6}
	base := New(4, "").LocalHashes(tokens)[0]
	lora := New(4, name).LocalHashes(tokens)[0]
	if base == lora {
		t.Fatal("adapter must change block hashes")
	}
	if want := xxh3.HashSeed(leBytes(tokens), LoRASeed(name)); lora != want {
		t.Fatalf("lora hash %d want %d", lora, want)
	}
}

func TestSequenceHashesDependOnWholePrefix(t *testing.T) {
	a := SequenceHashes([]uint64{1, 2, 3})
	b := SequenceHashes([]uint64{9, 2, 3})
	for i := range a {
		if a[i] == b[i] {
			t.Fatalf("position %d: different prefixes gave equal sequence hash", i)
		}
	}
	c := SequenceHashes([]uint64{1, 2, 4})
	if a[0] != c[0] || a[1] != c[1] || a[2] == c[2] {
		t.Fatal("shared prefix must give shared sequence hashes up to the first difference")
	}
}

func BenchmarkHashes8192(b *testing.B) {
	tokens := tokens8192()
	h := New(16, "")
	b.SetBytes(8192 * 4)
	b.ReportAllocs()
	for b.Loop() {
		h.Hashes(tokens)
	}
}

func BenchmarkLocalHash16(b *testing.B) {
	tokens := make([]uint32, 16)
	h := New(16, "")
	for b.Loop() {
		h.LocalHash(tokens)
	}
}

func BenchmarkChain(b *testing.B) {
	x := uint64(1)
	for b.Loop() {
		x = Chain(x, 7)
	}
}

// checkSmallXXH3 compares the inlined XXH3 paths with the library.
func checkSmallXXH3(t *testing.T, block *[16]uint32, seed, parent, local uint64) {
	t.Helper()
	b := make([]byte, 64)
	putTokens(b, block[:])
	if got, want := hash16Tokens(block, seed), xxh3.HashSeed(b, seed); got != want {
		t.Fatalf("block %v seed %d: %#x, library %#x", block, seed, got, want)
	}
	var c [16]byte
	binary.LittleEndian.PutUint64(c[:8], parent)
	binary.LittleEndian.PutUint64(c[8:], local)
	if got, want := Chain(parent, local), xxh3.HashSeed(c[:], Seed); got != want {
		t.Fatalf("Chain(%#x, %#x) = %#x, library %#x", parent, local, got, want)
	}
}

// The inlined XXH3 paths agree with the library on random input, seeds of
// LoRA adapters included.
func TestSmallXXH3MatchesLibrary(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 100000 {
		var block [16]uint32
		for j := range block {
			block[j] = rng.Uint32()
		}
		seed := Seed
		if i%2 == 1 {
			seed = rng.Uint64()
		}
		checkSmallXXH3(t, &block, seed, rng.Uint64(), rng.Uint64())
	}
}

func FuzzSmallXXH3(f *testing.F) {
	f.Add(uint64(0), uint64(0), uint64(Seed), []byte{})
	f.Fuzz(func(t *testing.T, parent, local, seed uint64, raw []byte) {
		var block [16]uint32
		for j := range block {
			if 4*j+4 <= len(raw) {
				block[j] = binary.LittleEndian.Uint32(raw[4*j:])
			}
		}
		checkSmallXXH3(t, &block, seed, parent, local)
	})
}

// AppendHashes is AppendLocalHashes then AppendSequenceHashes, at every
// block size, appending to what the slices hold.
func TestAppendHashesMatchesTwoPasses(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, h := range []Hasher{New(1, "adapter"), New(7, "adapter"), New(16, ""), New(16, "adapter"), NewKeyed(16, "", "salt"), New(32, "adapter")} {
		bs := h.BlockSize()
		for n := range 200 {
			tokens := make([]uint32, n)
			for i := range tokens {
				tokens[i] = rng.Uint32()
			}
			wantLocal := h.AppendLocalHashes([]uint64{9}, tokens)
			wantSeq := AppendSequenceHashes([]uint64{8}, wantLocal[1:])
			local, seq := h.AppendHashes([]uint64{9}, []uint64{8}, tokens)
			if !slices.Equal(local, wantLocal) || !slices.Equal(seq, wantSeq) {
				t.Fatalf("block size %d, %d tokens: %v %v, want %v %v", bs, n, local, seq, wantLocal, wantSeq)
			}
		}
	}
}

// AppendChainedHashes continues a chain: a prompt hashed in two parts,
// the second chained on the first's last sequence hash, has the hashes of
// the whole, at every block size and cut.
func TestAppendChainedHashesContinueTheChain(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	for _, h := range []Hasher{New(1, "adapter"), New(7, ""), New(16, ""), NewKeyed(16, "", "salt"), New(32, "adapter")} {
		bs := h.BlockSize()
		tokens := make([]uint32, 40*bs+3)
		for i := range tokens {
			tokens[i] = rng.Uint32()
		}
		wantLocal, wantSeq := h.Hashes(tokens)
		for cut := 1; cut <= 40; cut++ {
			local, seq := h.AppendHashes([]uint64{9}, []uint64{8}, tokens[:cut*bs])
			local, seq = h.AppendChainedHashes(local, seq, seq[len(seq)-1], tokens[cut*bs:])
			if !slices.Equal(local[1:], wantLocal) || !slices.Equal(seq[1:], wantSeq) || local[0] != 9 || seq[0] != 8 {
				t.Fatalf("block size %d, cut after %d blocks: %v %v, want %v %v", bs, cut, local, seq, wantLocal, wantSeq)
			}
		}
	}
}

// tokens8192 is the benchmarks' prompt.
func tokens8192() []uint32 {
	tokens := make([]uint32, 8192)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	return tokens
}

func BenchmarkAppendHashes8192(b *testing.B) {
	tokens := tokens8192()
	h := New(16, "")
	var local, seq []uint64
	b.SetBytes(8192 * 4)
	for b.Loop() {
		local, seq = h.AppendHashes(local[:0], seq[:0], tokens)
	}
}

func BenchmarkTwoPassHashes8192(b *testing.B) {
	tokens := tokens8192()
	h := New(16, "")
	var local, seq []uint64
	b.SetBytes(8192 * 4)
	for b.Loop() {
		local = h.AppendLocalHashes(local[:0], tokens)
		seq = AppendSequenceHashes(seq[:0], local)
	}
}

func TestKeySeed(t *testing.T) {
	if KeySeed("", "") != Seed || LoRASeed("a") != KeySeed("a", "") {
		t.Fatal("KeySeed without a salt must be LoRASeed")
	}
	// Dynamo's kv-hashing: 1337 + xxh3(lora, 0) + xxh3(salt, 1), wrapping.
	want := Seed + xxh3.HashString("sql-lora") + xxh3.HashStringSeed("tenant-a", 1)
	if got := KeySeed("sql-lora", "tenant-a"); got != want {
		t.Fatalf("KeySeed = %d, want %d", got, want)
	}
	seeds := map[uint64]string{}
	for _, k := range [][2]string{{"", ""}, {"a", ""}, {"", "a"}, {"a", "a"}, {"a", "b"}, {"b", "a"}} {
		s := KeySeed(k[0], k[1])
		if prev, dup := seeds[s]; dup {
			t.Fatalf("%v and %s share a seed", k, prev)
		}
		seeds[s] = fmt.Sprint(k)
	}
	toks := make([]uint32, 16)
	if NewKeyed(16, "", "t").LocalHash(toks) == New(16, "").LocalHash(toks) {
		t.Fatal("a salted block hashed like an unsalted one")
	}
}

func TestLocalHashMM(t *testing.T) {
	h := New(4, "")
	block := []uint32{1, 2, 3, 4}
	if h.LocalHashMM(block, nil) != h.LocalHash(block) {
		t.Fatal("no identifiers must hash as a text block")
	}
	// tokens LE u32, then sorted identifiers LE u64
	b := []byte{1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0}
	if got, want := h.LocalHashMM(block, []uint64{9, 5}), xxh3.HashSeed(b, Seed); got != want {
		t.Fatalf("LocalHashMM = %d, want %d", got, want)
	}
	if h.LocalHashMM(block, []uint64{5}) == h.LocalHashMM(block, []uint64{6}) {
		t.Fatal("different images, same block id")
	}
	digest := "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
	if v, ok := HashMMIdentifier(digest); !ok || v != 0x9f86d081884c7d65 {
		t.Fatalf("digest: %x %v", v, ok)
	}
	if v, ok := HashMMIdentifier("img-1"); !ok || v != xxh3.HashString("img-1") {
		t.Fatalf("opaque id: %x", v)
	}
	if _, ok := HashMMIdentifier(""); ok {
		t.Fatal("empty identifier accepted")
	}
}
