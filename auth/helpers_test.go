package auth

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
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
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeclient"
	"github.com/spinifex/konnectivity/internal/testpki"
)

// sampleToken is checked for in every error message the tests produce.
const sampleToken = "eyJhbGciOiJSUzI1NiJ9.c2FtcGxlLXNlY3JldC10b2tlbg.U0VDUkVULVNJR05BVFVSRS1kby1ub3QtbGVhaw"

// identity is what the fake apiserver knows about a token.
type identity struct {
	username  string
	audiences []string
}

type reviewRequest struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Spec       struct {
		Token     string   `json:"token"`
		Audiences []string `json:"audiences"`
	} `json:"spec"`
}

// fakeAPIServer serves TokenReview over TLS like kube-apiserver would.
type fakeAPIServer struct {
	t        *testing.T
	srv      *httptest.Server
	caPEM    []byte // CA of the serving cert
	clientCA *testpki.CA
	certPEM  []byte // a client cert the server accepts
	keyPEM   []byte
	requests atomic.Int64
	hangs    atomic.Int64 // requests held by "hang"
	hungUp   atomic.Int64 // of those, ended by the client cancelling its request

	mu       sync.Mutex
	tokens   map[string]identity
	nodes    map[string]any                 // GET /api/v1/nodes/<name> answers, by name
	extras   map[string]map[string][]string // status.user.extra (node and pod claims), by token
	mode     string                         // "", "500", "hang", "garbage", "override"
	override func(req reviewRequest) (int, any)
	release  chan struct{} // closed to end "hang"
}

type fakeOpts struct {
	requireClientCert bool
}

func newFakeAPIServer(t *testing.T, o fakeOpts) *fakeAPIServer {
	t.Helper()
	f := &fakeAPIServer{t: t, tokens: map[string]identity{}, release: make(chan struct{})}
	serverCA := testpki.NewCA(t, "fake-apiserver-ca")
	f.caPEM = serverCA.PEM
	sc, sk := serverCA.Issue(t, "kube-apiserver", true, []string{"kubernetes.test"}, []net.IP{net.IPv4(127, 0, 0, 1)})
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
	t.Cleanup(func() {
		f.setMode("")
		f.srv.Close()
	})
	return f
}

func (f *fakeAPIServer) url() string { return f.srv.URL }

func (f *fakeAPIServer) setMode(mode string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.mode == "hang" && mode != "hang" {
		close(f.release)
		f.release = make(chan struct{})
	}
	f.mode = mode
}

func (f *fakeAPIServer) setOverride(fn func(reviewRequest) (int, any)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.override = fn
	f.mode = "override"
}

func (f *fakeAPIServer) addToken(token string, id identity) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.tokens[token] = id
}

func (f *fakeAPIServer) serve(w http.ResponseWriter, r *http.Request) {
	f.requests.Add(1)
	f.mu.Lock()
	mode, release, override := f.mode, f.release, f.override
	f.mu.Unlock()

	if name, ok := strings.CutPrefix(r.URL.Path, "/api/v1/nodes/"); ok && r.Method == http.MethodGet {
		f.serveNode(w, name)
		return
	}
	if r.Method != http.MethodPost || r.URL.Path != "/apis/authentication.k8s.io/v1/tokenreviews" {
		http.Error(w, "not found", http.StatusNotFound)
		return
	}
	if r.Header.Get("Content-Type") != "application/json" {
		http.Error(w, "bad content type", http.StatusUnsupportedMediaType)
		return
	}
	var req reviewRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Kind != "TokenReview" || req.APIVersion != "authentication.k8s.io/v1" {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	switch mode {
	case "500":
		// Echo the token, as a careless apiserver might: it must be redacted.
		http.Error(w, "internal error reviewing "+req.Spec.Token, http.StatusInternalServerError)
		return
	case "hang":
		f.hangs.Add(1)
		select {
		case <-r.Context().Done():
			f.hungUp.Add(1)
		case <-release:
		}
		http.Error(w, "gave up", http.StatusServiceUnavailable)
		return
	case "garbage":
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, "{not json")
		return
	case "override":
		code, body := override(req)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		json.NewEncoder(w).Encode(body)
		return
	}
	f.mu.Lock()
	id, known := f.tokens[req.Spec.Token]
	extra := f.extras[req.Spec.Token]
	f.mu.Unlock()
	status := map[string]any{"authenticated": false, "user": map[string]any{}}
	if known {
		auds := id.audiences
		if len(req.Spec.Audiences) > 0 {
			auds = nil
			for _, a := range req.Spec.Audiences {
				for _, b := range id.audiences {
					if a == b {
						auds = append(auds, a)
					}
				}
			}
		}
		if len(auds) > 0 {
			status = map[string]any{
				"authenticated": true,
				"user":          map[string]any{"username": id.username, "uid": "1234", "groups": []string{"system:serviceaccounts"}, "extra": extra},
				"audiences":     auds,
			}
		} else {
			status["error"] = "[invalid bearer token, token audiences is invalid for the target audiences]"
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	json.NewEncoder(w).Encode(map[string]any{
		"kind":       "TokenReview",
		"apiVersion": "authentication.k8s.io/v1",
		"metadata":   map[string]any{"creationTimestamp": nil},
		"spec":       req.Spec,
		"status":     status,
	})
}

// serveNode answers a Node GET from f.nodes: a string is an HTTP status
// to fail with, anything else the object.
func (f *fakeAPIServer) serveNode(w http.ResponseWriter, name string) {
	f.mu.Lock()
	obj, ok := f.nodes[name]
	f.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	switch v := obj.(type) {
	case nil:
		if !ok {
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprint(w, `{"kind":"Status","reason":"NotFound"}`)
			return
		}
	case int:
		w.WriteHeader(v)
		fmt.Fprint(w, `{"kind":"Status","reason":"Forbidden"}`)
		return
	}
	json.NewEncoder(w).Encode(obj)
}

// setNode makes GET /api/v1/nodes/<name> answer with a Node carrying addrs,
// or with status code when addrs is nil and code is not 0.
func (f *fakeAPIServer) setNode(name string, code int, addrs ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.nodes == nil {
		f.nodes = map[string]any{}
	}
	if code != 0 {
		f.nodes[name] = code
		return
	}
	var list []map[string]string
	for i, a := range addrs {
		typ := "InternalIP"
		if i > 0 {
			typ = "ExternalIP"
		}
		list = append(list, map[string]string{"type": typ, "address": a})
	}
	list = append(list, map[string]string{"type": "Hostname", "address": name})
	f.nodes[name] = map[string]any{"kind": "Node", "apiVersion": "v1", "metadata": map[string]any{"name": name},
		"status": map[string]any{"addresses": list}}
}

// addBoundToken adds a token bound to pod (uid) on node.
func (f *fakeAPIServer) addBoundToken(token, node, pod, uid string) {
	f.addToken(token, identity{agentUser, []string{testAudience}})
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.extras == nil {
		f.extras = map[string]map[string][]string{}
	}
	f.extras[token] = boundClaims(node, pod, uid)
}

// revoke makes the apiserver forget token.
func (f *fakeAPIServer) revoke(token string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.tokens, token)
}

// boundClaims are the extra fields kube-apiserver adds for a token bound
// to a pod on node.
func boundClaims(node, pod, uid string) map[string][]string {
	return map[string][]string{
		"authentication.kubernetes.io/node-name":     {node},
		"authentication.kubernetes.io/node-uid":      {"node-uid-" + node},
		"authentication.kubernetes.io/pod-name":      {pod},
		"authentication.kubernetes.io/pod-uid":       {uid},
		"authentication.kubernetes.io/credential-id": {"JTI=abc"},
	}
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

// makeJWT returns an unsigned JWT-shaped token with the given exp (0: none).
func makeJWT(sub string, exp int64) string {
	claims := map[string]any{"sub": sub, "iss": "https://kubernetes.default.svc"}
	if exp != 0 {
		claims["exp"] = exp
	}
	payload, _ := json.Marshal(claims)
	enc := base64.RawURLEncoding
	return enc.EncodeToString([]byte(`{"alg":"RS256"}`)) + "." + enc.EncodeToString(payload) + "." + enc.EncodeToString([]byte("sig-"+sub))
}

// fakeClock is a settable clock for cache tests.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
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

func listenUnix(t *testing.T, path string) *net.UnixListener {
	t.Helper()
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// newReviewSetup starts a fake apiserver that requires the kubeconfig's
// client certificate and returns a reviewer for it.
func newReviewSetup(t *testing.T, opts ReviewOptions) (*fakeAPIServer, *TokenReviewer) {
	t.Helper()
	f := newFakeAPIServer(t, fakeOpts{requireClientCert: true})
	cfg := loadConfig(t, f.kubeconfigInline())
	if opts.Audience == "" {
		opts.Audience = testAudience
	}
	if opts.Namespace == "" {
		opts.Namespace = testNS
	}
	if opts.ServiceAccount == "" {
		opts.ServiceAccount = testSA
	}
	r, err := NewTokenReviewer(cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	return f, r
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// peerHelperEnv makes the test binary act as a frontend client: connect to
// the socket named by the variable, print what the server answers, exit.
const peerHelperEnv = "KONNECTIVITY_AUTH_PEER_HELPER_SOCKET"

// TestMain lets the test binary double as a frontend client (peerHelper)
// that the peer-credential tests run under another identity.
func TestMain(m *testing.M) {
	if sock := os.Getenv(peerHelperEnv); sock != "" {
		os.Exit(peerHelper(sock))
	}
	os.Exit(m.Run())
}

func peerHelper(sock string) int {
	c, err := net.Dial("unix", sock)
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		return 2
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(c, "CONNECT 10.0.0.1:443 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
	out, err := io.ReadAll(c)
	os.Stdout.Write(out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		return 2
	}
	return 0
}

// loadConfig is the Config of the kubeconfig kubeconfig, loaded as
// --kubeconfig loads it.
func loadConfig(t testing.TB, kubeconfig string) *kubeclient.Config {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	writeFile(t, path, []byte(kubeconfig))
	cfg, err := kubeclient.LoadKubeconfig(path, "")
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// Authenticate accepts bearerToken if the apiserver says it is a valid token
// for the configured audience and ServiceAccount. Otherwise it returns an
// *Error: 401 (missing, malformed or unauthenticated token), 403 (valid
// token, wrong audience or account) or 503 (the review could not be done;
// retry later). It waits at most Timeout (or until ctx ends).
func (r *TokenReviewer) Authenticate(ctx context.Context, bearerToken string) error {
	_, err := r.Review(ctx, bearerToken)
	return err
}

func (r *TokenReviewer) cacheLen() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.order.Len()
}
