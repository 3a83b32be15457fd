package main

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/certs"
	"github.com/spinifex/konnectivity/internal/daemon"
)

// checkPKI writes a CA (certificate and key) and, on demand, pairs it
// signed with chosen dates.
type checkPKI struct {
	dir            string
	ca             *certs.CA
	caCert, caKeyF string
}

func newCheckPKI(t *testing.T) *checkPKI {
	t.Helper()
	ca, err := certs.NewCA("check-test-ca", 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	p := &checkPKI{dir: t.TempDir(), ca: ca}
	p.caCert, p.caKeyF = filepath.Join(p.dir, "ca.crt"), filepath.Join(p.dir, "ca.key")
	der, err := x509.MarshalPKCS8PrivateKey(ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	writeTestFile(t, p.caCert, ca.CertPEM)
	writeTestFile(t, p.caKeyF, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}))
	return p
}

// pair writes name.crt and name.key, valid from notBefore to notAfter.
func (p *checkPKI) pair(t *testing.T, name string, usage x509.ExtKeyUsage, notBefore, notAfter time.Time) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca.Cert, &key.PublicKey, p.ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(p.dir, name+".crt"), filepath.Join(p.dir, name+".key")
	writeTestFile(t, certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	writeTestFile(t, keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}))
	return certFile, keyFile
}

func writeTestFile(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

func runCheckArgs(args ...string) (code int, out string) {
	var o, e bytes.Buffer
	code = runCheck(args, &o, &e)
	return code, o.String() + e.String()
}

// The check a restart runs fails with daemon.CheckExitCertificate, naming
// the flag and the file, when a pair the next image would present (the
// agent listener's, the TCP front door's, an agent's client pair) is
// expired or not yet valid, which a start only warns of; a pair the next
// image would mint again (--mint-ca-cert) is no failure.
func TestCheckCertificateValidity(t *testing.T) {
	p := newCheckPKI(t)
	now := time.Now()
	good := func(name string, usage x509.ExtKeyUsage) (string, string) {
		return p.pair(t, name, usage, now.Add(-time.Hour), now.Add(time.Hour))
	}
	expired := func(name string, usage x509.ExtKeyUsage) (string, string) {
		return p.pair(t, name, usage, now.Add(-48*time.Hour), now.Add(-time.Hour))
	}
	early := func(name string, usage x509.ExtKeyUsage) (string, string) {
		return p.pair(t, name, usage, now.Add(time.Hour), now.Add(48*time.Hour))
	}
	srv := x509.ExtKeyUsageServerAuth
	goodCert, goodKey := good("server-good", srv)
	oldCert, oldKey := expired("server-expired", srv)
	earlyCert, earlyKey := early("server-early", srv)
	server := func(cert, key string, extra ...string) []string {
		return append([]string{"server", "--mode=http-connect", "--uds-name=" + filepath.Join(p.dir, "k.sock"),
			"--cluster-cert=" + cert, "--cluster-key=" + key, "--cluster-ca-cert=" + p.caCert}, extra...)
	}
	agentGoodCert, agentGoodKey := good("agent-good", x509.ExtKeyUsageClientAuth)
	agentOldCert, agentOldKey := expired("agent-expired", x509.ExtKeyUsageClientAuth)
	agentEarlyCert, agentEarlyKey := early("agent-early", x509.ExtKeyUsageClientAuth)
	agent := func(cert, key string) []string {
		return []string{"agent", "--proxy-server-host=127.0.0.1", "--ca-cert=" + p.caCert, "--agent-cert=" + cert, "--agent-key=" + key}
	}
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"server valid", server(goodCert, goodKey), 0, "configuration loads"},
		{"server expired", server(oldCert, oldKey), daemon.CheckExitCertificate, "--cluster-cert: certificate " + oldCert + " expired at "},
		{"server not yet valid", server(earlyCert, earlyKey), daemon.CheckExitCertificate, "--cluster-cert: certificate " + earlyCert + " not valid before "},
		{"front door off", server(goodCert, goodKey, "--server-port=0", "--server-cert="+oldCert, "--server-key="+oldKey, "--server-ca-cert="+p.caCert), 0, "configuration loads"},
		{"minted again", server(oldCert, oldKey, "--mint-ca-cert="+p.caCert, "--mint-ca-key="+p.caKeyF, "--mint-sans=127.0.0.1"), 0, "configuration loads"},
		{"agent valid", agent(agentGoodCert, agentGoodKey), 0, "configuration loads"},
		{"agent expired", agent(agentOldCert, agentOldKey), daemon.CheckExitCertificate, "--agent-cert: certificate " + agentOldCert + " expired at "},
		{"agent not yet valid", agent(agentEarlyCert, agentEarlyKey), daemon.CheckExitCertificate, "--agent-cert: certificate " + agentEarlyCert + " not valid before "},
		{"garbage is config", server(p.caKeyF, goodKey), 1, "--cluster-cert/--cluster-key"},
	} {
		code, out := runCheckArgs(tc.args...)
		if code != tc.code || !strings.Contains(out, tc.want) {
			t.Errorf("%s: exit %d, output %q; want %d and %q", tc.name, code, out, tc.code, tc.want)
		}
	}
	// The TCP front door serves its pair too: with a port, it is checked.
	port := freePort(t)
	code, out := runCheckArgs(server(goodCert, goodKey, "--server-bind-address=127.0.0.1", "--server-port="+port, "--server-cert="+oldCert, "--server-key="+oldKey, "--server-ca-cert="+p.caCert)...)
	if code != daemon.CheckExitCertificate || !strings.Contains(out, "--server-cert: certificate "+oldCert+" expired at ") {
		t.Errorf("front door expired: exit %d, output %q; want %d naming --server-cert", code, out, daemon.CheckExitCertificate)
	}
}
