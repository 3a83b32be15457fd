package benchpki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// PKI holds the file paths of a throwaway CA (with its key, for tests that
// issue more), a server certificate and one agent client certificate,
// minted for one run. Where many agents run,
// they all present that one certificate: the server's cost per agent (a
// full handshake and a chain verification, no session resumption) does
// not depend on which certificate it is, and the agents' IDs are their
// own.
type PKI struct {
	CACert, CAKey, ServerCert, ServerKey, AgentCert, AgentKey string
}

// Spec is what MintSpec mints: the common names of the CA and of the
// agent certificate, the names the server certificate is valid for, and
// how long the certificates last from an hour before minting.
type Spec struct {
	CAName, AgentName string
	DNSNames          []string
	IPs               []net.IP
	Lifetime          time.Duration // 0: 25 h (valid for a day from now)
}

// Mint writes a new PKI into dir with a server certificate for 127.0.0.1;
// name tells the runs' CAs and agent certificates apart ("bench",
// "scale").
func Mint(dir, name string) (*PKI, error) {
	return MintSpec(dir, Spec{CAName: "konnectivity-" + name + "-ca", AgentName: name + "-agent", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
}

// MintSpec writes a new PKI as spec says into dir.
func MintSpec(dir string, spec Spec) (*PKI, error) {
	notBefore := time.Now().Add(-time.Hour)
	lifetime := spec.Lifetime
	if lifetime == 0 {
		lifetime = 25 * time.Hour
	}
	notAfter := notBefore.Add(lifetime)
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate CA key: %w", err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: spec.CAName},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("create CA cert: %w", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, fmt.Errorf("parse CA cert: %w", err)
	}
	p := &PKI{
		CACert:     filepath.Join(dir, "ca.crt"),
		CAKey:      filepath.Join(dir, "ca.key"),
		ServerCert: filepath.Join(dir, "server.crt"),
		ServerKey:  filepath.Join(dir, "server.key"),
		AgentCert:  filepath.Join(dir, "agent.crt"),
		AgentKey:   filepath.Join(dir, "agent.key"),
	}
	if err := writePEM(p.CACert, "CERTIFICATE", caDER); err != nil {
		return nil, err
	}
	caKeyDER, err := x509.MarshalPKCS8PrivateKey(caKey)
	if err != nil {
		return nil, fmt.Errorf("marshal CA key: %w", err)
	}
	if err := writePEM(p.CAKey, "PRIVATE KEY", caKeyDER); err != nil {
		return nil, err
	}
	issue := func(serial int64, cn string, usage x509.ExtKeyUsage, dns []string, ips []net.IP, certPath, keyPath string) error {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return fmt.Errorf("generate %s key: %w", cn, err)
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial),
			Subject:      pkix.Name{CommonName: cn},
			NotBefore:    notBefore,
			NotAfter:     notAfter,
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  []x509.ExtKeyUsage{usage},
			DNSNames:     dns,
			IPAddresses:  ips,
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			return fmt.Errorf("create %s cert: %w", cn, err)
		}
		if err := writePEM(certPath, "CERTIFICATE", der); err != nil {
			return err
		}
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			return fmt.Errorf("marshal %s key: %w", cn, err)
		}
		return writePEM(keyPath, "PRIVATE KEY", keyDER)
	}
	if err := issue(2, "konnectivity-server", x509.ExtKeyUsageServerAuth, spec.DNSNames, spec.IPs, p.ServerCert, p.ServerKey); err != nil {
		return nil, err
	}
	if err := issue(3, spec.AgentName, x509.ExtKeyUsageClientAuth, nil, nil, p.AgentCert, p.AgentKey); err != nil {
		return nil, err
	}
	return p, nil
}

func writePEM(path, typ string, der []byte) error {
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
