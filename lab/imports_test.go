// Package lab_test checks the line between what ships and what measures:
// the router, its adapters, the mocker and the service assembly never
// import the benchmarks, the simulator or the fault injectors, so that a
// change to a measurement cannot change what runs in production. Only the
// binary's commands (cmd/kvrouter) and tests may.
package lab_test

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/kvrouter/kvrouter/"

func TestShippedPackagesDoNotImportTheLab(t *testing.T) {
	out, err := exec.Command("go", "list", "-json=ImportPath,Imports", "../...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	checked := 0
	for dec.More() {
		var p struct {
			ImportPath string
			Imports    []string
		}
		if err := dec.Decode(&p); err != nil {
			t.Fatal(err)
		}
		rel := strings.TrimPrefix(p.ImportPath, module)
		if strings.HasPrefix(rel, "lab/") || rel == "lab" || strings.HasPrefix(rel, "cmd/") || rel == "docs" {
			continue
		}
		checked++
		for _, imp := range p.Imports {
			if strings.HasPrefix(imp, module+"lab/") {
				t.Errorf("%s imports %s: what ships must not depend on what measures", rel, imp)
			}
		}
	}
	if checked < 20 {
		t.Fatalf("only %d shipped packages listed; is the module layout what this test expects?", checked)
	}
}
