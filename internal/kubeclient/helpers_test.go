package kubeclient

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/testpki"
)

// sampleToken is checked for in every error message the tests produce.
const sampleToken = "eyJhbGciOiJSUzI1NiJ9.c2FtcGxlLXNlY3JldC10b2tlbg.U0VDUkVULVNJR05BVFVSRS1kby1ub3QtbGVhaw"

// fakeAPIServer is an apiserver over TLS that answers every request it
// accepts with 200, and one without the bearer token it wants with 401.
type fakeAPIServer struct {
	srv      *httptest.Server
	caPEM    []byte // CA of the serving cert
	clientCA *testpki.CA
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
	serverCA := testpki.NewCA(t, "fake-apiserver-ca")
	f.caPEM = serverCA.PEM
	var ips []net.IP
	if !o.dnsOnly {
		ips = []net.IP{net.IPv4(127, 0, 0, 1)}
	}
	sc, sk := serverCA.Issue(t, "kube-apiserver", true, []string{"kubernetes.test"}, ips)
	serving, err := tls.X509KeyPair(sc, sk)
	if err != nil {
		t.Fatal(err)
	}
	f.clientCA = testpki.NewCA(t, "fake-client-ca")
	f.certPEM, f.keyPEM = f.clientCA.Issue(t, "system:konnectivity-server", false, nil, nil)

	f.srv = httptest.NewUnstartedServer(http.HandlerFunc(f.serve))
	f.srv.Config.ErrorLog = log.New(io.Discard, "", 0) // refused handshakes are expected
	f.srv.TLS = &tls.Config{Certificates: []tls.Certificate{serving}, MinVersion: tls.VersionTLS12}
	if o.requireClientCert {
		pool := x509.NewCertPool()
		pool.AddCert(f.clientCA.Cert)
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
