// Package kubetest runs a real kube-apiserver and etcd for tests, as
// controller-runtime's envtest does, without a kubelet or controllers: a
// test creates pods and sets their status itself. The binaries are built
// from the module in tools/ (k8s.io/kubernetes and go.etcd.io/etcd through
// the Go module proxy) on first use and cached under
// $KVROUTER_KUBETEST_CACHE, else the user cache directory, by version.
package kubetest

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"k8s.io/client-go/rest"
)

// Version keys the cache: the k8s.io/kubernetes release in tools/go.mod.
const Version = "v1.37.2"

const token = "kvrouter-kubetest-token"

// Env is a running control plane.
type Env struct {
	Config     *rest.Config
	Kubeconfig string // a kubeconfig file for it
	URL        string
}

var buildOnce sync.Once
var buildErr error
var binDir string

// Binaries builds (once per process, then from the cache) kube-apiserver
// and etcd, and returns their directory.
func Binaries() (string, error) {
	buildOnce.Do(func() {
		cache := os.Getenv("KVROUTER_KUBETEST_CACHE")
		if cache == "" {
			d, err := os.UserCacheDir()
			if err != nil {
				buildErr = err
				return
			}
			cache = filepath.Join(d, "kvrouter-kubetest")
		}
		binDir = filepath.Join(cache, Version)
		_, self, _, _ := runtime.Caller(0)
		tools := filepath.Join(filepath.Dir(self), "tools")
		for bin, pkg := range map[string]string{"etcd": "go.etcd.io/etcd/server/v3", "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver"} {
			out := filepath.Join(binDir, bin)
			if _, err := os.Stat(out); err == nil {
				continue
			}
			// Built to a temporary name: a build cut short leaves no
			// binary behind that looks whole.
			cmd := exec.Command("go", "build", "-o", out+".tmp", pkg)
			cmd.Dir = tools
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-mod=mod")
			if b, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("kubetest: building %s: %v\n%s", bin, err, b)
				return
			}
			if err := os.Rename(out+".tmp", out); err != nil {
				buildErr = err
				return
			}
		}
	})
	return binDir, buildErr
}

// Start runs etcd and kube-apiserver for the test and stops them at its
// end. Without the binaries (their build failed) the test is skipped,
// unless CI is set, when it fails.
func Start(t testing.TB) *Env {
	t.Helper()
	dir, err := Binaries()
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal(err)
		}
		t.Skipf("no kube-apiserver and etcd: %v", err)
	}
	work := t.TempDir()
	etcdClient, etcdPeer, apiPort := freePort(t), freePort(t), freePort(t)
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(etcdClient)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(etcdPeer)
	run(t, filepath.Join(dir, "etcd"), "--name=kubetest", "--data-dir="+filepath.Join(work, "etcd"),
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=kubetest="+peerURL, "--unsafe-no-fsync", "--log-level=error")
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	saKey := filepath.Join(work, "sa.key")
	write(t, saKey, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}))
	tokens := filepath.Join(work, "tokens.csv")
	write(t, tokens, []byte(token+",kubetest-admin,kubetest-admin,system:masters\n"))
	run(t, filepath.Join(dir, "kube-apiserver"),
		"--etcd-servers="+etcdURL, "--cert-dir="+filepath.Join(work, "certs"),
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port="+strconv.Itoa(apiPort),
		"--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true",
		// No kubernetes Service endpoints: 127.0.0.1 may not be one.
		"--endpoint-reconciler-type=none",
		"--authorization-mode=RBAC", "--token-auth-file="+tokens,
		"--service-account-key-file="+saKey, "--service-account-signing-key-file="+saKey,
		"--service-account-issuer=https://kubernetes.default.svc",
		// No controller creates service accounts: pods need none.
		"--disable-admission-plugins=ServiceAccount", "--enable-priority-and-fairness=false")
	env := &Env{URL: "https://127.0.0.1:" + strconv.Itoa(apiPort)}
	env.Config = &rest.Config{Host: env.URL, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{Insecure: true}, QPS: 1000, Burst: 1000}
	env.Kubeconfig = filepath.Join(work, "kubeconfig")
	write(t, env.Kubeconfig, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: kubetest, cluster: {server: %q, insecure-skip-tls-verify: true}}]
users: [{name: admin, user: {token: %q}}]
contexts: [{name: kubetest, context: {cluster: kubetest, user: admin, namespace: default}}]
current-context: kubetest
`, env.URL, token)))
	waitReady(t, env.URL)
	return env
}

func run(t testing.TB, bin string, args ...string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	logf, err := os.Create(filepath.Join(t.TempDir(), filepath.Base(bin)+".log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("%s log (tail):\n%s", filepath.Base(bin), tail(b, 4000))
		}
		logf.Close()
	})
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// waitReady polls /readyz: the API server takes a few seconds to start its
// post-start hooks, more on a loaded machine.
func waitReady(t testing.TB, url string) {
	t.Helper()
	c := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // a local test server's self-signed certificate
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	var last error
	for ctx.Err() == nil {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := c.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			err = errors.New(resp.Status)
		}
		last = err
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
	t.Fatalf("kube-apiserver at %s not ready within 120 s: %v", url, last)
}

func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func write(t testing.TB, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// HelmVersion is the helm the chart tests run, built through the Go
// module proxy.
const HelmVersion = "v3.22.0"

var helmOnce sync.Once
var helmPath string
var helmErr error

// Helm builds (once, then from the cache) helm and returns its path.
func Helm() (string, error) {
	helmOnce.Do(func() {
		cache := os.Getenv("KVROUTER_KUBETEST_CACHE")
		if cache == "" {
			d, err := os.UserCacheDir()
			if err != nil {
				helmErr = err
				return
			}
			cache = filepath.Join(d, "kvrouter-kubetest")
		}
		dir := filepath.Join(cache, "helm-"+HelmVersion)
		helmPath = filepath.Join(dir, "helm")
		if _, err := os.Stat(helmPath); err == nil {
			return
		}
		cmd := exec.Command("go", "install", "helm.sh/helm/v3/cmd/helm@"+HelmVersion)
		cmd.Env = append(os.Environ(), "GOBIN="+dir, "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			helmErr = fmt.Errorf("kubetest: building helm: %v\n%s", err, b)
		}
	})
	return helmPath, helmErr
}
