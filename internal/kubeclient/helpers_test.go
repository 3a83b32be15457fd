package kubeclient

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// sampleToken is checked for in every error message the tests produce.
const sampleToken = "eyJhbGciOiJSUzI1NiJ9.c2FtcGxlLXNlY3JldC10b2tlbg.U0VDUkVULVNJR05BVFVSRS1kby1ub3QtbGVhaw"

type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t testing.TB, cn string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: cn},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue returns a PEM cert and key signed by ca.
func (ca *testCA) issue(t testing.TB, cn string, server bool, dns []string, ips []net.IP) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	usage := x509.ExtKeyUsageClientAuth
	if server {
		usage = x509.ExtKeyUsageServerAuth
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		DNSNames:     dns,
		IPAddresses:  ips,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
}

// fakeAPIServer is an apiserver over TLS that answers every request it
// accepts with 200, and one without the bearer token it wants with 401.
type fakeAPIServer struct {
	srv      *httptest.Server
	caPEM    []byte // CA of the serving cert
	clientCA *testCA
	certPEM  []byte // a client cert the server accepts
	keyPEM   []byte

	mu         sync.Mutex
	wantBearer string // if set, the request must carry this bearer token
}

type fakeOpts struct {
	requireClientCert bool
	dnsOnly           bool // serving cert without IP SAN, only kubernetes.test
}

func newFakeAPIServer(t *testing.T, o fakeOpts) *fakeAPIServer {
	t.Helper()
	f := &fakeAPIServer{}
	serverCA := newTestCA(t, "fake-apiserver-ca")
	f.caPEM = serverCA.pem
	var ips []net.IP
	if !o.dnsOnly {
		ips = []net.IP{net.IPv4(127, 0, 0, 1)}
	}
	sc, sk := serverCA.issue(t, "kube-apiserver", true, []string{"kubernetes.test"}, ips)
	serving, err := tls.X509KeyPair(sc, sk)
	if err != nil {
		t.Fatal(err)
	}
	f.clientCA = newTestCA(t, "fake-client-ca")
	f.certPEM, f.keyPEM = f.clientCA.issue(t, "system:konnectivity-server", false, nil, nil)

	f.srv = httptest.NewUnstartedServer(http.HandlerFunc(f.serve))
	f.srv.Config.ErrorLog = log.New(io.Discard, "", 0) // refused handshakes are expected
	f.srv.TLS = &tls.Config{Certificates: []tls.Certificate{serving}, MinVersion: tls.VersionTLS12}
	if o.requireClientCert {
		pool := x509.NewCertPool()
		pool.AddCert(f.clientCA.cert)
		f.srv.TLS.ClientCAs = pool
		f.srv.TLS.ClientAuth = tls.RequireAndVerifyClientCert
	}
	f.srv.StartTLS()
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeAPIServer) url() string { return f.srv.URL }

func (f *fakeAPIServer) serve(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	wantBearer := f.wantBearer
	f.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if wantBearer != "" && r.Header.Get("Authorization") != "Bearer "+wantBearer {
		w.WriteHeader(http.StatusUnauthorized)
		fmt.Fprint(w, `{"kind":"Status","reason":"Unauthorized","message":"Unauthorized","code":401}`)
		return
	}
	fmt.Fprint(w, `{"kind":"APIVersions","versions":["v1"]}`)
}

func b64(b []byte) string { return base64.StdEncoding.EncodeToString(b) }

// kubeconfigInline is a kubeconfig for f with everything inline.
func (f *fakeAPIServer) kubeconfigInline() string {
	return kubeconfigFor(f.url(), b64(f.caPEM), fmt.Sprintf("    client-certificate-data: %s\n    client-key-data: %s\n", b64(f.certPEM), b64(f.keyPEM)))
}

// kubeconfigFor is a kubeconfig whose current context "main" names the
// cluster "fake" at server, trusting caB64, and the user "server", whose
// fields userYAML gives (indented four spaces). The users come last, so a
// test may append one.
func kubeconfigFor(server, caB64, userYAML string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Config
current-context: main
clusters:
- name: fake
  cluster:
    server: %s
    certificate-authority-data: %s
contexts:
- name: main
  context: {cluster: fake, user: server}
users:
- name: server
  user:
%s`, server, caB64, userYAML)
}

func writeFile(t testing.TB, path string, data []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// noToken fails the test if err's text contains any of the secrets.
func noToken(t *testing.T, err error, secrets ...string) {
	t.Helper()
	if err == nil {
		return
	}
	for _, s := range append(secrets, sampleToken) {
		if s != "" && strings.Contains(err.Error(), s) {
			t.Errorf("error leaks a token: %q", err.Error())
		}
	}
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// ParseKubeconfig is LoadKubeconfig for bytes already read; dir is the folder
// that relative file names are resolved against.
func ParseKubeconfig(data []byte, dir, context string) (*Config, error) {
	cfg, err := parseKubeconfig(data, dir, context, readRegularFile)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig: %w", err)
	}
	return cfg, nil
}
