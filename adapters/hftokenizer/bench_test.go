package hftokenizer

import (
	"testing"

	"github.com/kvrouter/kvrouter/lab/workload"
)

func BenchmarkEncodeLlama3(b *testing.B) { benchmarkEncode(b, "llama3") }

func BenchmarkEncodeGemma3(b *testing.B) { benchmarkEncode(b, "gemma3") }

func BenchmarkEncodeLlama2(b *testing.B) { benchmarkEncode(b, "llama2") }

// benchmarkEncode encodes the prose and code of `kvrouter bench tokenize`
// with special tokens, as a completions prompt is.
func benchmarkEncode(b *testing.B, model string) {
	tok := loadTestTokenizer(b, model)
	text := workload.ProseAndCode(74)
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
