package tokenizer

import (
	"slices"
	"testing"
)

func TestGeneratedTextTokenizesBackToItsIDs(t *testing.T) {
	var ids []uint32
	for id := FirstWordID; id < VocabSize; id += 997 {
		ids = append(ids, id)
	}
	ids = append(ids, VocabSize-1)
	if got := Encode(Decode(ids)); !slices.Equal(got, ids) {
		t.Fatalf("round trip lost ids: %v → %q → %v", ids[:5], Decode(ids[:5]), got[:5])
	}
}

func TestEncode(t *testing.T) {
	tests := []struct {
		name string
		text string
		n    int
	}{
		{"words with spaces", "Hello world, how are you?", 7},
		{"empty", "", 0},
		{"unicode", "héllo wörld", 2},
		{"special tokens", "<|user|>hi<|end|>", 3},
		{"not a special token", "<b>", 3},
		{"invalid utf8", "a\xffb", 3},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ids := Encode(tc.text)
			if len(ids) != tc.n {
				t.Fatalf("Encode(%q) = %v, want %d ids", tc.text, ids, tc.n)
			}
			for _, id := range ids {
				if id >= VocabSize {
					t.Fatalf("id %d out of vocabulary", id)
				}
			}
			if !slices.Equal(Encode(tc.text), ids) {
				t.Fatal("not deterministic")
			}
		})
	}
	if slices.Equal(Encode("cat"), Encode("dog")) || !slices.Equal(Encode(" cat"), Encode(" cat")) {
		t.Fatal("different words must differ, equal words agree")
	}
}

func TestChatTemplateSharesPrefixAcrossTurns(t *testing.T) {
	turn1 := []Message{{"system", "You are terse."}, {"user", "Name a colour."}}
	p1 := ApplyChatTemplate(turn1, true)
	answer := Decode([]uint32{1000, 2000, 3000})
	turn2 := append(slices.Clone(turn1), Message{"assistant", answer}, Message{"user", "Another?"})
	p2 := ApplyChatTemplate(turn2, true)
	if !slices.Equal(p2[:len(p1)-1], p1[:len(p1)-1]) {
		t.Fatal("the second turn must extend the first turn's prompt")
	}
	if p1[0] != BOS || p1[len(p1)-1] != AssistantRole {
		t.Fatalf("template framing: %v", p1)
	}
}

func FuzzEncode(f *testing.F) {
	f.Add("Hello <|user|> wörld\xff")
	f.Fuzz(func(t *testing.T, s string) {
		for _, id := range Encode(s) {
			if id == 0 || id >= VocabSize {
				t.Fatalf("id %d from %q", id, s)
			}
		}
	})
}
