package natsplane

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// startSecured runs a NATS server with JetStream and the given security
// settings on a free port of 127.0.0.1.
func startSecured(t *testing.T, secure func(*server.Options)) *server.Server {
	t.Helper()
	opts := &server.Options{
		Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true, StoreDir: t.TempDir(),
		NoLog: true, NoSigs: true,
	}
	secure(opts)
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("NATS server did not start")
	}
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	return srv
}

// connectWith dials url presenting auth; the caller closes the connection.
func connectWith(url string, auth Auth) (*nats.Conn, error) {
	opts, err := auth.Options()
	if err != nil {
		return nil, err
	}
	return Connect(url, "auth-test", nil, opts...)
}

// registers proves that a client can use the plane: its registration
// reaches a watcher on the same server.
func registers(t *testing.T, nc *nats.Conn) {
	t.Helper()
	added := make(chan Instance, 1)
	w, err := Watch(context.Background(), nc, Names{Namespace: "secured"}, time.Minute, WatchHandler{
		Added: func(in Instance) { added <- in }, Removed: func(uint64, string) {},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	inst := Instance{WorkerID: 3, Name: "e3", URL: "http://127.0.0.1:1", DPSize: 1, BlockSize: 16}
	reg, err := Register(context.Background(), nc, Names{Namespace: "secured"}, inst, time.Minute, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Close()
	select {
	case in := <-added:
		if in != inst {
			t.Fatalf("watched %+v, registered %+v", in, inst)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the registration never reached the watcher")
	}
}

func writeFile(t *testing.T, name string, data []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestAuthMethodsConnectAndRegister(t *testing.T) {
	user, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	userSeed, _ := user.Seed()
	userPub, _ := user.PublicKey()
	stranger, _ := nkeys.CreateUser()
	strangerSeed, _ := stranger.Seed()

	byToken := func(o *server.Options) { o.Authorization = "s3cret-token" }
	byPassword := func(o *server.Options) { o.Username, o.Password = "router", "pa ss/word" }
	byNkey := func(o *server.Options) { o.Nkeys = []*server.NkeyUser{{Nkey: userPub}} }
	for _, tc := range []struct {
		name   string
		secure func(*server.Options)
		good   Auth
		inURL  string // credentials in the URL instead
		bad    []Auth
	}{
		{name: "token", secure: byToken, good: Auth{Token: "s3cret-token"},
			bad: []Auth{{}, {Token: "guess"}}},
		{name: "token as a user without password", secure: byToken, good: Auth{User: "s3cret-token"}},
		{name: "token in the URL", secure: byToken, inURL: "s3cret-token"},
		{name: "user and password", secure: byPassword, good: Auth{User: "router", Password: "pa ss/word"},
			bad: []Auth{{}, {User: "router", Password: "guess"}, {Token: "pa ss/word"}}},
		{name: "user and password in the URL", secure: byPassword, inURL: "router:pa%20ss%2Fword"},
		{name: "nkey seed file", secure: byNkey, good: Auth{NkeySeedFile: writeFile(t, "user.nk", userSeed)},
			bad: []Auth{{}, {NkeySeedFile: writeFile(t, "stranger.nk", strangerSeed)}}},
		{name: "nkey seed", secure: byNkey, good: Auth{NkeySeed: string(userSeed)},
			bad: []Auth{{NkeySeed: string(strangerSeed)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := startSecured(t, tc.secure)
			for _, bad := range tc.bad {
				if nc, err := connectWith(srv.ClientURL(), bad); !errors.Is(err, nats.ErrAuthorization) {
					if nc != nil {
						nc.Close()
					}
					t.Fatalf("%+v: want an authorization error, got %v", bad, err)
				}
			}
			url := srv.ClientURL()
			if tc.inURL != "" {
				url = strings.Replace(url, "nats://", "nats://"+tc.inURL+"@", 1)
			}
			nc, err := connectWith(url, tc.good)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			registers(t, nc)
		})
	}
}

func TestAuthCredsFile(t *testing.T) {
	operator, _ := nkeys.CreateOperator()
	operatorPub, _ := operator.PublicKey()
	account, _ := nkeys.CreateAccount()
	accountPub, _ := account.PublicKey()
	system, _ := nkeys.CreateAccount()
	systemPub, _ := system.PublicKey()
	user, _ := nkeys.CreateUser()
	userPub, _ := user.PublicKey()
	userSeed, _ := user.Seed()

	oc := jwt.NewOperatorClaims(operatorPub)
	oc.SystemAccount = systemPub // JetStream needs one
	operatorJWT, err := oc.Encode(operator)
	if err != nil {
		t.Fatal(err)
	}
	if oc, err = jwt.DecodeOperatorClaims(operatorJWT); err != nil {
		t.Fatal(err)
	}
	ac := jwt.NewAccountClaims(accountPub)
	ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
	accountJWT, err := ac.Encode(operator)
	if err != nil {
		t.Fatal(err)
	}
	uc := jwt.NewUserClaims(userPub)
	uc.IssuerAccount = accountPub
	userJWT, err := uc.Encode(account)
	if err != nil {
		t.Fatal(err)
	}
	creds, err := jwt.FormatUserConfig(userJWT, userSeed)
	if err != nil {
		t.Fatal(err)
	}
	systemJWT, err := jwt.NewAccountClaims(systemPub).Encode(operator)
	if err != nil {
		t.Fatal(err)
	}
	resolver := &server.MemAccResolver{}
	if err := errors.Join(resolver.Store(accountPub, accountJWT), resolver.Store(systemPub, systemJWT)); err != nil {
		t.Fatal(err)
	}
	srv := startSecured(t, func(o *server.Options) {
		o.TrustedOperators, o.AccountResolver, o.SystemAccount = []*jwt.OperatorClaims{oc}, resolver, systemPub
	})
	if nc, err := connectWith(srv.ClientURL(), Auth{}); err == nil {
		nc.Close()
		t.Fatal("connected without credentials")
	}
	nc, err := connectWith(srv.ClientURL(), Auth{CredsFile: writeFile(t, "user.creds", creds)})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	registers(t, nc)
}

// testPKI writes a CA, a server certificate for 127.0.0.1 and a client
// certificate, all made up for the test, into a temporary directory.
type testPKI struct{ dir, ca, serverCert, serverKey, clientCert, clientKey string }

func newTestPKI(t *testing.T) testPKI {
	t.Helper()
	dir := t.TempDir()
	p := testPKI{dir: dir}
	write := func(name, typ string, der []byte) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvrouter test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	p.ca = write("ca.pem", "CERTIFICATE", caDER)
	leaf := func(serial int64, name string, usage x509.ExtKeyUsage) (string, string) {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
			IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		keyDER, err := x509.MarshalECPrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		return write(name+".pem", "CERTIFICATE", der), write(name+"-key.pem", "EC PRIVATE KEY", keyDER)
	}
	p.serverCert, p.serverKey = leaf(2, "server", x509.ExtKeyUsageServerAuth)
	p.clientCert, p.clientKey = leaf(3, "client", x509.ExtKeyUsageClientAuth)
	return p
}

func TestAuthTLS(t *testing.T) {
	pki := newTestPKI(t)
	for _, verifyClients := range []bool{false, true} {
		name := "server certificate"
		if verifyClients {
			name = "mutual TLS"
		}
		t.Run(name, func(t *testing.T) {
			srv := startSecured(t, func(o *server.Options) {
				tc, err := server.GenTLSConfig(&server.TLSConfigOpts{
					CertFile: pki.serverCert, KeyFile: pki.serverKey, CaFile: pki.ca, Verify: verifyClients,
				})
				if err != nil {
					t.Fatal(err)
				}
				o.TLSConfig, o.TLSVerify, o.TLSTimeout = tc, verifyClients, 5
			})
			// Without the CA the server's certificate is not trusted.
			if nc, err := connectWith(srv.ClientURL(), Auth{}); err == nil {
				nc.Close()
				t.Fatal("connected without TLS settings")
			}
			good := Auth{TLSCA: pki.ca}
			if verifyClients {
				if nc, err := connectWith(srv.ClientURL(), good); err == nil {
					nc.Close()
					t.Fatal("connected without a client certificate")
				}
				good.TLSCert, good.TLSKey = pki.clientCert, pki.clientKey
			}
			nc, err := connectWith(srv.ClientURL(), good)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			if !nc.TLSRequired() {
				t.Fatal("connection is not TLS")
			}
			registers(t, nc)
		})
	}
}

func TestAuthRefusesContradictions(t *testing.T) {
	for _, a := range []Auth{
		{Token: "t", User: "u", Password: "p"},
		{Token: "t", User: "u"},
		{Password: "p"},
		{TLSCert: "c.pem"},
		{TLSKey: "k.pem"},
		{NkeySeedFile: "f", NkeySeed: "SU..."},
		{NkeySeed: "not a seed"},
	} {
		if _, err := a.Options(); err == nil {
			t.Errorf("%+v: want an error", a)
		}
	}
}

// Listening beyond loopback, the embedded server makes up a token and
// requires it: a client without it can neither connect nor register.
func TestEmbeddedBeyondLoopbackRequiresAToken(t *testing.T) {
	srv, err := StartEmbedded(EmbeddedConfig{Host: "0.0.0.0", StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	auth := srv.ClientAuth()
	if !srv.TokenGenerated() || len(auth.Token) < 20 {
		t.Fatalf("want a generated token, got %+v", auth)
	}
	url := strings.Replace(srv.URL(), "0.0.0.0", "127.0.0.1", 1)
	for _, bad := range []Auth{{}, {Token: "guess"}} {
		if nc, err := connectWith(url, bad); !errors.Is(err, nats.ErrAuthorization) {
			if nc != nil {
				nc.Close()
			}
			t.Fatalf("%+v: want an authorization error, got %v", bad, err)
		}
	}
	nc, err := connectWith(url, auth)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	registers(t, nc)

	// On loopback it stays open, and configured credentials replace the
	// generated token.
	open, err := StartEmbedded(EmbeddedConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer open.Shutdown()
	if open.TokenGenerated() || open.ClientAuth() != (Auth{}) {
		t.Fatalf("loopback server requires %+v", open.ClientAuth())
	}
	own, err := StartEmbedded(EmbeddedConfig{Host: "0.0.0.0", StoreDir: t.TempDir(), User: "router", Password: "pw"})
	if err != nil {
		t.Fatal(err)
	}
	defer own.Shutdown()
	if own.TokenGenerated() || own.ClientAuth() != (Auth{User: "router", Password: "pw"}) {
		t.Fatalf("configured server requires %+v", own.ClientAuth())
	}
}
