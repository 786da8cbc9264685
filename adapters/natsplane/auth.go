package natsplane

import (
	"errors"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// Auth is how a kvrouter process proves itself to a NATS server that
// requires it, and how it checks that server. Zero fields are unused; a
// user and password may also travel in the URL (nats://user:pass@host).
type Auth struct {
	Token string
	// User without Password is sent as a token, as the nats CLI reads
	// NATS_USER.
	User, Password string
	// NkeySeedFile holds a user nkey seed (nk -gen user); NkeySeed is the
	// seed itself, for deployments that inject it as a secret.
	NkeySeedFile, NkeySeed string
	// CredsFile is a user JWT with its seed, as nsc writes it.
	CredsFile string
	// TLSCA is the CA bundle the server's certificate must chain to (also
	// what turns TLS on); TLSCert and TLSKey are this client's certificate
	// for servers that verify clients.
	TLSCA, TLSCert, TLSKey string
}

// Options are the nats.go options for a, for Connect. An unreadable file
// is reported here or by Connect, never left to fail later.
func (a Auth) Options() ([]nats.Option, error) {
	token := a.Token
	if a.User != "" && a.Password == "" {
		if token != "" {
			return nil, errors.New("natsplane: a token and a user without password are both tokens; give one")
		}
		token = a.User
	} else if a.User != "" && token != "" {
		return nil, errors.New("natsplane: give a token or a user and password, not both")
	}
	if a.Password != "" && a.User == "" {
		return nil, errors.New("natsplane: a password needs a user")
	}
	if (a.TLSCert == "") != (a.TLSKey == "") {
		return nil, errors.New("natsplane: a TLS client certificate needs its key, and a key its certificate")
	}
	if a.NkeySeedFile != "" && a.NkeySeed != "" {
		return nil, errors.New("natsplane: give an nkey seed or a seed file, not both")
	}
	var opts []nats.Option
	switch {
	case token != "":
		opts = append(opts, nats.Token(token))
	case a.User != "":
		opts = append(opts, nats.UserInfo(a.User, a.Password))
	}
	switch {
	case a.NkeySeedFile != "":
		o, err := nats.NkeyOptionFromSeed(a.NkeySeedFile)
		if err != nil {
			return nil, err
		}
		opts = append(opts, o)
	case a.NkeySeed != "":
		o, err := nkeyFromSeed(a.NkeySeed)
		if err != nil {
			return nil, err
		}
		opts = append(opts, o)
	}
	if a.CredsFile != "" {
		opts = append(opts, nats.UserCredentials(a.CredsFile))
	}
	if a.TLSCA != "" {
		opts = append(opts, nats.RootCAs(a.TLSCA))
	}
	if a.TLSCert != "" {
		opts = append(opts, nats.ClientCert(a.TLSCert, a.TLSKey))
	}
	return opts, nil
}

func nkeyFromSeed(seed string) (nats.Option, error) {
	kp, err := nkeys.FromSeed([]byte(seed))
	if err != nil {
		return nil, errors.New("natsplane: the nkey seed is not a seed")
	}
	pub, err := kp.PublicKey()
	if err != nil {
		return nil, err
	}
	if !nkeys.IsValidPublicUserKey(pub) {
		return nil, errors.New("natsplane: the nkey seed is not a user seed")
	}
	return nats.Nkey(pub, kp.Sign), nil
}
