package kubediscovery_test

import (
	"context"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/kvrouter/kvrouter/adapters/kubediscovery"
	"github.com/kvrouter/kvrouter/internal/kubetest"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// fleet records the engines a Watcher reports.
type fleet struct {
	mu    sync.Mutex
	ready map[uint64]kubediscovery.Engine
	gone  map[uint64]string
}

func (f *fleet) handler() kubediscovery.Handler {
	return kubediscovery.Handler{
		Ready: func(e kubediscovery.Engine) {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.ready[e.ID] = e
			delete(f.gone, e.ID)
		},
		Gone: func(id uint64, why string) {
			f.mu.Lock()
			defer f.mu.Unlock()
			delete(f.ready, id)
			f.gone[id] = why
		},
	}
}

func (f *fleet) byName(name string) (kubediscovery.Engine, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, e := range f.ready {
		if e.Name == name {
			return e, true
		}
	}
	return kubediscovery.Engine{}, false
}

func (f *fleet) why(id uint64) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.gone[id]
}

func pod(name, app string, ann map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app": app}, Annotations: ann},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vllm", Image: "vllm/vllm-openai"}}},
	}
}

// setStatus does what the kubelet would (there is none): the pod runs at
// ip, ready or not, after restarts.
func setStatus(t *testing.T, c kubernetes.Interface, ns, name, ip string, ready bool, restarts int32) {
	t.Helper()
	ctx := context.Background()
	p, err := c.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cond := corev1.ConditionFalse
	if ready {
		cond = corev1.ConditionTrue
	}
	p.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}},
		Conditions:        []corev1.PodCondition{{Type: corev1.PodReady, Status: cond}},
		ContainerStatuses: []corev1.ContainerStatus{{Name: "vllm", Ready: ready, RestartCount: restarts, Image: "vllm/vllm-openai"}}}
	if _, err := c.CoreV1().Pods(ns).UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestPodsAgainstAPIServer drives discovery through a real kube-apiserver:
// pods join when ready, with the addresses of the convention, and leave
// within a second when unready, terminating or deleted; a restart is a
// leave and a join.
func TestPodsAgainstAPIServer(t *testing.T) {
	env := kubetest.Start(t)
	c := kubernetes.NewForConfigOrDie(env.Config)
	ctx := context.Background()
	ns := "engines"
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []*corev1.Pod{
		pod("vllm-a", "vllm", nil),
		pod("vllm-b", "vllm", map[string]string{kubediscovery.AnnotationPort: "9000", kubediscovery.AnnotationEventsPort: "6000", kubediscovery.AnnotationReplayPort: "6001", kubediscovery.AnnotationModel: "llama", kubediscovery.AnnotationDPSize: "2"}),
		pod("other", "web", nil),
	} {
		if _, err := c.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	setStatus(t, c, ns, "vllm-a", "10.1.0.1", true, 0)
	setStatus(t, c, ns, "other", "10.1.0.3", true, 0)
	setStatus(t, c, ns, "vllm-b", "10.1.0.2", false, 0)

	f := &fleet{ready: map[uint64]kubediscovery.Engine{}, gone: map[uint64]string{}}
	w, err := kubediscovery.Start(ctx, kubediscovery.Config{Client: c, Namespace: ns, Selector: "app=vllm"}, f.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	// The first list is reported before Start returns.
	a, ok := f.byName("vllm-a")
	if !ok {
		t.Fatal("the ready pod vllm-a was not reported by the time Start returned")
	}
	if a.URL != "http://10.1.0.1:8000" || a.Events != "tcp://10.1.0.1:5557" || a.Replay != "" || a.DPSize != 1 {
		t.Fatalf("vllm-a without annotations: got %+v, want vLLM's default ports", a)
	}
	if _, ok := f.byName("vllm-b"); ok {
		t.Fatal("the unready pod vllm-b was reported ready")
	}
	if _, ok := f.byName("other"); ok {
		t.Fatal("a pod outside the selector was reported")
	}

	setStatus(t, c, ns, "vllm-b", "10.1.0.2", true, 0)
	testwait.Until(t, time.Second, "vllm-b joins once ready", func() bool { _, ok := f.byName("vllm-b"); return ok })
	b, _ := f.byName("vllm-b")
	if b.URL != "http://10.1.0.2:9000" || b.Events != "tcp://10.1.0.2:6000" || b.Replay != "tcp://10.1.0.2:6001" || b.Model != "llama" || b.DPSize != 2 {
		t.Fatalf("vllm-b's annotations not applied: %+v", b)
	}

	setStatus(t, c, ns, "vllm-b", "10.1.0.2", true, 1)
	testwait.Until(t, time.Second, "vllm-b re-reported after a restart", func() bool { e, ok := f.byName("vllm-b"); return ok && e.Restarts == 1 })

	setStatus(t, c, ns, "vllm-a", "10.1.0.1", false, 0)
	testwait.Until(t, time.Second, "vllm-a leaves when unready", func() bool { return f.why(a.ID) == "pod not ready" })

	// A pod with a finalizer stays, terminating, after its deletion: it
	// must leave at once all the same.
	p, err := c.CoreV1().Pods(ns).Get(ctx, "vllm-b", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p.Finalizers = []string{"kvrouter.io/test"}
	if _, err := c.CoreV1().Pods(ns).Update(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().Pods(ns).Delete(ctx, "vllm-b", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, time.Second, "vllm-b leaves when terminating", func() bool { return f.why(b.ID) == "pod terminating" })
}

// inferencePool is the pool llama in namespace default, selecting the pods
// labelled app, at port.
func inferencePool(app string, port int64) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": "llama", "namespace": "default"},
		"spec": map[string]any{
			"selector":          map[string]any{"matchLabels": map[string]any{"app": app}},
			"targetPorts":       []any{map[string]any{"number": port}},
			"endpointPickerRef": map[string]any{"name": "kvrouter-epp", "port": map[string]any{"number": int64(9002)}},
		},
	}}
}

// TestInferencePoolSelector takes the pods and the port from an
// InferencePool.
func TestInferencePoolSelector(t *testing.T) {
	env := kubetest.Start(t)
	ctx := context.Background()
	c := kubernetes.NewForConfigOrDie(env.Config)
	dyn := dynamic.NewForConfigOrDie(env.Config)
	kubetest.ApplyCRDs(t, env, kubetest.InferencePoolCRD(t))
	if _, err := dyn.Resource(kubediscovery.InferencePoolGVR).Namespace("default").Create(ctx, inferencePool("vllm", 8200), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CoreV1().Pods("default").Create(ctx, pod("vllm-0", "vllm", nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	setStatus(t, c, "default", "vllm-0", "10.2.0.1", true, 0)
	f := &fleet{ready: map[uint64]kubediscovery.Engine{}, gone: map[uint64]string{}}
	w, err := kubediscovery.Start(ctx, kubediscovery.Config{Client: c, Dynamic: dyn, Namespace: "default", InferencePool: "llama"}, f.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	e, ok := f.byName("vllm-0")
	if !ok || e.URL != "http://10.2.0.1:8200" {
		t.Fatalf("pool's pod: got %+v (reported %v), want url http://10.2.0.1:8200", e, ok)
	}
}

// TestInferencePoolWatched: the engines follow the InferencePool within a
// second when its target port or its selector changes, leave when it is
// deleted and come back when it is created again.
func TestInferencePoolWatched(t *testing.T) {
	env := kubetest.Start(t)
	ctx := context.Background()
	c := kubernetes.NewForConfigOrDie(env.Config)
	dyn := dynamic.NewForConfigOrDie(env.Config)
	kubetest.ApplyCRDs(t, env, kubetest.InferencePoolCRD(t))
	pools := dyn.Resource(kubediscovery.InferencePoolGVR).Namespace("default")
	update := func(app string, port int64) {
		t.Helper()
		u, err := pools.Get(ctx, "llama", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		u.Object["spec"] = inferencePool(app, port).Object["spec"]
		if _, err := pools.Update(ctx, u, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pools.Create(ctx, inferencePool("vllm", 8200), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for name, app := range map[string]string{"vllm-0": "vllm", "sglang-0": "sglang"} {
		if _, err := c.CoreV1().Pods("default").Create(ctx, pod(name, app, nil), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	setStatus(t, c, "default", "vllm-0", "10.3.0.1", true, 0)
	setStatus(t, c, "default", "sglang-0", "10.3.0.2", true, 0)
	f := &fleet{ready: map[uint64]kubediscovery.Engine{}, gone: map[uint64]string{}}
	w, err := kubediscovery.Start(ctx, kubediscovery.Config{Client: c, Dynamic: dyn, Namespace: "default", InferencePool: "llama"}, f.handler())
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	v, ok := f.byName("vllm-0")
	if !ok || v.URL != "http://10.3.0.1:8200" {
		t.Fatalf("pool's pod: got %+v (reported %v), want url http://10.3.0.1:8200", v, ok)
	}
	urlOf := func(name string) string {
		e, _ := f.byName(name)
		return e.URL
	}

	update("vllm", 8300)
	testwait.Until(t, time.Second, "vllm-0 at the pool's new target port", func() bool { return urlOf("vllm-0") == "http://10.3.0.1:8300" })

	update("sglang", 8300)
	testwait.Until(t, time.Second, "the engines follow the pool's new selector", func() bool {
		return urlOf("vllm-0") == "" && urlOf("sglang-0") == "http://10.3.0.2:8300"
	})
	if why := f.why(v.ID); why != "pod outside InferencePool llama's selector" {
		t.Errorf("vllm-0 left with %q", why)
	}

	if err := pools.Delete(ctx, "llama", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, time.Second, "the engines leave with the pool", func() bool { return urlOf("sglang-0") == "" })

	if _, err := pools.Create(ctx, inferencePool("vllm", 8200), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, time.Second, "the engines come back with the pool", func() bool {
		return urlOf("vllm-0") == "http://10.3.0.1:8200" && urlOf("sglang-0") == ""
	})
}
