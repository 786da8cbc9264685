package kubetest

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"
)

// GIEVersion is the Gateway API Inference Extension release whose
// InferencePool CRD the tests install.
const GIEVersion = "v1.3.0"

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// InferencePoolCRD is the InferencePool CRD of GIEVersion, from its module
// (downloaded through the Go module proxy).
func InferencePoolCRD(t testing.TB) []byte {
	t.Helper()
	out, err := exec.Command("go", "mod", "download", "-json", "sigs.k8s.io/gateway-api-inference-extension@"+GIEVersion).Output()
	if err != nil {
		t.Fatalf("downloading the Inference Extension module: %v", err)
	}
	var mod struct{ Dir string }
	if err := json.Unmarshal(out, &mod); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(mod.Dir, "config", "crd", "bases", "inference.networking.k8s.io_inferencepools.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// ApplyCRDs creates CRDs (YAML) and waits until their resources are served.
func ApplyCRDs(t testing.TB, env *Env, crds ...[]byte) {
	t.Helper()
	dyn := dynamic.NewForConfigOrDie(env.Config)
	ctx := context.Background()
	for _, y := range crds {
		var obj map[string]any
		if err := yaml.Unmarshal(y, &obj); err != nil {
			t.Fatal(err)
		}
		u := &unstructured.Unstructured{Object: obj}
		if _, err := dyn.Resource(crdGVR).Create(ctx, u, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		group, _, _ := unstructured.NestedString(obj, "spec", "group")
		plural, _, _ := unstructured.NestedString(obj, "spec", "names", "plural")
		versions, _, _ := unstructured.NestedSlice(obj, "spec", "versions")
		for _, v := range versions {
			name, _, _ := unstructured.NestedString(v.(map[string]any), "name")
			gvr := schema.GroupVersionResource{Group: group, Version: name, Resource: plural}
			deadline := time.Now().Add(30 * time.Second)
			for {
				_, err := dyn.Resource(gvr).List(ctx, metav1.ListOptions{})
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("CRD %s not served within 30 s: %v", gvr, err)
				}
				time.Sleep(50 * time.Millisecond) // polling the API server, bounded by the deadline
			}
		}
	}
}
