package certs

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// openssl runs the openssl command line tool, which serves as an
// independent producer of inputs and checker of outputs. A missing binary is
// a test failure, not a skip: CI installs it.
func openssl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := opensslErr(t, args...)
	if err != nil {
		t.Fatalf("openssl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

func opensslErr(t *testing.T, args ...string) (string, error) {
	t.Helper()
	bin, err := exec.LookPath("openssl")
	if err != nil {
		t.Fatalf("the openssl command is required by these tests (install openssl): %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	return string(out), err
}

const opensslConf = `[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[notca]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
[nocertsign]
basicConstraints = critical,CA:TRUE
keyUsage = critical,digitalSignature
`

// opensslKey makes a private key of the given kind with openssl and checks
// the PEM label, so each encoding really is exercised.
func opensslKey(t *testing.T, dir, kind string) string {
	t.Helper()
	key := filepath.Join(dir, kind+".key")
	var label string
	switch kind {
	case "rsa-pkcs1":
		openssl(t, "genrsa", "-traditional", "-out", key, "2048")
		label = "RSA PRIVATE KEY"
	case "rsa-pkcs8":
		openssl(t, "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", key)
		label = "PRIVATE KEY"
	case "ec-sec1":
		openssl(t, "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", key)
		label = "EC PRIVATE KEY"
	case "ec-sec1-params":
		openssl(t, "ecparam", "-name", "prime256v1", "-genkey", "-out", key)
		label = "EC PARAMETERS"
	case "ec-pkcs8":
		openssl(t, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", key)
		label = "PRIVATE KEY"
	case "ed25519":
		openssl(t, "genpkey", "-algorithm", "ed25519", "-out", key)
		label = "PRIVATE KEY"
	default:
		t.Fatalf("unknown key kind %q", kind)
	}
	data := readFile(t, key)
	if b, _ := pem.Decode(data); b == nil || b.Type != label {
		t.Fatalf("openssl %s key: first PEM block is not %q:\n%s", kind, label, data)
	}
	return key
}

// opensslCert self-signs key with the extensions of section (ca, notca,
// nocertsign) from opensslConf.
func opensslCert(t *testing.T, dir, key, cn, section string) string {
	t.Helper()
	conf := filepath.Join(dir, "openssl.cnf")
	if _, err := os.Stat(conf); err != nil {
		writeFile(t, conf, []byte(opensslConf), 0o644)
	}
	out := filepath.Join(dir, cn+".crt")
	openssl(t, "req", "-x509", "-new", "-config", conf, "-extensions", section,
		"-key", key, "-subj", "/CN="+cn, "-days", "30", "-out", out)
	return out
}

// opensslVerify checks certFile chains to caFile for purpose (sslserver or
// sslclient).
func opensslVerify(t *testing.T, caFile, certFile, purpose string) {
	t.Helper()
	out := openssl(t, "verify", "-CAfile", caFile, "-purpose", purpose, certFile)
	if !strings.Contains(out, ": OK") {
		t.Fatalf("openssl verify %s: %s", certFile, out)
	}
}

// opensslSANs reads the subjectAltName extension back with openssl and
// returns entries normalised as "DNS:x" and "IP:<Go form>", sorted.
func opensslSANs(t *testing.T, certFile string) []string {
	t.Helper()
	out := openssl(t, "x509", "-noout", "-ext", "subjectAltName", "-in", certFile)
	var sans []string
	for _, line := range strings.Split(out, "\n") {
		line = strings.TrimSpace(line)
		// openssl 3.0 says "No extensions in certificate" when the
		// requested extension is absent.
		if line == "" || strings.HasPrefix(line, "X509v3 Subject Alternative Name") || line == "No extensions in certificate" {
			continue
		}
		for _, e := range strings.Split(line, ",") {
			e = strings.TrimSpace(e)
			switch {
			case strings.HasPrefix(e, "DNS:"):
				sans = append(sans, e)
			case strings.HasPrefix(e, "IP Address:"):
				ip := net.ParseIP(strings.TrimPrefix(e, "IP Address:"))
				if ip == nil {
					t.Fatalf("openssl printed unparsable IP SAN %q", e)
				}
				sans = append(sans, "IP:"+ip.String())
			default:
				t.Fatalf("unexpected SAN entry %q in %q", e, out)
			}
		}
	}
	slices.Sort(sans)
	return sans
}

func wantSANs(dns []string, ips []net.IP) []string {
	var out []string
	for _, d := range dns {
		out = append(out, "DNS:"+strings.ToLower(d))
	}
	for _, ip := range ips {
		out = append(out, "IP:"+ip.String())
	}
	slices.Sort(out)
	return out
}

// opensslSameKey checks with openssl that keyFile is the key of certFile.
func opensslSameKey(t *testing.T, certFile, keyFile string) {
	t.Helper()
	a := openssl(t, "x509", "-noout", "-pubkey", "-in", certFile)
	b := openssl(t, "pkey", "-pubout", "-in", keyFile)
	if a != b {
		t.Fatalf("openssl: public key of %s differs from %s", certFile, keyFile)
	}
}

func readFile(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func writeFile(t *testing.T, p string, data []byte, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(p, data, mode); err != nil {
		t.Fatal(err)
	}
}

// writeCA stores ca as ca.crt/ca.key (PKCS#8) in dir.
func writeCA(t *testing.T, dir string, ca *CA) (certFile, keyFile string) {
	t.Helper()
	der, err := x509.MarshalPKCS8PrivateKey(ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
	writeFile(t, certFile, ca.CertPEM, 0o644)
	writeFile(t, keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600)
	return certFile, keyFile
}

func newCA(t *testing.T, cn string) *CA {
	t.Helper()
	ca, err := NewCA(cn, 3*365*24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// caWithDates signs a CA with arbitrary validity dates (openssl cannot
// backdate without faketime).
func caWithDates(t *testing.T, cn string, notBefore, notAfter time.Time) *CA {
	t.Helper()
	base := newCA(t, cn)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: cn},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, base.Key.Public(), base.Key)
	if err != nil {
		t.Fatal(err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &CA{Cert: c, Key: base.Key, CertPEM: encodeCertPEM(der)}
}

func parseCertFile(t *testing.T, p string) *x509.Certificate {
	t.Helper()
	certs, err := parseCertsPEM(readFile(t, p))
	if err != nil {
		t.Fatalf("%s: %v", p, err)
	}
	return certs[0]
}

// fakeClock is safe for use from handshake goroutines.
type fakeClock struct{ ns atomic.Int64 }

func newFakeClock() *fakeClock {
	c := &fakeClock{}
	c.ns.Store(time.Now().UnixNano())
	return c
}
func (c *fakeClock) Now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *fakeClock) Advance(d time.Duration) { c.ns.Add(int64(d)) }
func (c *fakeClock) Set(t time.Time)         { c.ns.Store(t.UnixNano()) }
func (c *fakeClock) install(th *throttle)    { th.now = c.Now }
func mustContain(t *testing.T, got, want string) {
	t.Helper()
	if !strings.Contains(got, want) {
		t.Fatalf("%q does not contain %q", got, want)
	}
}

// syncBuffer collects log output written from several goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// ensureEnv is one directory with a CA file and an output pair.
type ensureEnv struct {
	dir, caFile, certFile, keyFile string
	ca                             *CA
}

func newEnsureEnv(t *testing.T) *ensureEnv {
	t.Helper()
	dir := t.TempDir()
	ca := newCA(t, "ensure-ca")
	caFile, _ := writeCA(t, dir, ca)
	return &ensureEnv{dir: dir, caFile: caFile, ca: ca,
		certFile: filepath.Join(dir, "out", "tls.crt"), keyFile: filepath.Join(dir, "out", "tls.key")}
}

func (e *ensureEnv) opts() EnsureOptions {
	return EnsureOptions{
		CertFile: e.certFile, KeyFile: e.keyFile, CA: e.ca,
		Request: Request{
			CommonName:  "konnectivity-server",
			DNSNames:    []string{"konnectivity.example", "localhost"},
			IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
			Validity:    365 * 24 * time.Hour,
		},
		RenewBefore: 720 * time.Hour,
	}
}

func (e *ensureEnv) ensure(t *testing.T, o EnsureOptions) Result {
	t.Helper()
	res, err := Ensure(o)
	if err != nil {
		t.Fatalf("Ensure: %v", err)
	}
	return res
}

// verify checks the pair on disk with openssl and Go's TLS loader.
func (e *ensureEnv) verify(t *testing.T, o EnsureOptions) {
	t.Helper()
	purpose := "sslserver"
	if o.Request.Client {
		purpose = "sslclient"
	}
	opensslVerify(t, e.caFile, e.certFile, purpose)
	if got, want := opensslSANs(t, e.certFile), wantSANs(o.Request.DNSNames, o.Request.IPAddresses); !slices.Equal(got, want) {
		t.Fatalf("SANs per openssl %v, want %v", got, want)
	}
	opensslSameKey(t, e.certFile, e.keyFile)
	if _, err := tls.LoadX509KeyPair(e.certFile, e.keyFile); err != nil {
		t.Fatal(err)
	}
}

func expectMinted(t *testing.T, res Result, reason string) {
	t.Helper()
	if !res.Minted {
		t.Fatalf("reused (%s), want minted because %q", res.Reason, reason)
	}
	mustContain(t, res.Reason, reason)
	mustContain(t, res.String(), "minted: ")
}

func served(t *testing.T, r *Reloader) *x509.Certificate {
	t.Helper()
	c, err := r.GetCertificate(&tls.ClientHelloInfo{})
	if err != nil {
		t.Fatal(err)
	}
	c2, err := r.GetClientCertificate(&tls.CertificateRequestInfo{})
	if err != nil {
		t.Fatal(err)
	}
	if c != c2 {
		t.Fatal("GetCertificate and GetClientCertificate disagree")
	}
	return c.Leaf
}

// String renders the result as "reused: <reason>" or "minted: <reason>".
func (r Result) String() string {
	if r.Minted {
		return "minted: " + r.Reason
	}
	return "reused: " + r.Reason
}

// WriteFileAtomic replaces path with data so that readers see either the old
// or the new content, never a mix, even across a crash: it writes a temporary
// file in the same directory, fsyncs it, sets mode, renames it over path and
// fsyncs the directory. A leftover temporary file from an interrupted run
// (".<name>.tmp-*") is harmless and never read.
func WriteFileAtomic(path string, data []byte, mode os.FileMode) error {
	tmp, err := stageFile(path, data, mode)
	if err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("write %s: %w", path, err)
	}
	return syncDir(path)
}

// GetClientCertificate implements tls.Config.GetClientCertificate.
func (r *Reloader) GetClientCertificate(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	return r.current(), nil
}
