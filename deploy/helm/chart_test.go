// Package helm holds the chart's tests: helm lint and helm template in
// every discovery mode, and the rendered objects applied with a
// server-side dry run to a real kube-apiserver.
package helm

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	yamlutil "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"

	"github.com/kvrouter/kvrouter/internal/kubetest"
)

const chart = "kvrouter"

// modes are the values of each discovery mode.
var modes = map[string][]string{
	"static":     {"discovery=static", "static.workers[0]=url=http://vllm-0.vllm:8000\\,events=tcp://vllm-0.vllm:5557"},
	"nats":       {"discovery=nats", "nats.url=nats://nats:4222", "replicaSync=true", "auth.apiKeySecret=kvrouter-auth", "auth.adminTokenSecret=kvrouter-auth", "nats.credentialsSecret=kvrouter-nats"},
	"kubernetes": {"discovery=kubernetes", "kubernetes.selector=app=vllm", "grafanaDashboard.enabled=true"},
	"epp":        {"discovery=epp", "epp.inferencePool.create=true"},
}

func helm(t *testing.T, args ...string) string {
	t.Helper()
	bin, err := kubetest.Helm()
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal(err)
		}
		t.Skipf("no helm: %v", err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("helm %s: %v\n%s%s", strings.Join(args, " "), err, out.String(), stderr.String())
	}
	return out.String()
}

func setArgs(mode string) []string {
	var a []string
	for _, s := range modes[mode] {
		a = append(a, "--set", s)
	}
	return a
}

func render(t *testing.T, mode string) []*unstructured.Unstructured {
	t.Helper()
	out := helm(t, append([]string{"template", "kr", chart, "--namespace", "llm"}, setArgs(mode)...)...)
	dec := yamlutil.NewYAMLOrJSONDecoder(strings.NewReader(out), 4096)
	var objs []*unstructured.Unstructured
	for {
		var m map[string]any
		err := dec.Decode(&m)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("mode %s: helm template's output: %v", mode, err)
		}
		if m != nil {
			objs = append(objs, &unstructured.Unstructured{Object: m})
		}
	}
	return objs
}

func TestLint(t *testing.T) {
	for mode := range modes {
		helm(t, append([]string{"lint", "--strict", chart}, setArgs(mode)...)...)
	}
}

// TestTemplate checks what each mode renders.
func TestTemplate(t *testing.T) {
	for mode := range modes {
		objs := render(t, mode)
		kinds := map[string]*unstructured.Unstructured{}
		for _, o := range objs {
			kinds[o.GetKind()] = o
		}
		dep := kinds["Deployment"]
		if dep == nil || kinds["Service"] == nil || kinds["PodDisruptionBudget"] == nil {
			t.Fatalf("mode %s: want a Deployment, a Service and a PodDisruptionBudget, got %v", mode, kinds)
		}
		// JSON numbers: the decoder gives float64.
		graceField, _, _ := unstructured.NestedFieldNoCopy(dep.Object, "spec", "template", "spec", "terminationGracePeriodSeconds")
		grace, _ := graceField.(float64)
		nonRoot, _, _ := unstructured.NestedBool(dep.Object, "spec", "template", "spec", "securityContext", "runAsNonRoot")
		if grace <= 30 || !nonRoot {
			t.Errorf("mode %s: terminationGracePeriodSeconds %v (want above --shutdown-timeout 30), runAsNonRoot %v", mode, grace, nonRoot)
		}
		containers, _, _ := unstructured.NestedSlice(dep.Object, "spec", "template", "spec", "containers")
		args, _, _ := unstructured.NestedStringSlice(containers[0].(map[string]any), "args")
		if len(args) == 0 || args[0] != "serve" || slices.Contains(args, "--epp-port=9002") != (mode == "epp") {
			t.Errorf("mode %s: args %v, want serve, with --epp-port=9002 in mode epp only", mode, args)
		}
		watches := mode == "kubernetes" || mode == "epp"
		if role := kinds["Role"]; (role != nil) != watches {
			t.Errorf("mode %s: Role rendered %v, want %v", mode, role != nil, watches)
		} else if role != nil {
			rules, _, _ := unstructured.NestedSlice(role.Object, "rules")
			for _, r := range rules {
				verbs, _, _ := unstructured.NestedStringSlice(r.(map[string]any), "verbs")
				if strings.Join(verbs, ",") != "get,list,watch" {
					t.Errorf("mode %s: Role grants %v, want get, list, watch only", mode, verbs)
				}
			}
		}
	}
	// The pod is killed at the end of its grace period: a grace shorter
	// than the drain cuts requests.
	bin, err := kubetest.Helm()
	if err != nil {
		t.Skip(err)
	}
	out, err := exec.Command(bin, "template", "kr", chart, "--set", "discovery=kubernetes", "--set", "terminationGracePeriodSeconds=20").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "terminationGracePeriodSeconds must exceed shutdownTimeoutSeconds") {
		t.Errorf("a grace period below the shutdown timeout: err %v, output %s", err, out)
	}
}

// TestGrafanaBoardCopy: the chart ships deploy/grafana's board.
func TestGrafanaBoardCopy(t *testing.T) {
	a, err := os.ReadFile("../grafana/kvrouter.json")
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(chart + "/files/kvrouter.json")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a, b) {
		t.Fatal("deploy/helm/kvrouter/files/kvrouter.json differs from deploy/grafana/kvrouter.json: copy it over")
	}
}

// TestDryRunApply applies every mode's objects to a real API server with
// a server-side dry run: the API server validates them against its
// schemas, the InferencePool's CRD included. The ServiceMonitor (a
// Prometheus operator CRD) is left out.
func TestDryRunApply(t *testing.T) {
	env := kubetest.Start(t)
	kubetest.ApplyCRDs(t, env, kubetest.InferencePoolCRD(t))
	dc := discovery.NewDiscoveryClientForConfigOrDie(env.Config)
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	dyn := dynamic.NewForConfigOrDie(env.Config)
	ctx := context.Background()
	ns := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": "llm"}}}
	nsGVR, _ := mapper.RESTMapping(ns.GroupVersionKind().GroupKind(), "v1")
	if _, err := dyn.Resource(nsGVR.Resource).Create(ctx, ns, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for mode := range modes {
		for _, o := range render(t, mode) {
			gvk := o.GroupVersionKind()
			m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
			if err != nil {
				t.Fatalf("mode %s: %s: %v", mode, gvk, err)
			}
			body, err := o.MarshalJSON()
			if err != nil {
				t.Fatal(err)
			}
			force := true
			_, err = dyn.Resource(m.Resource).Namespace("llm").Patch(ctx, o.GetName(), types.ApplyPatchType, body,
				metav1.PatchOptions{DryRun: []string{metav1.DryRunAll}, FieldManager: "kvrouter-chart-test", Force: &force})
			if err != nil {
				t.Errorf("mode %s: server-side dry-run apply of %s %s: %v", mode, o.GetKind(), o.GetName(), err)
			}
		}
	}
}
