package certs

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"os"
)

// ServerFiles names what a TLS listener serves and checks clients with,
// and the flags that gave the files, so that an error tells the operator
// which flag to fix.
type ServerFiles struct {
	// Listener names the listener in the log lines of its reloaders.
	Listener string
	// CertFile and KeyFile are the served pair; CAFile, when not empty,
	// is the bundle client certificates must chain to.
	CertFile, KeyFile, CAFile string
	// PairFlags and CAFlag name the flags of the pair and of the bundle.
	PairFlags, CAFlag string
}

// ReloadingServerConfig serves f's pair and, with f.CAFile, verifies
// client certificates signed by it. All three files are watched: new
// handshakes use what is on disk now, open tunnels are untouched. The
// reloader is returned so the caller can report the pair's expiry.
func ReloadingServerConfig(f ServerFiles, minTLS uint16, log *slog.Logger) (*tls.Config, *Reloader, error) {
	log = log.With("listener", f.Listener)
	cert, err := NewReloader(f.CertFile, f.KeyFile, log)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", f.PairFlags, err)
	}
	var pool *CAPoolReloader
	if f.CAFile != "" {
		if pool, err = NewCAPoolReloader(f.CAFile, log); err != nil {
			return nil, nil, fmt.Errorf("%s: %w", f.CAFlag, err)
		}
	}
	cfg, err := ServerConfig(cert, pool)
	if err != nil {
		return nil, nil, err
	}
	cfg.MinVersion = minTLS
	return cfg, cert, nil
}

// LoadCAPool reads a PEM bundle once, for a client that trusts it. A file
// without any certificate is refused rather than trusting nothing.
func LoadCAPool(path string) (*x509.CertPool, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data) {
		return nil, fmt.Errorf("%s: no PEM certificate found", path)
	}
	return pool, nil
}

// CipherSuiteIDs reads Go's names of the suites to offer
// (tls.CipherSuites); no names is Go's defaults. A name from
// tls.InsecureCipherSuites, or one Go does not know, is refused, naming
// it, so a typo cannot silently weaken or empty the list. TLS 1.3 names
// are accepted and have no effect, as Go fixes TLS 1.3's suites.
func CipherSuiteIDs(names []string) ([]uint16, error) {
	var ids []uint16
	for _, name := range names {
		id, err := cipherSuite(name)
		if err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	return ids, nil
}

func cipherSuite(name string) (uint16, error) {
	for _, cs := range tls.CipherSuites() {
		if cs.Name == name {
			return cs.ID, nil
		}
	}
	for _, cs := range tls.InsecureCipherSuites() {
		if cs.Name == name {
			return 0, fmt.Errorf("%s is insecure and not offered", name)
		}
	}
	return 0, fmt.Errorf("%s is not a cipher suite Go knows (see crypto/tls CipherSuites)", name)
}
