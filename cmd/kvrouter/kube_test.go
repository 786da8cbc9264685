package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/kvrouter/kvrouter/adapters/kubediscovery"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/internal/kubetest"
	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// enginePod is a pod for a simulated engine on 127.0.0.1: the annotations
// carry its ports, and its status (set by the test: there is no kubelet)
// gives it 127.0.0.1 as its IP.
func enginePod(t *testing.T, c kubernetes.Interface, name string, f *fleet.Fleet) {
	t.Helper()
	e := f.Engines()[0]
	port := func(addr string) string {
		u, err := url.Parse(addr)
		if err != nil {
			t.Fatal(err)
		}
		return u.Port()
	}
	createPod(t, c, name, map[string]string{
		kubediscovery.AnnotationPort: port(e.HTTPURL), kubediscovery.AnnotationEventsPort: port(e.Ranks[0].Events),
		kubediscovery.AnnotationReplayPort: port(e.Ranks[0].Replay), kubediscovery.AnnotationModel: "kvrouter-mock",
	})
}

// createPod creates a ready engine pod with the annotations, at 127.0.0.1.
func createPod(t *testing.T, c kubernetes.Interface, name string, ann map[string]string) {
	t.Helper()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app": "engine"}, Annotations: ann},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "engine", Image: "kvrouter"}}},
	}
	if _, err := c.CoreV1().Pods("default").Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	setReady(t, c, name, true)
}

func setReady(t *testing.T, c kubernetes.Interface, name string, ready bool) {
	t.Helper()
	ctx := context.Background()
	p, err := c.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cond := corev1.ConditionFalse
	if ready {
		cond = corev1.ConditionTrue
	}
	p.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "127.0.0.1", PodIPs: []corev1.PodIP{{IP: "127.0.0.1"}},
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: cond}}}
	if _, err := c.CoreV1().Pods("default").UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// routedTo sends one completion and returns the engine it went to.
func routedTo(t *testing.T, s *serve.Server, salt int) uint64 {
	t.Helper()
	p := make([]int, 64)
	for i := range p {
		p[i] = 300 + i*7 + salt*1000 // within the mock model's 128,000-token vocabulary
	}
	b, _ := json.Marshal(map[string]any{"model": "kvrouter-mock", "prompt": p, "max_tokens": 2, "nvext": map[string]any{"extra_fields": []string{"worker_id"}}})
	resp, err := http.Post(s.URL()+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		NVExt struct {
			WorkerID uint64 `json:"worker_id"`
		} `json:"nvext"`
	}
	body, err := io.ReadAll(resp.Body)
	if err == nil {
		err = json.Unmarshal(body, &out)
	}
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("completion: %d %v %s", resp.StatusCode, err, body)
	}
	return out.NVExt.WorkerID
}

// serveKube runs serve with --discovery kubernetes on the pods labelled
// app=engine, and waits for n of them in routing.
func serveKube(t *testing.T, env *kubetest.Env, cfg serve.Config, n int) *serve.Server {
	t.Helper()
	kf := kubeFlags{mode: "kubernetes", kubeconfig: env.Kubeconfig, namespace: "default", selector: "app=engine"}
	d, err := kf.discovery(nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Addr, cfg.HealthInterval, cfg.Discovery = "127.0.0.1:0", 50*time.Millisecond, d
	s, err := serve.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.WaitWorkers(ctx, func(live int) bool { return live == n }); err != nil {
		t.Fatalf("the %d ready pods did not join routing: %v", n, err)
	}
	return s
}

// TestServeFollowsKubernetesPods runs serve with --discovery kubernetes
// against a real kube-apiserver: engines join when their pods are ready and
// routing stops sending to a pod within a second of it turning unready.
func TestServeFollowsKubernetesPods(t *testing.T) {
	env := kubetest.Start(t)
	c := kubernetes.NewForConfigOrDie(env.Config)
	newEngine := func() *fleet.Fleet {
		cfg := fleet.DefaultConfig()
		cfg.SpeedupRatio = 100
		cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
		f, err := fleet.Start(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(f.Close)
		return f
	}
	enginePod(t, c, "engine-a", newEngine())
	enginePod(t, c, "engine-b", newEngine())

	s := serveKube(t, env, serve.Config{Router: router.DefaultConfig()}, 2)
	seen := map[uint64]bool{}
	for i := range 20 {
		seen[routedTo(t, s, i)] = true
	}
	if len(seen) != 2 {
		t.Fatalf("20 distinct prompts went to %d engines, want both", len(seen))
	}

	setReady(t, c, "engine-a", false)
	testwait.Until(t, time.Second, "engine-a leaves routing", func() bool {
		return len(s.Router().Loads()) == 1
	})
	left := slices.Collect(func(yield func(uint64) bool) {
		for _, l := range s.Router().Loads() {
			yield(l.Worker.ID)
		}
	})
	for i := range 10 {
		if got := routedTo(t, s, 100+i); got != left[0] {
			t.Fatalf("request went to engine %d after its pod turned unready; only %d is ready", got, left[0])
		}
	}

	setReady(t, c, "engine-a", true)
	testwait.Until(t, 2*time.Second, "engine-a back in routing", func() bool { return len(s.Router().Loads()) == 2 })
}

// loadedEngine is an engine that reports a fixed load on /metrics, as vLLM
// does, and counts the scrapes.
type loadedEngine struct {
	srv     *httptest.Server
	scrapes atomic.Int64
}

func newLoadedEngine(t *testing.T, waiting int, kvUsage float64) *loadedEngine {
	t.Helper()
	e := &loadedEngine{}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, `{"object": "list", "data": [{"id": "kvrouter-mock", "object": "model"}]}`)
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		e.scrapes.Add(1)
		fmt.Fprintf(w, "vllm:num_requests_waiting{engine=\"0\"} %d\nvllm:num_requests_running{engine=\"0\"} 1\nvllm:kv_cache_usage_perc{engine=\"0\"} %g\n", waiting, kvUsage)
	})
	e.srv = httptest.NewServer(mux)
	t.Cleanup(e.srv.Close)
	return e
}

// TestServePollsDiscoveredEnginesMetrics: engines found through
// --discovery kubernetes have their /metrics read as configured engines
// do, so that the modes scoring by engine-reported load see them: the idle
// pod gets every request, the loaded one none.
func TestServePollsDiscoveredEnginesMetrics(t *testing.T) {
	env := kubetest.Start(t)
	c := kubernetes.NewForConfigOrDie(env.Config)
	busy, idle := newLoadedEngine(t, 40, 0.9), newLoadedEngine(t, 0, 0.05)
	for name, e := range map[string]*loadedEngine{"busy": busy, "idle": idle} {
		u, err := url.Parse(e.srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		createPod(t, c, name, map[string]string{kubediscovery.AnnotationPort: u.Port(), kubediscovery.AnnotationEventsPort: "none", kubediscovery.AnnotationModel: "kvrouter-mock"})
	}
	rcfg := router.DefaultConfig()
	rcfg.Mode = sched.ModeGIEApproxPrefix
	s := serveKube(t, env, serve.Config{Router: rcfg, EngineMetricsInterval: 10 * time.Millisecond}, 2)
	ctx := context.Background()
	testwait.Until(t, time.Second, "both discovered engines' /metrics scraped", func() bool {
		return busy.scrapes.Load() > 0 && idle.scrapes.Load() > 0
	})
	idlePod, err := c.CoreV1().Pods("default").Get(ctx, "idle", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	idleID := kubediscovery.WorkerID(idlePod)
	for i := range 20 {
		tokens := make([]uint32, 64)
		for j := range tokens {
			tokens[j] = uint32(300 + j*7 + i*1000)
		}
		d, err := s.Router().BestWorker(ctx, &router.Request{Tokens: tokens, Model: "kvrouter-mock"})
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker.ID != idleID {
			t.Fatalf("prompt %d went to engine %d, want the idle pod's %d: the busy pod's reported load was not seen", i, d.Worker.ID, idleID)
		}
	}
}
