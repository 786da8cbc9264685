package hftokenizer

import (
	"fmt"
	"strings"
	"testing"
)

// benchText is English prose and Go code, varied per paragraph so the word
// cache sees realistic reuse rather than one repeated paragraph.
func benchText(paragraphs int) string {
	var b strings.Builder
	for i := range paragraphs {
		fmt.Fprintf(&b, "Paragraph %d. The router sends each request to the engine that already caches "+
			"the longest prefix of its prompt, weighing that against the engine's load; it doesn't "+
			"guess, it measures. Requests #%d and #%d share %d%% of their tokens.\n\n", i, i*7, i*13, i%100)
		fmt.Fprintf(&b, "func handler%d(w http.ResponseWriter, r *http.Request) {\n\tids, err := tok.Encode(r.FormValue(\"q%d\"), true)\n"+
			"\tif err != nil {\n\t\thttp.Error(w, err.Error(), http.StatusBadRequest)\n\t\treturn\n\t}\n\tfmt.Fprintln(w, len(ids))\n}\n\n", i, i)
	}
	return b.String()
}

func BenchmarkEncodeLlama3(b *testing.B) {
	tok := loadTestTokenizer(b, "llama3")
	text := benchText(74)
	ids, err := tok.Encode(text, true)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(text)))
	b.ResetTimer()
	for b.Loop() {
		if _, err := tok.Encode(text, true); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(len(ids)), "tokens/op")
	b.ReportMetric(float64(len(ids))*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
}
