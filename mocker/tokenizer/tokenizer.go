// Package tokenizer is the simulated engine's tokenizer: deterministic,
// dependency-free and cheap, with one property real tokenizers have that
// routing depends on: text the engine generated tokenizes back to exactly
// the ids it generated, so a multi-turn conversation that replays the
// assistant's answers reuses the cached blocks.
//
// Text is cut into pieces: runs of letters and digits (with the single
// space before them, as byte-level BPE vocabularies do) and single other
// characters. A piece that spells a vocabulary word (three consonant-vowel
// syllables after a space, e.g. " bakedo") is that word's id; any other
// piece gets an id from a hash of its bytes. Ids below FirstWordID are
// special tokens (chat roles).
package tokenizer

import (
	"hash/fnv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// VocabSize is the number of token ids; ids ≥ VocabSize are invalid.
const VocabSize = 128000

// Special tokens of the chat template.
const (
	BOS uint32 = iota + 1
	SystemRole
	UserRole
	AssistantRole
	ToolRole
	EndOfTurn
	// Image and Audio are the placeholders of a chat's media items, which
	// the engine expands to its fixed number of tokens per item.
	Image
	Audio
	FirstWordID uint32 = 256
)

const (
	consonants = "bdfghjklmnprstvz" // 16
	vowels     = "aeiou"            // 5
	syllables  = len(consonants) * len(vowels)
	wordLen    = 3 // syllables per word: 80³ = 512,000 ≥ VocabSize
)

// Word returns the text of token id: a space and three syllables for
// ordinary ids, a marker for special ones.
func Word(id uint32) string {
	switch id {
	case BOS:
		return "<s>"
	case SystemRole:
		return "<|system|>"
	case UserRole:
		return "<|user|>"
	case AssistantRole:
		return "<|assistant|>"
	case ToolRole:
		return "<|tool|>"
	case EndOfTurn:
		return "<|end|>"
	case Image:
		return "<image>"
	case Audio:
		return "<audio>"
	}
	var b [1 + 2*wordLen]byte
	b[0] = ' '
	x := int(id)
	for i := wordLen - 1; i >= 0; i-- {
		s := x % syllables
		x /= syllables
		b[1+2*i] = consonants[s/len(vowels)]
		b[2+2*i] = vowels[s%len(vowels)]
	}
	return string(b[:])
}

// Decode renders ids as text.
func Decode(ids []uint32) string {
	var sb strings.Builder
	for _, id := range ids {
		sb.WriteString(Word(id))
	}
	return sb.String()
}

// wordID reads a piece back as a vocabulary word's id.
func wordID(piece string) (uint32, bool) {
	if len(piece) != 1+2*wordLen || piece[0] != ' ' {
		return 0, false
	}
	x := 0
	for i := range wordLen {
		c := strings.IndexByte(consonants, piece[1+2*i])
		v := strings.IndexByte(vowels, piece[2+2*i])
		if c < 0 || v < 0 {
			return 0, false
		}
		x = x*syllables + c*len(vowels) + v
	}
	if x < int(FirstWordID) || x >= VocabSize {
		return 0, false
	}
	return uint32(x), true
}

func hashID(piece string) uint32 {
	h := fnv.New64a()
	h.Write([]byte(piece))
	return FirstWordID + uint32(h.Sum64()%uint64(VocabSize-FirstWordID))
}

var specials = map[string]uint32{
	"<s>": BOS, "<|system|>": SystemRole, "<|user|>": UserRole,
	"<|assistant|>": AssistantRole, "<|tool|>": ToolRole, "<|end|>": EndOfTurn,
	"<image>": Image, "<audio>": Audio,
}

// Encode tokenizes text.
func Encode(text string) []uint32 {
	ids := make([]uint32, 0, len(text)/4+1)
	for i := 0; i < len(text); {
		if text[i] == '<' {
			if j := strings.Index(text[i:], ">"); j > 0 {
				if id, ok := specials[text[i:i+j+1]]; ok {
					ids = append(ids, id)
					i += j + 1
					continue
				}
			}
		}
		start := i
		if text[i] == ' ' && i+1 < len(text) && isWordByte(text, i+1) {
			i++ // the space belongs to the word after it
		}
		if isWordByte(text, i) {
			for i < len(text) && isWordByte(text, i) {
				_, size := utf8.DecodeRuneInString(text[i:])
				i += size
			}
		} else {
			_, size := utf8.DecodeRuneInString(text[i:])
			i += size
		}
		piece := text[start:i]
		if id, ok := wordID(piece); ok {
			ids = append(ids, id)
		} else {
			ids = append(ids, hashID(piece))
		}
	}
	return ids
}

func isWordByte(s string, i int) bool {
	r, _ := utf8.DecodeRuneInString(s[i:])
	return unicode.IsLetter(r) || unicode.IsDigit(r)
}

// Message is one chat message.
type Message struct {
	Role    string
	Content string
}

func roleToken(role string) uint32 {
	switch role {
	case "system", "developer":
		return SystemRole
	case "assistant":
		return AssistantRole
	case "tool":
		return ToolRole
	}
	return UserRole
}

// ApplyChatTemplate tokenizes a conversation: BOS, then per message its
// role token, its content and an end-of-turn token, then (for a prompt
// awaiting the model's answer) the assistant role token.
func ApplyChatTemplate(msgs []Message, addGenerationPrompt bool) []uint32 {
	ids := []uint32{BOS}
	for _, m := range msgs {
		ids = append(ids, roleToken(m.Role))
		ids = append(ids, Encode(m.Content)...)
		ids = append(ids, EndOfTurn)
	}
	if addGenerationPrompt {
		ids = append(ids, AssistantRole)
	}
	return ids
}
