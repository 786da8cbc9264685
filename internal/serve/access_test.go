package serve

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
)

// selfSigned writes a certificate for 127.0.0.1 and its key, PEM, and
// returns their paths and the pool that trusts it.
func selfSigned(t *testing.T) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvrouter-test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:    x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool = x509.NewCertPool()
	pool.AddCert(cert)
	return certFile, keyFile, pool
}

func TestTLSListenerWithAPIKey(t *testing.T) {
	certFile, keyFile, pool := selfSigned(t)
	s, err := Start(context.Background(), Config{
		Router: router.DefaultConfig(), Workers: []WorkerSpec{spec(1, engineFleet(t))}, Addr: "127.0.0.1:0", HealthInterval: 50 * time.Millisecond,
		Access: Access{APIKey: "k", TLSCertFile: certFile, TLSKeyFile: keyFile},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !strings.HasPrefix(s.URL(), "https://") {
		t.Fatalf("URL %s", s.URL())
	}
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, ForceAttemptHTTP2: true}}
	get := func(key string) int {
		req, _ := http.NewRequest(http.MethodGet, s.URL()+"/v1/models", nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.ProtoMajor != 2 {
			t.Errorf("served over %s, want HTTP/2", resp.Proto)
		}
		return resp.StatusCode
	}
	if got := get(""); got != http.StatusUnauthorized {
		t.Fatalf("without the key over TLS: %d", got)
	}
	if got := get("k"); got != http.StatusOK {
		t.Fatalf("with the key over TLS: %d", got)
	}
	resp, err := http.Get("http://" + s.Addr() + "/live")
	if err == nil {
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Fatal("plain HTTP served on the TLS listener")
		}
	}
}

func TestTLSNeedsCertAndKey(t *testing.T) {
	certFile, _, _ := selfSigned(t)
	for _, a := range []Access{{TLSCertFile: certFile}, {TLSCertFile: certFile, TLSKeyFile: certFile}} {
		if _, err := Start(context.Background(), Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{{URL: "http://127.0.0.1:1"}}, Addr: "127.0.0.1:0", Access: a}); err == nil {
			t.Fatalf("started with %+v", a)
		}
	}
}

func TestRuntimeMetrics(t *testing.T) {
	s := startServer(t, spec(1, engineFleet(t)))
	resp, err := http.Get(s.URL() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, m := range []string{"go_goroutines ", "go_memstats_heap_alloc_bytes ", "process_resident_memory_bytes "} {
		if !strings.Contains(string(body), "\n"+m) {
			t.Errorf("/metrics without %s", m)
		}
	}
}

func TestWarnsWhenOpenBeyondLoopback(t *testing.T) {
	for _, tc := range []struct {
		ip     net.IP
		access Access
		want   []string
	}{
		{net.IPv4zero, Access{}, []string{"--api-key", "--admin-token"}},
		{net.IPv4zero, Access{APIKey: "k"}, []string{"--admin-token"}},
		{net.IPv4zero, Access{APIKey: "k", AdminToken: "a"}, nil},
		{net.IPv4(127, 0, 0, 1), Access{}, nil},
		{net.IPv6loopback, Access{}, nil},
	} {
		var buf strings.Builder
		tc.access.warnIfOpen(slog.New(slog.NewTextHandler(&buf, nil)), &net.TCPAddr{IP: tc.ip, Port: 8000})
		if got := strings.Count(buf.String(), "level=WARN"); got != len(tc.want) {
			t.Errorf("%v %+v: %d warnings:\n%s", tc.ip, tc.access, got, buf.String())
		}
		for _, w := range tc.want {
			if !strings.Contains(buf.String(), w) {
				t.Errorf("%v %+v: no word of %s:\n%s", tc.ip, tc.access, w, buf.String())
			}
		}
	}
}
