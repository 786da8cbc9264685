package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/spf13/pflag"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvrouter/kvrouter/adapters/kubediscovery"
	"github.com/kvrouter/kvrouter/internal/serve"
)

// serviceAccountNamespace is where a pod finds its own namespace.
const serviceAccountNamespace = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// kubeFlags are serve's --discovery kubernetes flags.
type kubeFlags struct {
	mode       string
	kubeconfig string
	namespace  string
	selector   string
	pool       string
	port       int
}

func (k *kubeFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&k.mode, "discovery", "", `where engines come from besides --worker: "kubernetes" watches the pods of --kube-namespace matching --kube-selector or --kube-inference-pool (NATS discovery needs no flag: see --nats-url)`)
	fs.StringVar(&k.kubeconfig, "kubeconfig", "", "kubeconfig file for --discovery kubernetes (default: the pod's service account, else $KUBECONFIG)")
	fs.StringVar(&k.namespace, "kube-namespace", "", "namespace of the engines' pods (default: the router pod's own)")
	fs.StringVar(&k.selector, "kube-selector", "", "label selector of the engines' pods, e.g. app=vllm")
	fs.StringVar(&k.pool, "kube-inference-pool", "", "InferencePool whose selector and first target port give the engines' pods (instead of --kube-selector)")
	fs.IntVar(&k.port, "kube-engine-port", 0, "engines' HTTP port when a pod has no kvrouter.io/port annotation (default: the InferencePool's target port, else 8000)")
}

func (k *kubeFlags) describe() string {
	if k.pool != "" {
		return fmt.Sprintf("namespace %s, InferencePool %s", k.namespace, k.pool)
	}
	return fmt.Sprintf("namespace %s, pods %s", k.namespace, k.selector)
}

// discovery is nil without --discovery kubernetes.
func (k *kubeFlags) discovery(log *slog.Logger) (serve.Discovery, error) {
	switch k.mode {
	case "":
		return nil, nil
	case "kubernetes":
	default:
		return nil, fmt.Errorf(`--discovery %q: the one value is "kubernetes" (NATS discovery is on with --nats-url)`, k.mode)
	}
	if k.selector == "" && k.pool == "" {
		return nil, fmt.Errorf("--discovery kubernetes: give --kube-selector (e.g. app=vllm) or --kube-inference-pool NAME")
	}
	cfg, err := k.restConfig()
	if err != nil {
		return nil, fmt.Errorf("--discovery kubernetes: %w", err)
	}
	if k.namespace == "" {
		b, err := os.ReadFile(serviceAccountNamespace)
		if err != nil {
			return nil, fmt.Errorf("--discovery kubernetes: give --kube-namespace (not running in a pod: %v)", err)
		}
		k.namespace = strings.TrimSpace(string(b))
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &kubeDiscovery{cfg: kubediscovery.Config{Client: client, Dynamic: dyn, Namespace: k.namespace, Selector: k.selector, InferencePool: k.pool, Port: k.port, Logger: log}}, nil
}

func (k *kubeFlags) restConfig() (*rest.Config, error) {
	if k.kubeconfig == "" {
		if cfg, err := rest.InClusterConfig(); err == nil {
			return cfg, nil
		}
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = k.kubeconfig
	return clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, nil).ClientConfig()
}

// kubeDiscovery is kubediscovery as serve's Discovery.
type kubeDiscovery struct {
	cfg kubediscovery.Config
	w   *kubediscovery.Watcher
}

func (d *kubeDiscovery) Start(ctx context.Context, h serve.DiscoveryHandler) error {
	w, err := kubediscovery.Start(ctx, d.cfg, kubediscovery.Handler{
		Ready: func(e kubediscovery.Engine) { h.Join(specOf(e)) },
		Gone:  h.Leave,
	})
	d.w = w
	return err
}

func (d *kubeDiscovery) Close() {
	if d.w != nil {
		d.w.Close()
	}
}

func specOf(e kubediscovery.Engine) serve.WorkerSpec {
	return serve.WorkerSpec{ID: e.ID, Name: e.Name, URL: e.URL, Events: e.Events, Replay: e.Replay, Model: e.Model, DPSize: e.DPSize, Role: e.Role, KVBlocks: e.KVBlocks}
}
