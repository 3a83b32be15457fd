package e2e

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

const (
	agentAudience = "system:konnectivity-server"
	agentSAUser   = "system:serviceaccount:kube-system:konnectivity-agent"
	goodToken     = "good-token"
	// otherAudienceToken is a token for another audience that the fake
	// apiserver authenticates without checking the audience asked for
	// (kube-apiserver's webhook and static-token authenticators do).
	otherAudienceToken = "other-audience-token"
)

// fakeAPIServer answers TokenReviews like kube-apiserver: only over TLS
// with a client certificate from the test CA (the server's kubeconfig
// identity), authenticated only for goodToken.
type fakeAPIServer struct {
	srv     *httptest.Server
	reviews atomic.Int64
	noCert  atomic.Int64 // requests that came without a client certificate
	// other serves every request that is not a TokenReview, when set
	// (TestUpstreamManifests: Leases on the same apiserver).
	other atomic.Pointer[http.Handler]
	// With unsureFor set (answerUnsure), the reviews from the first one
	// after it for that long are answered as kube-apiserver answers a
	// lookup it could not do: 201, authenticated=false, and the cause in
	// status.error. unsureGiven counts those answers.
	unsureFor, unsureFrom, unsureGiven atomic.Int64
	// down makes every TokenReview fail: the connection is reset, as a
	// restarting apiserver's is.
	down atomic.Bool
	// refused answers goodToken too "authenticated=false" with no error
	// of the apiserver's own: a plain refusal, as of a revoked token.
	refused atomic.Bool
}

// answerUnsure makes f answer every review "unsure" for d, counted from
// the next review.
func (f *fakeAPIServer) answerUnsure(d time.Duration) {
	f.unsureFrom.Store(0)
	f.unsureFor.Store(int64(d))
}

// unsureNow reports whether a review arriving now is answered unsure.
func (f *fakeAPIServer) unsureNow() bool {
	d := f.unsureFor.Load()
	if d <= 0 {
		return false
	}
	now := time.Now().UnixNano()
	f.unsureFrom.CompareAndSwap(0, now)
	if now-f.unsureFrom.Load() >= d {
		return false
	}
	f.unsureGiven.Add(1)
	return true
}

func startFakeAPIServer(t *testing.T, p *pki) *fakeAPIServer {
	t.Helper()
	f := &fakeAPIServer{}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /apis/authentication.k8s.io/v1/tokenreviews", func(w http.ResponseWriter, r *http.Request) {
		if f.down.Load() {
			if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
				if tc, ok := c.(*tls.Conn); ok {
					if nc, ok := tc.NetConn().(*net.TCPConn); ok {
						nc.SetLinger(0) // a reset
					}
				}
				c.Close()
				return
			}
			http.Error(w, `{"kind":"Status","code":429}`, http.StatusTooManyRequests) // HTTP/2: no reset to make
			return
		}
		if r.TLS == nil || len(r.TLS.VerifiedChains) == 0 {
			f.noCert.Add(1)
			http.Error(w, `{"kind":"Status","code":401}`, http.StatusUnauthorized)
			return
		}
		var req struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Spec       struct {
				Token     string   `json:"token"`
				Audiences []string `json:"audiences"`
			} `json:"spec"`
		}
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil ||
			req.Kind != "TokenReview" || req.APIVersion != "authentication.k8s.io/v1" {
			http.Error(w, "bad TokenReview", http.StatusBadRequest)
			return
		}
		f.reviews.Add(1)
		type user struct {
			Username string `json:"username"`
		}
		status := struct {
			Authenticated bool     `json:"authenticated"`
			User          user     `json:"user"`
			Audiences     []string `json:"audiences,omitempty"`
			Error         string   `json:"error,omitempty"`
		}{}
		switch {
		case f.unsureNow():
			status.Error = "[invalid bearer token, etcdserver: request timed out]"
		case f.refused.Load():
		case req.Spec.Token == goodToken:
			status.Authenticated = true
			status.User.Username = agentSAUser
			status.Audiences = []string{agentAudience}
		case req.Spec.Token == otherAudienceToken:
			status.Authenticated = true
			status.User.Username = agentSAUser
			status.Audiences = []string{"https://kubernetes.default.svc.cluster.local"}
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]any{
			"apiVersion": "authentication.k8s.io/v1",
			"kind":       "TokenReview",
			"spec":       req.Spec,
			"status":     status,
		})
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if h := f.other.Load(); h != nil {
			(*h).ServeHTTP(w, r)
			return
		}
		http.NotFound(w, r)
	})
	f.srv = httptest.NewUnstartedServer(mux)
	f.srv.TLS = newServerTLSRequiringClient(t, p)
	f.srv.StartTLS()
	t.Cleanup(f.srv.Close)
	return f
}

// writeKubeconfig writes the server's kubeconfig for f: f's serving CA,
// and p's agent certificate as the client identity.
func (f *fakeAPIServer) writeKubeconfig(t *testing.T, p *pki, path string) {
	t.Helper()
	caPath := filepath.Join(filepath.Dir(path), "apiserver-ca.crt")
	if err := os.WriteFile(caPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	writeKubeconfigFile(t, path, f.srv.URL, caPath, fmt.Sprintf("{client-certificate: %q, client-key: %q}", p.agentCert, p.agentKey))
}

// writeKubeconfigFile writes a kubeconfig at path for the apiserver at
// server, trusted through caFile, as the user whose credential user
// gives: a YAML flow mapping such as {token: "x"}.
func writeKubeconfigFile(t *testing.T, path, server, caFile, user string) {
	t.Helper()
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {server: %q, certificate-authority: %q}
users:
- name: u
  user: %s
contexts:
- name: e2e
  context: {cluster: e2e, user: u}
current-context: e2e
`, server, caFile, user)
	if err := os.WriteFile(path, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
}

// writeFileAtomic replaces path in one rename, as kubelet does for
// projected tokens.
func writeFileAtomic(t *testing.T, path string, data []byte) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// startTokenServer starts a server that checks agents' ServiceAccount
// tokens with TokenReviews at api (its kubeconfig written in dir), with
// extra flags.
func startTokenServer(t *testing.T, p *pki, api *fakeAPIServer, dir string, extra ...string) *server {
	t.Helper()
	kc := filepath.Join(dir, "kubeconfig")
	api.writeKubeconfig(t, p, kc)
	return startServerOpts(t, serverOpts{pki: p, extra: append(tokenAuthFlags(kc), extra...)})
}

// tokenAuthFlags are the server flags that check agents' tokens with
// TokenReviews at the apiserver kubeconfig names: the konnectivity-agent
// ServiceAccount of kube-system, for agentAudience.
func tokenAuthFlags(kubeconfig string) []string {
	return []string{
		"--kubeconfig=" + kubeconfig,
		"--authentication-audience=" + agentAudience,
		"--agent-namespace=kube-system",
		"--agent-service-account=konnectivity-agent",
	}
}

// startTokenAgent starts an agent of s that logs in with the token in
// tokenFile, retrying fast, with extra flags.
func startTokenAgent(t *testing.T, s *server, p *pki, id, tokenFile string, extra ...string) *agent {
	t.Helper()
	return startAgentArgs(t, id, append([]string{
		"--proxy-server-host=127.0.0.1",
		"--proxy-server-port=" + fmt.Sprint(s.agentPort),
		"--ca-cert=" + p.caCert,
		"--service-account-token-path=" + tokenFile,
		"--sync-interval=100ms", "--sync-interval-cap=500ms",
	}, extra...)...)
}

// TestTokenAuth: agents authenticate with a ServiceAccount token that the
// server checks with a TokenReview against kube-apiserver; no client
// certificates and no --cluster-ca-cert.
func TestTokenAuth(t *testing.T) {
	p := newPKI(t, t.TempDir())
	api := startFakeAPIServer(t, p)
	dir := t.TempDir()
	s := startTokenServer(t, p, api, dir, "--agent-wait=1s")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	tokenAgent := func(id, tokenFile string) *agent { return startTokenAgent(t, s, p, id, tokenFile) }

	// One agent starts with a bad token: refused, and the server stays
	// unready.
	rotating := filepath.Join(dir, "token-rotating")
	writeFileAtomic(t, rotating, []byte("bad-token\n"))
	a1 := tokenAgent("a1", rotating)
	waitFor(t, startTimeout, "server logs the bad token's 401", func() bool {
		return strings.Contains(s.proc.out.String(), "status=401")
	})
	for range 3 {
		if got := getStatus(t, s.healthURL("/readyz")); got != http.StatusServiceUnavailable {
			t.Fatalf("server /readyz = %d with only a bad-token agent, want 503", got)
		}
		if got := getStatus(t, a1.healthURL("/readyz")); got != http.StatusServiceUnavailable {
			t.Fatalf("bad-token agent /readyz = %d, want 503", got)
		}
		time.Sleep(300 * time.Millisecond)
	}
	if el, err := dialErr(t, s.egressDialer(t), backend, 10*time.Second); err == nil || !strings.Contains(err.Error(), "code 503") {
		t.Fatalf("dial with only a bad-token agent: %v after %v, want \"code 503\"", err, el)
	}
	t.Logf("bad token refused: %s", lineWith(s.proc.out.String(), "status=401"))

	// The token file is rotated: the running agent reads it on its next
	// attempt and gets in.
	writeFileAtomic(t, rotating, []byte(goodToken+"\n"))
	rotated := time.Now()
	waitHTTP(t, a1.proc, a1.healthURL("/readyz"), http.StatusOK)
	waitHTTP(t, s.proc, s.healthURL("/readyz"), http.StatusOK)
	t.Logf("agent admitted %v after its token file was rewritten (no restart)", time.Since(rotated).Round(time.Millisecond))
	checkReachable(t, s.egressDialer(t), backend, "b1", 10)

	// A second agent with a good token from the start.
	good := filepath.Join(dir, "token-good")
	writeFileAtomic(t, good, []byte(goodToken))
	tokenAgent("a2", good)
	s.waitAgents(t, 2, startTimeout)
	checkReachable(t, s.egressDialer(t), backend, "b1", 10)
	if n := api.reviews.Load(); n < 2 {
		t.Errorf("fake apiserver saw %d TokenReviews, want at least 2 (bad and good token)", n)
	}
	if n := api.noCert.Load(); n > 0 {
		t.Errorf("%d TokenReview requests came without the kubeconfig's client certificate", n)
	}
}

// TestTokenReviewRateBound: peers log in on the agent port with a new bad
// token each, far faster than --max-token-reviews-per-second. The fake
// apiserver must see at most the rate's worth of TokenReviews over the
// attack plus the one-second burst; every other login is answered 503 at
// once and counted in …_token_reviews_rate_limited_total; and a good agent
// still gets in afterwards, its review sent as the bound refills.
func TestTokenReviewRateBound(t *testing.T) {
	const (
		rate    = 10 // TokenReviews per second the server may send
		attack  = 3 * time.Second
		workers = 8 // well under --max-unadmitted-agent-connections (64)
	)
	p := newPKI(t, t.TempDir())
	api := startFakeAPIServer(t, p)
	dir := t.TempDir()
	s := startTokenServer(t, p, api, dir, fmt.Sprintf("--max-token-reviews-per-second=%d", rate))
	addr, conf := agentPortTLS(t, p, s)

	// The attack: each worker logs in over and over, a new agent ID and a
	// new bad token each time, so no answer comes from the cache.
	var unauthorized, unavailable, other atomic.Int64
	var otherWhy atomic.Value
	start := time.Now()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := 0; time.Since(start) < attack; i++ {
				code, err := rawTokenLogin(addr, conf, fmt.Sprintf("attacker-%d-%d", w, i), fmt.Sprintf("bad-token-%d-%d", w, i))
				switch {
				case err != nil:
					other.Add(1)
					otherWhy.Store(err.Error())
				case code == http.StatusUnauthorized:
					unauthorized.Add(1)
				case code == http.StatusServiceUnavailable:
					unavailable.Add(1)
				default:
					other.Add(1)
					otherWhy.Store(fmt.Sprintf("status %d", code))
				}
			}
		})
	}
	wg.Wait()
	window := time.Since(start)
	reviews := api.reviews.Load()
	logins := unauthorized.Load() + unavailable.Load() + other.Load()
	// The bucket is full (one second's worth) when the attack starts and
	// refills at rate; one more for the refill the clock rounds into.
	bound := int64(rate*(1+window.Seconds())) + 1
	limitedMetric := metricValue(t, s.healthURL("/metrics"), "konnectivity_network_proxy_server_token_reviews_rate_limited_total")
	t.Logf("%d logins with bad tokens in %s (%.0f/s, %d workers): %d answered 401, %d answered 503, %d otherwise (last: %v); %d TokenReviews at the apiserver (bound %d at %d/s); rate_limited_total=%v",
		logins, window.Round(time.Millisecond), float64(logins)/window.Seconds(), workers, unauthorized.Load(), unavailable.Load(), other.Load(), otherWhy.Load(),
		reviews, bound, rate, limitedMetric)
	if logins < 3*bound {
		t.Fatalf("the attack made %d logins, under 3 times the bound of %d: too slow to test it", logins, bound)
	}
	if reviews > bound {
		t.Errorf("%d TokenReviews reached the apiserver in %s, want at most %d (%d/s and a one-second burst)", reviews, window.Round(time.Millisecond), bound, rate)
	}
	if reviews < rate {
		t.Errorf("%d TokenReviews reached the apiserver, want at least the burst of %d", reviews, rate)
	}
	if got := unauthorized.Load(); got != reviews {
		t.Errorf("%d logins answered 401, want one per TokenReview (%d)", got, reviews)
	}
	if other.Load() != 0 {
		t.Errorf("%d logins neither 401 nor 503, last: %v", other.Load(), otherWhy.Load())
	}
	if limitedMetric != float64(unavailable.Load()) {
		t.Errorf("token_reviews_rate_limited_total = %v, want the %d logins answered 503", limitedMetric, unavailable.Load())
	}

	// A good agent right after: the bound refills, its token is reviewed
	// and it serves requests.
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	good := filepath.Join(dir, "token-good")
	writeFileAtomic(t, good, []byte(goodToken))
	startTokenAgent(t, s, p, "good", good)
	s.waitAgents(t, 1, startTimeout)
	checkReachable(t, s.egressDialer(t), backend, "b1", 3)
	if n := api.reviews.Load(); n <= reviews {
		t.Errorf("the good agent got in with no TokenReview (%d before, %d after)", reviews, n)
	}
}

// rawTokenLogin logs in on a server's agent port as an agent named id with
// token and returns the status of the server's answer.
func rawTokenLogin(addr string, conf *tls.Config, id, token string) (int, error) {
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, conf)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(15 * time.Second))
	if _, err := fmt.Fprintf(conn, "GET /konnectivity/v1/tunnel HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: konnectivity-h2\r\nKonnectivity-Agent-Id: %s\r\nAuthorization: Bearer %s\r\n\r\n", id, token); err != nil {
		return 0, err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

func lineWith(out, substr string) string {
	for line := range strings.Lines(out) {
		if strings.Contains(line, substr) {
			return strings.TrimSpace(line)
		}
	}
	return ""
}

// ---------------------------------------------------------------------------
// Frontend UID guard

const helperEnv = "KONNECTIVITY_E2E_HELPER"

// runHelper runs one job in a re-executed test binary (see runAsUID) and
// returns the exit code.
func runHelper(job string) int {
	switch job {
	case "connect":
		// CONNECT on the socket in $KE2E_SOCK to $KE2E_ADDR; print the
		// status line.
		c, err := net.DialTimeout("unix", os.Getenv("KE2E_SOCK"), 5*time.Second)
		if err != nil {
			fmt.Printf("dial: %v\n", err)
			return 1
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(c, connectHead(os.Getenv("KE2E_ADDR"))); err != nil {
			fmt.Printf("write: %v\n", err)
			return 1
		}
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			fmt.Printf("read: %v (got %q)\n", err, line)
			return 1
		}
		fmt.Print(line)
		return 0
	}
	fmt.Fprintf(os.Stderr, "unknown helper job %q\n", job)
	return 2
}

// requireRoot skips without root, except in CI where a missing check
// must not pass silently.
func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("needs root to run a client as another UID (euid %d); CI must run this test", os.Geteuid())
	}
	t.Skipf("needs root to run a client as another UID (euid %d)", os.Geteuid())
}

// runAsUID runs a copy of the test binary as uid:uid with helper job and
// env, and returns its output. The copy lives in dir, which must be
// reachable by that user.
func runAsUID(t *testing.T, dir string, uid uint32, job string, env ...string) (string, error) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "e2e-helper")
	if _, err := os.Stat(bin); err != nil {
		// The go build cache is private to root; link, or copy, the binary
		// where the other user can run it.
		if err := os.Link(self, bin); err != nil {
			data, rerr := os.ReadFile(self)
			if rerr != nil {
				t.Fatal(rerr)
			}
			if err := os.WriteFile(bin, data, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chmod(bin, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = append([]string{helperEnv + "=" + job, "PATH=/usr/bin:/bin"}, env...)
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestFrontendUIDGuard: the Unix socket frontend checks the peer's UID
// (SO_PEERCRED), not only the file mode. A world-writable socket still
// refuses a UID that is not allowed.
func TestFrontendUIDGuard(t *testing.T) {
	requireRoot(t)
	const nobody = 65534
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	cases := []struct {
		name  string
		flags []string
		want  string
	}{
		{"default-uids-refuse-65534", []string{"--uds-mode=0666"}, "HTTP/1.1 403"},
		{"65534-allowed", []string{"--uds-mode=0666", "--frontend-allowed-uids=0,65534"}, "HTTP/1.1 200"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := startServer(t, tc.flags...)
			s.startAgent(t, "a1", "")
			// MkdirTemp made the socket's directory 0700.
			if err := os.Chmod(s.dir, 0o755); err != nil {
				t.Fatal(err)
			}
			out, err := runAsUID(t, s.dir, nobody, "connect", "KE2E_SOCK="+s.sock, "KE2E_ADDR="+echo.addr())
			if err != nil {
				t.Fatalf("client as uid %d: %v\n%s", nobody, err, out)
			}
			if !strings.HasPrefix(out, tc.want) {
				t.Fatalf("client as uid %d with %v: got %q, want %q", nobody, tc.flags, strings.TrimSpace(out), tc.want)
			}
			t.Logf("uid %d with %v: %s", nobody, tc.flags, strings.TrimSpace(out))
			// Root (this process) is always allowed.
			c := rawUDS(t, s)
			if _, err := io.WriteString(c, connectHead(echo.addr())); err != nil {
				t.Fatal(err)
			}
			readExactly(t, c, established)
		})
	}
}

// newServerTLSRequiringClient is a TLS config for the fake apiserver that
// requires a client certificate from p's CA.
func newServerTLSRequiringClient(t *testing.T, p *pki) *tls.Config {
	t.Helper()
	caPEM, err := os.ReadFile(p.caCert)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		t.Fatal("test CA: no certificate")
	}
	return &tls.Config{ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pool}
}

// agentPortTLS is where s takes agents and the TLS configuration that
// trusts its serving certificate, for tests that log in by hand.
func agentPortTLS(t *testing.T, p *pki, s *server) (addr string, conf *tls.Config) {
	t.Helper()
	caPEM, err := os.ReadFile(p.caCert)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)
	return net.JoinHostPort("127.0.0.1", fmt.Sprint(s.agentPort)), &tls.Config{RootCAs: roots, ServerName: "127.0.0.1"}
}
