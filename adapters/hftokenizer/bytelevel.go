package hftokenizer

import "unicode/utf8"

// byteLevelRune inverts GPT-2's bytes_to_unicode: byte-level vocabularies
// spell each byte as a printable rune, bytes that are printable Latin-1 as
// themselves and the rest as U+0100 upwards in byte order.
var byteLevelRune = func() map[rune]byte {
	m := make(map[rune]byte, 256)
	n := 0
	for b := 0; b < 256; b++ {
		if '!' <= b && b <= '~' || 0xA1 <= b && b <= 0xAC || 0xAE <= b && b <= 0xFF {
			m[rune(b)] = byte(b)
			continue
		}
		m[rune(256+n)] = byte(b)
		n++
	}
	return m
}()

// fromByteLevel returns the raw bytes a byte-level token stands for, or
// false if tok uses runes outside the byte-level alphabet.
func fromByteLevel(tok string) (string, bool) {
	out := make([]byte, 0, utf8.RuneCountInString(tok))
	for _, r := range tok {
		b, ok := byteLevelRune[r]
		if !ok {
			return "", false
		}
		out = append(out, b)
	}
	return string(out), true
}
