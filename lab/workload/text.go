package workload

import (
	"fmt"
	"strings"
)

// ProseAndCode is English prose and Go code, varied per paragraph so a
// tokenizer's word cache sees realistic reuse rather than one repeated
// paragraph; about 111 Llama-3 tokens per paragraph (74 make about 8,200).
func ProseAndCode(paragraphs int) string {
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
