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

// PKI holds the file paths of a throwaway CA, a server certificate for
// 127.0.0.1 and one agent client certificate, minted for one run. Where
// many agents run, they all present that one certificate: the server's
// cost per agent (a full handshake and a chain verification, no session
// resumption) does not depend on which certificate it is, and the
// agents' IDs are their own.
type PKI struct {
	CACert, ServerCert, ServerKey, AgentCert, AgentKey string
}

// Mint writes a new PKI into dir; name tells the runs' CAs and agent
// certificates apart ("bench", "scale").
func Mint(dir, name string) (*PKI, error) {
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate CA key: %w", err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "konnectivity-" + name + "-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
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
		ServerCert: filepath.Join(dir, "server.crt"),
		ServerKey:  filepath.Join(dir, "server.key"),
		AgentCert:  filepath.Join(dir, "agent.crt"),
		AgentKey:   filepath.Join(dir, "agent.key"),
	}
	if err := writePEM(p.CACert, "CERTIFICATE", caDER); err != nil {
		return nil, err
	}
	issue := func(serial int64, cn string, usage x509.ExtKeyUsage, ips []net.IP, certPath, keyPath string) error {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return fmt.Errorf("generate %s key: %w", cn, err)
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial),
			Subject:      pkix.Name{CommonName: cn},
			NotBefore:    now.Add(-time.Hour),
			NotAfter:     now.Add(24 * time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  []x509.ExtKeyUsage{usage},
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
	if err := issue(2, "konnectivity-server", x509.ExtKeyUsageServerAuth,
		[]net.IP{net.IPv4(127, 0, 0, 1)}, p.ServerCert, p.ServerKey); err != nil {
		return nil, err
	}
	if err := issue(3, name+"-agent", x509.ExtKeyUsageClientAuth, nil, p.AgentCert, p.AgentKey); err != nil {
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
