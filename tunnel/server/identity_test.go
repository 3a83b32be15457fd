//lint:file-ignore SA1019 the upstream agent test uses x/net/http2's Transport on a TLS connection it dialled, as grpc-go would.

package server

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/net/http2"
)

// fakeTokens stands in for the TokenReview the server's IdentifyAgent
// makes: each token names a pod on a node (or no node: an unbound token).
type fakeTokens struct {
	mu      sync.Mutex
	tokens  map[string]fakeToken
	reviews atomic.Int64
	// unsure answers every review as kube-apiserver answers one whose
	// lookup failed: refused, with an error of its own (ErrReviewUnsure).
	unsure atomic.Bool
}

type fakeToken struct {
	node, podUID, pod string
	expires           time.Time // its exp claim; zero: none
}

func newFakeTokens() *fakeTokens { return &fakeTokens{tokens: map[string]fakeToken{}} }

func (f *fakeTokens) add(token, node, podUID string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.tokens[token] = fakeToken{node: node, podUID: podUID}
}

// addPod is add for a token that also names its pod, as Kubernetes 1.30's
// pod-bound tokens do.
func (f *fakeTokens) addPod(token, node, pod, podUID string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.tokens[token] = fakeToken{node: node, podUID: podUID, pod: pod}
}

// addExpiring is add for a token whose exp claim is expires.
func (f *fakeTokens) addExpiring(token, node, podUID string, expires time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.tokens[token] = fakeToken{node: node, podUID: podUID, expires: expires}
}

func (f *fakeTokens) revoke(token string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.tokens, token)
}

// identify is a Config.IdentifyAgent that maps tokens the way
// server_cmd maps a TokenReview's answer.
func (f *fakeTokens) identify(ctx context.Context, c AgentCredentials) (Principal, error) {
	if c.Token == "" && len(c.TLS.VerifiedChains) > 0 {
		return CertificatePrincipal(c.TLS.VerifiedChains[0][0]), nil
	}
	f.reviews.Add(1)
	if f.unsure.Load() {
		return Principal{}, fmt.Errorf("%w (%w)", &wire.StatusError{Code: http.StatusUnauthorized, Msg: "token rejected: etcdserver: request timed out"}, ErrReviewUnsure)
	}
	f.mu.Lock()
	tk, ok := f.tokens[c.Token]
	f.mu.Unlock()
	if !ok {
		return Principal{}, &wire.StatusError{Code: http.StatusUnauthorized, Msg: "token not authenticated"}
	}
	p := Principal{Kind: PrincipalToken, Node: tk.node, Pod: tk.pod, Account: "kube-system/konnectivity-agent", Credential: "sa:kube-system/konnectivity-agent", Expires: tk.expires}
	if tk.podUID != "" {
		p.Credential = "pod:" + tk.podUID
	}
	return p, nil
}

// tokenEnv is a server that admits agents by token only, binds them with
// f, and knows node-a's address is 127.0.0.1. The apiserver forbids it to
// read node-f; node-down cannot be read for now.
func tokenEnv(t *testing.T, f *fakeTokens, log *lockedBuf, mutate func(*Config)) *env {
	return newEnv(t, func(c *Config) {
		c.AgentTLS.ClientAuth = tls.VerifyClientCertIfGiven
		c.IdentifyAgent = f.identify
		c.Identity.NodeAddresses = func(ctx context.Context, node string) ([]netip.Addr, error) {
			switch node {
			case "node-a":
				return []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("::1")}, nil
			case "node-f":
				return nil, fmt.Errorf("%w: nodes \"node-f\" is forbidden", ErrNodesForbidden)
			case "node-down":
				return nil, &wire.StatusError{Code: http.StatusServiceUnavailable, Msg: "apiserver unreachable"}
			}
			return nil, &wire.StatusError{Code: http.StatusForbidden, Msg: fmt.Sprintf("node %q does not exist", node)}
		}
		if log != nil {
			c.Logger = logTo(log)
		}
		if mutate != nil {
			mutate(c)
		}
	})
}

// rawLogin speaks one handshake by hand and returns the refusal (nil: 101).
func rawLogin(t *testing.T, e *env, id, identifiers, token string, cert bool) error {
	t.Helper()
	cfg := &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1"}
	if cert {
		cfg.Certificates = []tls.Certificate{e.PKI.AgentCert}
	}
	c, err := tls.Dial("tcp", e.AgentAddr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := wire.WriteHello(c, "127.0.0.1", wire.AgentHello{ID: id, Identifiers: identifiers, Token: token}); err != nil {
		t.Fatal(err)
	}
	_, err = wire.ReadReply(bufio.NewReader(c))
	return err
}

// An agent holding node-a's token may call itself node-a and claim
// node-a's names and addresses, nothing else.
func TestIdentityBindsTokenToNode(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	f := newFakeTokens()
	f.add("tok-a", "node-a", "uid-a")
	f.addPod("tok-a-pod", "node-a", "konnectivity-agent-x7k2p", "uid-a-pod")
	f.addPod("tok-down", "node-down", "konnectivity-agent-d", "uid-d")
	f.add("tok-unbound", "", "")
	var log lockedBuf
	e := tokenEnv(t, f, &log, nil)

	cases := []struct {
		name, id, ids, token string
		reason               string // "" admitted
	}{
		{"own node", "node-a", "host=node-a&ipv4=127.0.0.1&ipv6=::1", "tok-a", ""},
		{"other ID: admitted as its node", "node-b", "", "tok-a", ""},
		{"pod-bound token, the pod's name as ID", "konnectivity-agent-x7k2p", "host=node-a&ipv4=127.0.0.1", "tok-a-pod", ""},
		{"pod-bound token, the pod's name in capitals", "Konnectivity-Agent-X7K2P", "", "tok-a-pod", ""},
		{"pod-bound token, the node's name as ID", "node-a", "", "tok-a-pod", ""},
		{"pod-bound token, another pod's name: admitted as its pod", "konnectivity-agent-zzzzz", "", "tok-a-pod", ""},
		{"pod-bound token, its pod's name as host=", "konnectivity-agent-x7k2p", "host=konnectivity-agent-x7k2p", "tok-a-pod", identityNodeMismatch},
		{"pod-bound token, address not the node's", "konnectivity-agent-x7k2p", "ipv4=127.0.0.2", "tok-a-pod", identityAddressUnbacked},
		{"other host", "node-a", "host=node-b", "tok-a", identityNodeMismatch},
		{"two hosts", "node-a", "host=node-a&host=node-b", "tok-a", identityNodeMismatch},
		{"address not the node's", "node-a", "ipv4=127.0.0.2", "tok-a", identityAddressUnbacked},
		{"mapped address of the node", "node-a", "ipv6=::ffff:127.0.0.1", "tok-a", ""},
		{"mapped address not the node's", "node-a", "ipv6=::ffff:127.0.0.9", "tok-a", identityAddressUnbacked},
		{"cidr", "node-a", "cidr=0.0.0.0/0", "tok-a", identityRouteUntrusted},
		{"default route", "node-a", "default-route=true", "tok-a", identityRouteUntrusted},
		{"unbound token: no binding", "anything", "host=node-b&ipv4=10.1.2.3", "tok-unbound", ""},
		{"unbound token still needs trust for routes", "anything", "cidr=10.0.0.0/8", "tok-unbound", identityRouteUntrusted},
	}
	for _, tc := range cases {
		before := uint64(0)
		if tc.reason != "" {
			before = refusals(e, tc.reason)
		}
		err := rawLogin(t, e, tc.id, tc.ids, tc.token, false)
		if tc.reason == "" {
			if err != nil {
				t.Errorf("%s: refused: %v", tc.name, err)
			}
			continue
		}
		if wire.StatusCode(err) != http.StatusForbidden {
			t.Errorf("%s: want 403, got %v", tc.name, err)
			continue
		}
		if got := refusals(e, tc.reason) - before; got != 1 {
			t.Errorf("%s: %s counted %d times, want 1 (err %v)", tc.name, tc.reason, got, err)
		}
		t.Logf("%s: %v", tc.name, err)
	}
	out := log.String()
	if n := strings.Count(out, "agent identity binding is off"); n != 1 {
		t.Errorf("the unbound-token notice was logged %d times, want once:\n%s", n, out)
	}
	if !strings.Contains(out, `identifier host=konnectivity-agent-x7k2p is not the node \"node-a\" the agent's token was issued for`) {
		t.Errorf("the refusal reason is not in the log:\n%s", out)
	}
	// Refusals from one source are limited per reason, not per source:
	// each different reason is logged, as a warning.
	for _, reason := range []string{"is not the node", "is not an address of node", "accepted only from agents listed in --route-agents"} {
		found := false
		for _, l := range strings.Split(out, "\n") {
			found = found || strings.Contains(l, "agent refused") && strings.Contains(l, reason) && strings.Contains(l, "level=WARN")
		}
		if !found {
			t.Errorf("no WARN line for the refusal %q from the same source:\n%s", reason, out)
		}
	}
	// A Node lookup that failed (apiserver unreachable, 5xx) is a 503: the
	// agent retries, nothing is counted as a refusal.
	if err := rawLogin(t, e, "node-down", "ipv4=127.0.0.1", "tok-down", false); wire.StatusCode(err) != http.StatusServiceUnavailable {
		t.Errorf("node lookup down: want 503, got %v", err)
	}
	if n := refusals(e, identityAddressUnverified); n != 0 {
		t.Errorf("address_unverifiable counted %d times with a working or failing lookup, want 0", n)
	}

	// Relaxed, node-a's token may claim node-b again (the old behaviour).
	relaxed := tokenEnv(t, f, nil, func(c *Config) { c.Identity.IgnoreNodeClaims = true })
	if err := rawLogin(t, relaxed, "node-b", "host=node-b&ipv4=10.0.0.12", "tok-a", false); err != nil {
		t.Errorf("IgnoreNodeClaims: %v", err)
	}
	// Trusted for routes by agent ID or by ServiceAccount.
	for _, trust := range []string{"node-a", "serviceaccount:kube-system/konnectivity-agent", "*"} {
		e := tokenEnv(t, f, nil, func(c *Config) { c.Identity.RouteAgents = []string{trust} })
		if err := rawLogin(t, e, "node-a", "cidr=10.0.0.0/8&default-route=true", "tok-a", false); err != nil {
			t.Errorf("route agents %q: %v", trust, err)
		}
	}
	// Without a node lookup, addresses cannot be backed: the agent is
	// admitted without them (TestIdentityUnverifiableAddresses).
	var noLookupLog lockedBuf
	noLookup := tokenEnv(t, f, &noLookupLog, func(c *Config) { c.Identity.NodeAddresses = nil })
	if err := rawLogin(t, noLookup, "node-a", "ipv4=127.0.0.1", "tok-a", false); err != nil {
		t.Errorf("no node lookup: refused: %v", err)
	}
	if n := refusals(noLookup, identityAddressUnverified); n != 1 {
		t.Errorf("no node lookup: address_unverifiable counted %d times, want 1", n)
	}
	if !strings.Contains(noLookupLog.String(), "this server has no Node lookup") {
		t.Errorf("no node lookup: no warning:\n%s", noLookupLog.String())
	}
}

// A server the apiserver forbids to read Nodes (upstream's RBAC grants
// none) admits a node-bound agent without its ipv4=/ipv6= identifiers, on
// both agent protocols: no dial is routed to it by those addresses, the
// metric counts each agent, and one warning per server names the fix.
// Its host= (checked against the token) still routes.
func TestIdentityUnverifiableAddresses(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	f := newFakeTokens()
	f.addPod("tok-f1", "node-f", "konnectivity-agent-f1", "uid-f1")
	f.addPod("tok-f2", "node-f", "konnectivity-agent-f2", "uid-f2")
	var log lockedBuf
	e := tokenEnv(t, f, &log, nil)
	noCert := func(name string) (*tls.Config, error) { return &tls.Config{RootCAs: e.PKI.Pool, ServerName: name}, nil }

	// Ours: upstream's DaemonSet passes no --agent-id, so the ID is the pod's name.
	e.startAgent("konnectivity-agent-f1", "host=node-f&ipv4=127.0.0.1&ipv6=::1", func(c *agent.Config) {
		c.TLS = noCert
		c.Token = func() (string, error) { return "tok-f1", nil }
	})
	// Upstream's (gRPC), the same.
	resp, end := upstreamLogin(t, e, "konnectivity-agent-f2", "ipv4=127.0.0.1", "tok-f2")
	defer end()
	if resp.StatusCode != 200 || resp.Header.Get("grpc-status") != "" {
		t.Fatalf("upstream agent: %s %v", resp.Status, resp.Header)
	}
	e.WaitAgents(2)
	for _, id := range []string{"konnectivity-agent-f1", "konnectivity-agent-f2"} {
		a := findAgent(e, id)
		if len(a.ids.Addrs) != 0 {
			t.Errorf("%s: registered with addresses %v, want none", id, a.ids.Addrs)
		}
		if len(a.ids.Ignored) == 0 || !strings.Contains(a.ids.Ignored[0], "cannot be verified") {
			t.Errorf("%s: ignored identifiers %q", id, a.ids.Ignored)
		}
	}
	all := int64(1 << 30)
	for _, host := range []string{"127.0.0.1", "::1"} {
		if a, _ := e.srv.agents.pick(dest{host: host}, []Strategy{StrategyDestHost}, all, nil); a != nil {
			t.Errorf("a dial to %s is routed to %s by a dropped address", host, a.id)
		}
	}
	if a, _ := e.srv.agents.pick(dest{host: "node-f"}, []Strategy{StrategyDestHost}, all, nil); a == nil || a.id != "konnectivity-agent-f1" {
		t.Errorf("host=node-f does not route to its agent: %v", a)
	}
	if n := refusals(e, identityAddressUnverified); n != 2 {
		t.Errorf("address_unverifiable counted %d times, want 2 (one per agent)", n)
	}
	out := log.String()
	if n := strings.Count(out, "grant get on nodes to the server's kubeconfig identity"); n != 1 {
		t.Errorf("the warning naming the fix was logged %d times, want once:\n%s", n, out)
	}
	// Our agent serves dials (by the default strategy; the upstream
	// login above is a bare stream that serves none, so it leaves first).
	end()
	e.WaitAgents(1)
	if err := e.EchoOnce(tunneltest.EchoServer(t)); err != nil {
		t.Fatalf("dial: %v", err)
	}
}

// With CertificateNames an agent's ID and host= must be names in its
// certificate (the test certificate's CN is "agent", with no IP SAN).
func TestIdentityBindsCertificate(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	f := newFakeTokens()
	e := tokenEnv(t, f, nil, func(c *Config) { c.Identity.CertificateNames = true })
	if err := rawLogin(t, e, "agent", "host=agent", "", true); err != nil {
		t.Errorf("own name: %v", err)
	}
	for _, tc := range []struct{ id, ids, reason string }{
		{"node-b", "", identityCertMismatch},
		{"agent", "host=node-b", identityCertMismatch},
		{"agent", "ipv4=127.0.0.1", identityAddressUnbacked},
	} {
		err := rawLogin(t, e, tc.id, tc.ids, "", true)
		if wire.StatusCode(err) != http.StatusForbidden || !strings.Contains(err.Error(), "certificate") {
			t.Errorf("%s %s: want 403 naming the certificate, got %v", tc.id, tc.ids, err)
		}
	}
	if refusals(e, identityCertMismatch) != 2 || refusals(e, identityAddressUnbacked) != 1 {
		t.Errorf("refusals counted: %d mismatch, %d address", refusals(e, identityCertMismatch), refusals(e, identityAddressUnbacked))
	}
	// Off, the certificate does not bind the ID (the old behaviour).
	off := tokenEnv(t, f, nil, nil)
	if err := rawLogin(t, off, "node-b", "host=node-b", "", true); err != nil {
		t.Errorf("CertificateNames off: %v", err)
	}
}

// A login under a connected ID with another credential is refused and the
// connected agent keeps its link; the same credential replaces it as
// before (an agent coming back over a half-dead connection).
func TestIdentityDuplicateLogin(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	f := newFakeTokens()
	f.add("tok-a", "node-a", "uid-a")
	f.add("tok-a-other-pod", "node-a", "uid-a2")
	f.add("tok-a-same-pod", "node-a", "uid-a")
	e := tokenEnv(t, f, nil, nil)
	a := e.startAgent("node-a", "host=node-a", func(c *agent.Config) {
		c.TLS = func(name string) (*tls.Config, error) { return &tls.Config{RootCAs: e.PKI.Pool, ServerName: name}, nil }
		c.Token = func() (string, error) { return "tok-a", nil }
	})
	e.WaitAgents(1)
	first := e.srv.agents.snapshot()[0]

	err := rawLogin(t, e, "node-a", "host=node-a", "tok-a-other-pod", false)
	if wire.StatusCode(err) != http.StatusForbidden || refusals(e, identityInUse) != 1 {
		t.Fatalf("another pod's token for a connected ID: want 403 id_in_use, got %v (%d counted)", err, refusals(e, identityInUse))
	}
	if got := e.srv.agents.snapshot(); len(got) != 1 || got[0] != first || first.draining.Load() {
		t.Fatal("the connected agent was replaced or drained by a refused login")
	}
	if n := a.Status().Connected; n != 1 {
		t.Fatalf("agent holds %d connections", n)
	}
	if err := e.EchoOnce(tunneltest.EchoServer(t)); err != nil {
		t.Fatalf("dial through the connected agent: %v", err)
	}
	// The same pod's credential comes back: it replaces the old link. The
	// connection stays open so the server gets as far as registering it.
	c, err := tls.Dial("tcp", e.AgentAddr, &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	wire.WriteHello(c, "127.0.0.1", wire.AgentHello{ID: "node-a", Identifiers: "host=node-a", Token: "tok-a-same-pod"})
	if _, err := wire.ReadReply(bufio.NewReader(c)); err != nil {
		t.Fatalf("same pod: %v", err)
	}
	// The server registers the new link just after its 101.
	deadline := time.Now().Add(5 * time.Second)
	for !first.draining.Load() {
		if time.Now().After(deadline) {
			t.Fatal("the same credential did not replace the old link")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A link whose token stops being valid is closed within the recheck
// interval; an agent whose token file rotates keeps its link (it presents
// the new token on its control stream), and keeps serving.
func TestIdentityTokenRecheck(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	f := newFakeTokens()
	f.add("tok-a", "node-a", "uid-a")
	f.add("tok-b1", "node-b", "uid-b")
	var log lockedBuf
	const recheck = 200 * time.Millisecond
	e := tokenEnv(t, f, &log, func(c *Config) { c.Identity.Recheck = recheck })
	noCert := func(name string) (*tls.Config, error) { return &tls.Config{RootCAs: e.PKI.Pool, ServerName: name}, nil }

	var tokenA atomic.Value
	tokenA.Store("tok-a")
	e.startAgent("node-a", "host=node-a", func(c *agent.Config) {
		c.TLS = noCert
		c.Token = func() (string, error) { return tokenA.Load().(string), nil }
		c.SyncCap = time.Hour // a refused agent stays out for the test
		c.SyncInterval = time.Hour
	})
	var tokenB atomic.Value
	tokenB.Store("tok-b1")
	e.startAgent("node-b", "host=node-b", func(c *agent.Config) {
		c.TLS = noCert
		c.Token = func() (string, error) { return tokenB.Load().(string), nil }
		c.TokenRefresh = 20 * time.Millisecond
	})
	e.WaitAgents(2)
	linkB := findAgent(e, "node-b")

	// node-b's token rotates and the old one is revoked; node-a's is revoked.
	f.add("tok-b2", "node-b", "uid-b")
	tokenB.Store("tok-b2")
	deadline := time.Now().Add(5 * time.Second)
	for linkB.cred.currentToken() != "tok-b2" {
		if time.Now().After(deadline) {
			t.Fatal("the server never took node-b's rotated token")
		}
		time.Sleep(5 * time.Millisecond)
	}
	f.revoke("tok-b1")
	revoked := time.Now()
	f.revoke("tok-a")
	e.WaitAgents(1)
	took := time.Since(revoked)
	if took > 2*recheck+revokeGrace {
		t.Errorf("revoked link closed after %s, recheck interval %s", took, recheck)
	}
	if refusals(e, identityTokenInvalid) != 1 {
		t.Errorf("token_invalid counted %d times", refusals(e, identityTokenInvalid))
	}
	if !strings.Contains(log.String(), "agent token no longer valid") {
		t.Errorf("no log line for the revoked link:\n%s", log.String())
	}
	// node-b kept the link it had through several rechecks, and serves.
	reviewed := f.reviews.Load()
	tunneltest.WaitUntil(t, func() bool { return f.reviews.Load() >= reviewed+3 }, "three more rechecks of node-b's token")
	if got := findAgent(e, "node-b"); got != linkB || linkB.draining.Load() {
		t.Fatal("node-b's link was replaced or drained by its token's rotation")
	}
	if err := e.EchoOnce(tunneltest.EchoServer(t)); err != nil {
		t.Fatalf("dial through node-b: %v", err)
	}
	t.Logf("revoked link closed %s after the revocation (recheck %s); rotated link kept, %d reviews", took.Round(time.Millisecond), recheck, f.reviews.Load())
}

func findAgent(e *env, id string) *agentConn {
	for _, a := range e.srv.agents.snapshot() {
		if a.id == id {
			return a
		}
	}
	return nil
}

// TestControlLines: lines of the control stream are whole however the
// stream splits them, a line may be as long as wire.MaxControlLine and no
// longer, and nothing is buffered between lines.
func TestControlLines(t *testing.T) {
	stream := "drain\ntoken " + strings.Repeat("x", 1000) + "\n" + strings.Repeat("y", wire.MaxControlLine-1) + "\n"
	for _, chunk := range []int{1, 7, 512, len(stream)} {
		w := &controlWatch{}
		var got []string
		for p := stream; p != ""; {
			n := min(chunk, len(p))
			if err := w.take([]byte(p[:n]), func(l string) { got = append(got, l) }); err != nil {
				t.Fatalf("chunks of %d: %v", chunk, err)
			}
			p = p[n:]
		}
		if len(got) != 3 || got[0] != "drain" || len(got[1]) != 1006 || len(got[2]) != wire.MaxControlLine-1 {
			t.Fatalf("chunks of %d: %d lines (%.20q…)", chunk, len(got), got)
		}
		if w.line != nil {
			t.Fatalf("chunks of %d: %d bytes held after the last line", chunk, cap(w.line))
		}
	}
	w := &controlWatch{}
	long := []byte(strings.Repeat("z", 600))
	var err error
	for i := 0; err == nil && i < 2*wire.MaxControlLine/len(long); i++ {
		err = w.take(long, func(string) { t.Fatal("an over-long line was passed on") })
	}
	if err == nil {
		t.Fatal("an over-long line was read")
	}
}

func logTo(b *lockedBuf) *slog.Logger {
	return slog.New(slog.NewTextHandler(b, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// upstreamLogin opens an upstream agent's Connect stream with a bearer
// token and no client certificate; it returns the response (grpc-status
// in its header when refused) and a func that ends the connection.
func upstreamLogin(t *testing.T, e *env, id, identifiers, token string) (*http.Response, func()) {
	t.Helper()
	tc, err := tls.Dial("tcp", e.AgentAddr, &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1", NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatal(err)
	}
	cc, err := (&http2.Transport{}).NewClientConn(tc)
	if err != nil {
		t.Fatal(err)
	}
	pr, pw := io.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://server"+agentConnectMethod, pr)
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("agentid", id)
	req.Header.Set("agentidentifiers", identifiers)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := cc.RoundTrip(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	return resp, func() { cancel(); pw.Close(); resp.Body.Close(); cc.Close() }
}

// Upstream's agent, as its DaemonSet runs it, names itself with a random
// UUID: with a pod-bound token it is admitted under its pod's name, routed
// as the token's node, the UUID kept as a label in the status and the log.
func TestIdentityForeignIDAdmittedAsPod(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	f := newFakeTokens()
	f.addPod("tok-a-pod", "node-a", "konnectivity-agent-x7k2p", "uid-a-pod")
	var log lockedBuf
	e := tokenEnv(t, f, &log, nil)
	const uuid = "7d3f1c2e-9b4a-4e7f-8c21-5a6b7c8d9e0f"
	resp, end := upstreamLogin(t, e, uuid, "", "tok-a-pod")
	defer end()
	if resp.StatusCode != 200 || resp.Header.Get("grpc-status") != "" {
		t.Fatalf("upstream agent with a UUID ID: %s %v", resp.Status, resp.Header)
	}
	// The answer's head goes out before the agent is registered, and the
	// login's log line after.
	const line = "agent=konnectivity-agent-x7k2p claimed_id=" + uuid
	st := e.srv.Status()
	for deadline := time.Now().Add(5 * time.Second); (len(st.Agents) == 0 || !strings.Contains(log.String(), line)) && time.Now().Before(deadline); st = e.srv.Status() {
		time.Sleep(10 * time.Millisecond)
	}
	if len(st.Agents) != 1 {
		t.Fatalf("agents %+v, want one", st.Agents)
	}
	if a := st.Agents[0]; a.ID != "konnectivity-agent-x7k2p" || a.ClaimedID != uuid || a.Node != "node-a" {
		t.Errorf("registered as %+v; want ID konnectivity-agent-x7k2p, ClaimedID %s, node node-a", a, uuid)
	}
	if out := log.String(); !strings.Contains(out, line) {
		t.Errorf("the login's log line does not name the pod and the claimed ID:\n%s", out)
	}
	if n := refusals(e, identityNodeMismatch); n != 0 {
		t.Errorf("node_mismatch counted %d times, want 0", n)
	}
}

// Upstream (gRPC) agents are bound and re-checked the same way.
func TestIdentityUpstreamAgent(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	f := newFakeTokens()
	f.add("tok-a", "node-a", "uid-a")
	e := tokenEnv(t, f, nil, func(c *Config) { c.Identity.Recheck = 100 * time.Millisecond })

	resp, end := upstreamLogin(t, e, "node-b", "host=node-b", "tok-a")
	end()
	if got := resp.Header.Get("grpc-status"); got != "7" || !strings.Contains(resp.Header.Get("grpc-message"), "node") {
		t.Errorf("node-a's token as node-b: grpc-status %q message %q, want 7 (PERMISSION_DENIED)", got, resp.Header.Get("grpc-message"))
	}
	if refusals(e, identityNodeMismatch) != 1 {
		t.Errorf("node_mismatch counted %d times", refusals(e, identityNodeMismatch))
	}

	resp, end = upstreamLogin(t, e, "node-a", "host=node-a&ipv4=127.0.0.1", "tok-a")
	defer end()
	if resp.StatusCode != 200 || resp.Header.Get("grpc-status") != "" {
		t.Fatalf("node-a: %s %v", resp.Status, resp.Header)
	}
	e.WaitAgents(1)
	f.revoke("tok-a")
	start := time.Now()
	e.WaitAgents(0)
	if refusals(e, identityTokenInvalid) != 1 {
		t.Errorf("token_invalid counted %d times", refusals(e, identityTokenInvalid))
	}
	t.Logf("upstream agent's link closed %s after its token was revoked (recheck 100ms)", time.Since(start).Round(time.Millisecond))
}

// refusals is the server's count of identity refusals for reason.
func refusals(e *env, reason string) uint64 { return e.srv.identity.refused[reason].Value() }

// Reviews refused with an apiserver error (kube-apiserver's answer when a
// lookup behind the review failed) for many recheck intervals stop new
// dials to the agent and keep its link and open tunnel; a review that
// passes gives it dials again.
func TestIdentityTokenDoubtNotActedOnAlone(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	f := newFakeTokens()
	f.add("tok-a", "node-a", "uid-a")
	var log lockedBuf
	const recheck = 100 * time.Millisecond
	e := tokenEnv(t, f, &log, func(c *Config) { c.Identity.Recheck = recheck; c.AgentWait = 50 * time.Millisecond })
	noCert := func(name string) (*tls.Config, error) { return &tls.Config{RootCAs: e.PKI.Pool, ServerName: name}, nil }
	e.startAgent("node-a", "host=node-a", func(c *agent.Config) {
		c.TLS = noCert
		c.Token = func() (string, error) { return "tok-a", nil }
	})
	e.WaitAgents(1)
	link := findAgent(e, "node-a")
	echo := tunneltest.EchoServer(t)
	open := e.EchoOne(echo)
	defer open.Close()

	// Five reviews in a row answer unsure: more than two recheck intervals.
	f.unsure.Store(true)
	tunneltest.WaitUntil(t, link.doubted.Load, "the unsure review marks the agent doubted")
	reviewed := f.reviews.Load()
	tunneltest.WaitUntil(t, func() bool { return f.reviews.Load() >= reviewed+5 }, "five more unsure reviews")
	if err := e.EchoOnce(echo); err == nil {
		t.Fatal("a dial went to an agent whose token's last review was refused")
	}
	if _, err := open.Write([]byte("x")); err != nil {
		t.Fatalf("the open tunnel was cut by unsure reviews: %v", err)
	}
	buf := make([]byte, 1)
	open.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(open, buf); err != nil {
		t.Fatalf("the open tunnel was cut by unsure reviews: %v", err)
	}
	// The next review passes: dials again, same link.
	f.unsure.Store(false)
	tunneltest.WaitUntil(t, func() bool { return !link.doubted.Load() }, "a passing review trusts the agent again")
	if got := findAgent(e, "node-a"); got != link {
		t.Fatal("the link was replaced")
	}
	if err := e.EchoOnce(echo); err != nil {
		t.Fatalf("dial after the review passed again: %v", err)
	}
	if n := refusals(e, identityTokenInvalid); n != 0 {
		t.Errorf("token_invalid counted %d times", n)
	}
	if n := refusals(e, identityTokenDoubted); n != 1 {
		t.Errorf("token_doubted counted %d times, want 1", n)
	}
}

// Unsure refusals that go on close the link once they have lasted the
// doubt grace, counted from the first, not after a count of reviews.
func TestIdentityTokenDoubtGrace(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	f := newFakeTokens()
	f.add("tok-a", "node-a", "uid-a")
	var log lockedBuf
	// Reviews of a link are at least minTokenRefresh apart: two in a row
	// come well before the grace.
	const recheck, grace = 100 * time.Millisecond, 2500 * time.Millisecond
	e := tokenEnv(t, f, &log, func(c *Config) { c.Identity.Recheck = recheck; c.Identity.DoubtGrace = grace })
	e.startAgent("node-a", "host=node-a", func(c *agent.Config) {
		c.TLS = func(name string) (*tls.Config, error) { return &tls.Config{RootCAs: e.PKI.Pool, ServerName: name}, nil }
		c.Token = func() (string, error) { return "tok-a", nil }
		c.SyncCap = time.Hour // a refused agent stays out for the test
		c.SyncInterval = time.Hour
	})
	e.WaitAgents(1)
	link := findAgent(e, "node-a")
	f.unsure.Store(true)
	tunneltest.WaitUntil(t, link.doubted.Load, "the unsure review marks the agent doubted")
	link.cred.mu.Lock()
	since := link.cred.doubted
	link.cred.mu.Unlock()
	e.WaitAgents(0)
	took := time.Since(since)
	if took < grace {
		t.Errorf("the link closed %s after the first unsure review, before the %s grace", took, grace)
	}
	if took > grace+minTokenRefresh+2*time.Second {
		t.Errorf("the link closed %s after the first unsure review, grace %s", took, grace)
	}
	if n := refusals(e, identityTokenInvalid); n != 1 {
		t.Errorf("token_invalid counted %d times, want 1", n)
	}
	if !strings.Contains(log.String(), "doubted_for=") {
		t.Errorf("the closing line does not say how long the token was doubted:\n%s", log.String())
	}
	t.Logf("closed %s after the first unsure review (grace %s, recheck %s, %d reviews)", took.Round(time.Millisecond), grace, recheck, f.reviews.Load())
}

// A refusal without an apiserver error, even within a doubt's grace, and
// an unsure refusal once the token's exp has passed close the link at
// once, long before the grace.
func TestIdentityTokenRefusalActsAtOnce(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	f := newFakeTokens()
	f.add("tok-a", "node-a", "uid-a")
	var log lockedBuf
	const recheck = 100 * time.Millisecond
	e := tokenEnv(t, f, &log, func(c *Config) { c.Identity.Recheck = recheck; c.Identity.DoubtGrace = time.Hour })
	start := func(id, token string) {
		e.startAgent(id, "host="+id, func(c *agent.Config) {
			c.TLS = func(name string) (*tls.Config, error) { return &tls.Config{RootCAs: e.PKI.Pool, ServerName: name}, nil }
			c.Token = func() (string, error) { return token, nil }
			c.SyncCap = time.Hour
			c.SyncInterval = time.Hour
		})
	}
	start("node-a", "tok-a")
	e.WaitAgents(1)

	// Refused plainly: the first such review closes the link.
	reviewed := f.reviews.Load()
	f.revoke("tok-a")
	e.WaitAgents(0)
	if n := f.reviews.Load() - reviewed; n != 1 {
		t.Errorf("the link closed after %d plain refusals, want 1", n)
	}

	// Doubted, then refused plainly: closed at once.
	f.add("tok-c", "node-c", "uid-c")
	start("node-c", "tok-c")
	e.WaitAgents(1)
	link := findAgent(e, "node-c")
	f.unsure.Store(true)
	tunneltest.WaitUntil(t, link.doubted.Load, "the unsure review marks the agent doubted")
	f.revoke("tok-c")
	f.unsure.Store(false)
	e.WaitAgents(0)
	if n := refusals(e, identityTokenInvalid); n != 2 {
		t.Errorf("token_invalid counted %d times, want 2", n)
	}

	// A token past its exp: the unsure refusal that follows closes it.
	exp := time.Now().Add(1500 * time.Millisecond)
	f.addExpiring("tok-b", "node-b", "uid-b", exp)
	start("node-b", "tok-b")
	e.WaitAgents(1)
	f.unsure.Store(true)
	e.WaitAgents(0)
	if time.Now().Before(exp) {
		t.Error("closed before its token's exp, within the doubt grace")
	}
	if n := refusals(e, identityTokenInvalid); n != 3 {
		t.Errorf("token_invalid counted %d times, want 3", n)
	}
	t.Logf("expired token's link closed %s after its exp", time.Since(exp).Round(time.Millisecond))
}
