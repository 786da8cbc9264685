// Package kubediscovery finds engines from the Kubernetes API server: it
// watches, with a client-go informer, the pods of one namespace that match
// a label selector (given, or an InferencePool's), and reports a pod as an
// engine while it is ready, with its addresses taken from its IP, its
// annotations and vLLM's default ports.
package kubediscovery

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/zeebo/xxh3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// The annotations an engine's pod may carry; without them the convention
// is vLLM's defaults (HTTP 8000, KV events on tcp 5557, no replay).
const (
	AnnotationPort       = "kvrouter.io/port"           // HTTP port of the OpenAI server
	AnnotationEventsPort = "kvrouter.io/kv-events-port" // ZMQ PUB port of dp rank 0; "none" for an engine without KV events
	AnnotationReplayPort = "kvrouter.io/kv-replay-port" // ZMQ ROUTER replay port of dp rank 0
	AnnotationModel      = "kvrouter.io/model"          // served model name
	AnnotationDPSize     = "kvrouter.io/data-parallel-size"
	AnnotationRole       = "kvrouter.io/role" // prefill, decode or both
	AnnotationBlocks     = "kvrouter.io/kv-blocks"
)

// Defaults of the port convention: vLLM's OpenAI server and the endpoint
// of its --kv-events-config examples.
const (
	DefaultPort       = 8000
	DefaultEventsPort = 5557
)

// InferencePoolGVR is the Gateway API Inference Extension's InferencePool.
var InferencePoolGVR = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}

// Engine is a ready pod as the router sees it.
type Engine struct {
	ID        uint64 // stable for the pod's life and restarts: from its UID
	Name      string // the pod's name
	URL       string
	Events    string
	Replay    string
	Model     string
	DPSize    int
	Role      string
	KVBlocks  int
	Restarts  int32 // the sum of its containers' restart counts
	Namespace string
}

// Handler receives the engines as they come and go, one call at a time,
// in order.
type Handler struct {
	Ready func(Engine)
	Gone  func(id uint64, why string)
}

// Config says which pods are engines.
type Config struct {
	Client    kubernetes.Interface
	Dynamic   dynamic.Interface // for InferencePool only
	Namespace string
	// Selector is a label selector ("app=vllm"); InferencePool, instead,
	// names the pool whose spec.selector and spec.targetPorts apply.
	Selector      string
	InferencePool string
	// Port is the HTTP port when a pod has no kvrouter.io/port annotation:
	// the pool's first target port, else DefaultPort.
	Port   int
	Logger *slog.Logger
	// Resync is the informer's resync period (0: none).
	Resync time.Duration
}

// Watcher runs until Close.
type Watcher struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// Close stops watching; no handler runs after it returns.
func (w *Watcher) Close() {
	w.cancel()
	<-w.done
}

// Start lists the matching pods, reports the ready ones, and keeps
// watching. It returns once the first list has been reported. With an
// InferencePool the pool is watched too: when its selector or target port
// changes, the pods are watched anew and the engines follow (those no
// longer selected leave, the others are reported at their new port); when
// it is deleted every engine leaves until it is created again.
func Start(ctx context.Context, cfg Config, h Handler) (*Watcher, error) {
	if cfg.Client == nil {
		return nil, errors.New("kubediscovery: no client")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Namespace == "" {
		return nil, errors.New("kubediscovery: no namespace")
	}
	t := &tracker{cfg: cfg, h: h, known: map[string]Engine{}, port: cmp.Or(cfg.Port, DefaultPort)}
	ctx, cancel := context.WithCancel(ctx)
	w := &Watcher{cancel: cancel, done: make(chan struct{})}
	if cfg.InferencePool == "" {
		if cfg.Selector == "" {
			cancel()
			return nil, errors.New("kubediscovery: no label selector: give one (e.g. app=vllm) or an InferencePool")
		}
		pods, err := t.watchPods(ctx, cfg.Selector)
		if err != nil {
			cancel()
			return nil, err
		}
		go func() {
			<-ctx.Done()
			pods.stop()
			close(w.done)
		}()
		return w, nil
	}
	if cfg.Selector != "" {
		cancel()
		return nil, errors.New("kubediscovery: give a label selector or an InferencePool, not both")
	}
	if cfg.Dynamic == nil {
		cancel()
		return nil, errors.New("kubediscovery: no dynamic client for the InferencePool")
	}
	u, err := cfg.Dynamic.Resource(InferencePoolGVR).Namespace(cfg.Namespace).Get(ctx, cfg.InferencePool, metav1.GetOptions{})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("kubediscovery: InferencePool %s/%s: %w", cfg.Namespace, cfg.InferencePool, err)
	}
	p := &poolWatch{t: t, ctx: ctx}
	if err := p.apply(u); err != nil {
		cancel()
		return nil, err
	}
	inf := dynamicinformer.NewFilteredDynamicInformer(cfg.Dynamic, InferencePoolGVR, cfg.Namespace, cfg.Resync, cache.Indexers{},
		func(o *metav1.ListOptions) { o.FieldSelector = "metadata.name=" + cfg.InferencePool }).Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    p.changed,
		UpdateFunc: func(_, o any) { p.changed(o) },
		DeleteFunc: func(any) { p.deleted() },
	}); err != nil {
		cancel()
		p.stop()
		return nil, err
	}
	go func() {
		defer close(w.done)
		inf.Run(ctx.Done())
		p.stop()
	}()
	return w, nil
}

// poolWatch follows an InferencePool: the pods it selects are watched
// with its selector, at its target port.
type poolWatch struct {
	t   *tracker
	ctx context.Context
	// mu orders the pool's events with Close; pods is nil while the pool
	// is deleted.
	mu       sync.Mutex
	pods     *podWatch
	selector string
	port     int
}

func (p *poolWatch) changed(o any) {
	u, ok := o.(*unstructured.Unstructured)
	if !ok {
		return
	}
	if err := p.apply(u); err != nil {
		p.t.cfg.Logger.Warn("InferencePool change ignored: its engines stay as they were", "err", err)
	}
}

// apply watches the pods the pool selects now, unless it selects what it
// did.
func (p *poolWatch) apply(u *unstructured.Unstructured) error {
	selector, port, err := poolSelector(u)
	if err != nil {
		return err
	}
	if p.t.cfg.Port != 0 {
		port = p.t.cfg.Port // given by the operator: it overrides the pool's
	}
	port = cmp.Or(port, DefaultPort)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ctx.Err() != nil || (p.pods != nil && selector == p.selector && port == p.port) {
		return nil
	}
	p.stopPodsLocked()
	p.t.setPort(port)
	pods, err := p.t.watchPods(p.ctx, selector)
	if err != nil {
		p.t.dropAll("InferencePool " + p.t.cfg.InferencePool + " unreadable")
		return err
	}
	// Pods the new selector leaves out are gone; those it keeps are
	// reported again where their address changed (the informer's adds).
	p.t.keepOnly(pods.inf.GetStore(), "pod outside InferencePool "+p.t.cfg.InferencePool+"'s selector")
	p.pods, p.selector, p.port = pods, selector, port
	p.t.cfg.Logger.Info("InferencePool selects engines", "pool", p.t.cfg.InferencePool, "selector", selector, "port", port)
	return nil
}

func (p *poolWatch) deleted() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stopPodsLocked()
	p.t.dropAll("InferencePool " + p.t.cfg.InferencePool + " deleted")
	p.t.cfg.Logger.Warn("InferencePool deleted: no engines until it is created again", "pool", p.t.cfg.InferencePool)
}

func (p *poolWatch) stop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stopPodsLocked()
}

func (p *poolWatch) stopPodsLocked() {
	if p.pods != nil {
		p.pods.stop()
		p.pods = nil
	}
}

// podWatch is one informer on the pods of a selector.
type podWatch struct {
	inf    cache.SharedIndexInformer
	cancel context.CancelFunc
	done   chan struct{}
}

// stop ends the informer; no handler of it runs after it returns.
func (pw *podWatch) stop() {
	pw.cancel()
	<-pw.done
}

// watchPods starts an informer on the pods that match selector, feeding
// t, and returns once its first list has been reported.
func (t *tracker) watchPods(ctx context.Context, selector string) (*podWatch, error) {
	if _, err := labels.Parse(selector); err != nil {
		return nil, fmt.Errorf("kubediscovery: label selector %q: %w", selector, err)
	}
	factory := informers.NewSharedInformerFactoryWithOptions(t.cfg.Client, t.cfg.Resync,
		informers.WithNamespace(t.cfg.Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = selector }))
	inf := factory.Core().V1().Pods().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { t.update(o) },
		UpdateFunc: func(_, o any) { t.update(o) },
		DeleteFunc: t.delete,
	}); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	pw := &podWatch{inf: inf, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(pw.done)
		inf.Run(ctx.Done())
	}()
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		pw.stop()
		return nil, fmt.Errorf("kubediscovery: listing pods in %s: %w", t.cfg.Namespace, context.Cause(ctx))
	}
	t.cfg.Logger.Info("watching pods for engines", "namespace", t.cfg.Namespace, "selector", selector)
	return pw, nil
}

// poolSelector reads an InferencePool's pod selector and first target port
// (0 when it has none).
func poolSelector(u *unstructured.Unstructured) (string, int, error) {
	spec, _ := u.Object["spec"].(map[string]any)
	sel, _ := spec["selector"].(map[string]any)
	match, _ := sel["matchLabels"].(map[string]any)
	if len(match) == 0 {
		return "", 0, fmt.Errorf("kubediscovery: InferencePool %s/%s has no spec.selector.matchLabels", u.GetNamespace(), u.GetName())
	}
	set := labels.Set{}
	for k, v := range match {
		s, ok := v.(string)
		if !ok {
			return "", 0, fmt.Errorf("kubediscovery: InferencePool %s/%s: label %s is not a string", u.GetNamespace(), u.GetName(), k)
		}
		set[k] = s
	}
	port := 0
	if tps, _ := spec["targetPorts"].([]any); len(tps) > 0 {
		if tp, ok := tps[0].(map[string]any); ok {
			switch n := tp["number"].(type) {
			case int64:
				port = int(n)
			case float64:
				port = int(n)
			}
		}
	}
	return set.AsSelector().String(), port, nil
}

type tracker struct {
	cfg Config
	h   Handler
	// mu orders the handler's calls: one informer calls one handler at a
	// time, but an InferencePool's change replaces the informer.
	mu    sync.Mutex
	known map[string]Engine
	port  int // HTTP port of pods without the annotation
}

func (t *tracker) setPort(port int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.port = port
}

// keepOnly reports gone the engines whose pods are not in store.
func (t *tracker) keepOnly(store cache.Store, why string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for key, e := range t.known {
		if _, ok, _ := store.GetByKey(key); !ok {
			delete(t.known, key)
			t.h.Gone(e.ID, why)
		}
	}
}

func (t *tracker) dropAll(why string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for key, e := range t.known {
		delete(t.known, key)
		t.h.Gone(e.ID, why)
	}
}

func (t *tracker) update(o any) {
	pod, ok := o.(*corev1.Pod)
	if !ok {
		return
	}
	key := pod.Namespace + "/" + pod.Name
	t.mu.Lock()
	defer t.mu.Unlock()
	old, had := t.known[key]
	why := notReady(pod)
	if why != "" {
		if had {
			delete(t.known, key)
			t.h.Gone(old.ID, why)
		}
		return
	}
	e, err := engineOf(pod, t.port)
	if err != nil {
		if had {
			delete(t.known, key)
			t.h.Gone(old.ID, err.Error())
		}
		t.cfg.Logger.Warn("pod skipped", "pod", key, "err", err)
		return
	}
	if had && old == e {
		return
	}
	if had {
		// A restart or a new address: its cache is gone, its events
		// start over.
		why := "pod changed"
		if e.Restarts != old.Restarts {
			why = "pod restarted"
		}
		delete(t.known, key)
		t.h.Gone(old.ID, why)
	}
	t.known[key] = e
	t.h.Ready(e)
}

func (t *tracker) delete(o any) {
	if d, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o = d.Obj
	}
	pod, ok := o.(*corev1.Pod)
	if !ok {
		return
	}
	key := pod.Namespace + "/" + pod.Name
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, had := t.known[key]; had {
		delete(t.known, key)
		t.h.Gone(e.ID, "pod deleted")
	}
}

// notReady says why a pod may not be routed to, "" when it may.
func notReady(pod *corev1.Pod) string {
	switch {
	case pod.DeletionTimestamp != nil:
		return "pod terminating"
	case pod.Status.Phase != corev1.PodRunning:
		return "pod " + strings.ToLower(string(pod.Status.Phase))
	case pod.Status.PodIP == "":
		return "pod has no IP"
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			if c.Status == corev1.ConditionTrue {
				return ""
			}
			return "pod not ready"
		}
	}
	return "pod not ready"
}

// engineOf reads a ready pod's engine from its IP and annotations.
func engineOf(pod *corev1.Pod, defaultPort int) (Engine, error) {
	a := pod.Annotations
	port, err := portOf(a, AnnotationPort, defaultPort)
	if err != nil {
		return Engine{}, err
	}
	e := Engine{
		ID: WorkerID(pod), Name: pod.Name, Namespace: pod.Namespace, Model: a[AnnotationModel], Role: a[AnnotationRole], DPSize: 1,
		URL: "http://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(port)),
	}
	if a[AnnotationEventsPort] != "none" {
		ev, err := portOf(a, AnnotationEventsPort, DefaultEventsPort)
		if err != nil {
			return Engine{}, err
		}
		e.Events = "tcp://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(ev))
	}
	if _, ok := a[AnnotationReplayPort]; ok {
		rp, err := portOf(a, AnnotationReplayPort, 0)
		if err != nil {
			return Engine{}, err
		}
		e.Replay = "tcp://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(rp))
	}
	for _, n := range []struct {
		key string
		to  *int
	}{{AnnotationDPSize, &e.DPSize}, {AnnotationBlocks, &e.KVBlocks}} {
		if v, ok := a[n.key]; ok {
			i, err := strconv.Atoi(v)
			if err != nil || i < 1 {
				return Engine{}, fmt.Errorf("annotation %s=%q: want a positive integer", n.key, v)
			}
			*n.to = i
		}
	}
	for _, c := range pod.Status.ContainerStatuses {
		e.Restarts += c.RestartCount
	}
	return e, nil
}

func portOf(a map[string]string, key string, def int) (int, error) {
	v, ok := a[key]
	if !ok {
		return def, nil
	}
	p, err := strconv.Atoi(v)
	if err != nil || p < 1 || p > 65535 {
		return 0, fmt.Errorf("annotation %s=%q: want a port number (1-65535)", key, v)
	}
	return p, nil
}

// WorkerID is the worker id of a pod's engine: stable for the pod's life
// (from its UID), below 2^53 so that JSON readers keep it exact.
func WorkerID(pod *corev1.Pod) uint64 {
	return xxh3.HashString(string(pod.UID)) & (1<<53 - 1)
}
