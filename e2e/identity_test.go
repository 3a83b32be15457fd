package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// boundAPIServer answers TokenReviews the way kube-apiserver 1.30+ does
// for bound ServiceAccount tokens: the pod and node a token was issued
// for are in status.user.extra. It serves Node objects too, and tokens
// can be revoked.
type boundAPIServer struct {
	*fakeAPIServer
	mu     sync.Mutex
	tokens map[string]boundToken // guarded by mu
	nodes  map[string][]string   // node name -> addresses; guarded by mu
	// forbidNodes answers 403 to every Node read, as kube-apiserver does
	// for an identity without get on nodes (upstream's RBAC).
	forbidNodes atomic.Bool
	nodeGets    atomic.Int64
}

type boundToken struct{ node, pod, uid string }

func startBoundAPIServer(t *testing.T, p *pki) *boundAPIServer {
	t.Helper()
	b := &boundAPIServer{fakeAPIServer: &fakeAPIServer{}, tokens: map[string]boundToken{}, nodes: map[string][]string{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /apis/authentication.k8s.io/v1/tokenreviews", func(w http.ResponseWriter, r *http.Request) {
		if r.TLS == nil || len(r.TLS.VerifiedChains) == 0 {
			b.noCert.Add(1)
			http.Error(w, `{"kind":"Status","code":401}`, http.StatusUnauthorized)
			return
		}
		var req struct {
			Kind string `json:"kind"`
			Spec struct {
				Token     string   `json:"token"`
				Audiences []string `json:"audiences"`
			} `json:"spec"`
		}
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil || req.Kind != "TokenReview" {
			http.Error(w, "bad TokenReview", http.StatusBadRequest)
			return
		}
		b.reviews.Add(1)
		b.mu.Lock()
		tk, ok := b.tokens[req.Spec.Token]
		b.mu.Unlock()
		status := map[string]any{"authenticated": false, "user": map[string]any{}}
		if ok {
			status = map[string]any{
				"authenticated": true,
				"audiences":     []string{agentAudience},
				"user": map[string]any{
					"username": agentSAUser,
					"groups":   []string{"system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"},
					"extra": map[string][]string{
						"authentication.kubernetes.io/credential-id": {"JTI=" + tk.uid},
						"authentication.kubernetes.io/node-name":     {tk.node},
						"authentication.kubernetes.io/node-uid":      {"node-uid-" + tk.node},
						"authentication.kubernetes.io/pod-name":      {tk.pod},
						"authentication.kubernetes.io/pod-uid":       {tk.uid},
					},
				},
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]any{"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status})
	})
	mux.HandleFunc("GET /api/v1/nodes/{name}", func(w http.ResponseWriter, r *http.Request) {
		if r.TLS == nil || len(r.TLS.VerifiedChains) == 0 {
			http.Error(w, `{"kind":"Status","code":401}`, http.StatusUnauthorized)
			return
		}
		b.nodeGets.Add(1)
		w.Header().Set("Content-Type", "application/json")
		if b.forbidNodes.Load() {
			w.WriteHeader(http.StatusForbidden)
			_, _ = fmt.Fprintf(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","message":"nodes %q is forbidden: User \"system:serviceaccount:kube-system:konnectivity-server\" cannot get resource \"nodes\" in API group \"\" at the cluster scope","reason":"Forbidden","code":403}`, r.PathValue("name"))
			return
		}
		b.mu.Lock()
		addrs, ok := b.nodes[r.PathValue("name")]
		b.mu.Unlock()
		if !ok {
			w.WriteHeader(http.StatusNotFound)
			_, _ = io.WriteString(w, `{"kind":"Status","reason":"NotFound","code":404}`)
			return
		}
		var list []map[string]string
		for _, a := range addrs {
			list = append(list, map[string]string{"type": "InternalIP", "address": a})
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"apiVersion": "v1", "kind": "Node",
			"metadata": map[string]any{"name": r.PathValue("name")}, "status": map[string]any{"addresses": list}})
	})
	b.srv = httptest.NewUnstartedServer(mux)
	b.srv.TLS = newServerTLSRequiringClient(t, p)
	b.srv.StartTLS()
	t.Cleanup(b.srv.Close)
	return b
}

func (b *boundAPIServer) issue(token, node, pod, uid string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tokens[token] = boundToken{node, pod, uid}
}

func (b *boundAPIServer) revoke(token string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.tokens, token)
}

func (b *boundAPIServer) setNode(name string, addrs ...string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.nodes[name] = addrs
}

// TestIdentityBinding: with token auth and bound tokens, an agent holding
// node-a's token cannot claim node-b (refused, the reason logged and
// counted); a token revoked at the apiserver loses its link within the
// recheck interval while an agent whose token rotates keeps its link and
// serves; the revoked agent comes back once its file holds a fresh token.
func TestIdentityBinding(t *testing.T) {
	p := newPKI(t, t.TempDir())
	api := startBoundAPIServer(t, p)
	api.issue("tok-a1", "node-a", "konnectivity-agent-aaaaa", "uid-a")
	api.issue("tok-b1", "node-b", "konnectivity-agent-bbbbb", "uid-b")
	api.setNode("node-a", "127.0.0.1")
	api.setNode("node-b", "127.0.0.2")
	dir := t.TempDir()
	kc := filepath.Join(dir, "kubeconfig")
	api.writeKubeconfig(t, p, kc)
	const recheck = time.Second
	s := startServerOpts(t, serverOpts{pki: p, extra: append(tokenAuthFlags(kc),
		"--proxy-strategies=destHost,default",
		"--token-recheck-interval="+recheck.String(),
		"--token-review-cache-ttl=500ms",
		"--agent-wait=1s",
	)})
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	tokenAgent := func(id, identifiers, tokenFile string) *agent {
		return startTokenAgent(t, s, p, id, tokenFile, "--agent-identifiers="+identifiers, "--token-refresh-interval=100ms")
	}
	tokenA := filepath.Join(dir, "token-a")
	writeFileAtomic(t, tokenA, []byte("tok-a1\n"))
	tokenB := filepath.Join(dir, "token-b")
	writeFileAtomic(t, tokenB, []byte("tok-b1\n"))
	a := tokenAgent("node-a", "host=node-a&ipv4=127.0.0.1", tokenA)
	tokenAgent("node-b", "host=node-b&ipv4=127.0.0.2", tokenB)
	s.waitAgents(t, 2, startTimeout)
	waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusOK)
	metrics := s.healthURL("/metrics")
	const refusals = "konnectivity_network_proxy_server_agent_identity_refusals_total"

	// node-a's token, claiming node-b: refused with the reason.
	evilToken := filepath.Join(dir, "token-evil")
	writeFileAtomic(t, evilToken, []byte("tok-a1\n"))
	evil := tokenAgent("node-a", "host=node-b&ipv4=127.0.0.2", evilToken)
	waitFor(t, startTimeout, "server logs the refusal of node-a's token claiming node-b", func() bool {
		return strings.Contains(s.proc.out.String(), `identifier host=node-b is not the node \"node-a\"`)
	})
	t.Logf("refused: %s", lineWith(s.proc.out.String(), "identifier host=node-b"))
	if v := metricValue(t, metrics, refusals, "reason", "node_mismatch"); v < 1 {
		t.Errorf("%s{reason=node_mismatch} = %v, want at least 1", refusals, v)
	}
	if got := getStatus(t, evil.healthURL("/readyz")); got != http.StatusServiceUnavailable {
		t.Errorf("refused agent /readyz = %d, want 503", got)
	}
	evil.proc.stop(t)
	if n := s.agentCount(); n != 2 {
		t.Fatalf("server has %d agents after the refused login, want 2 (node-a's link kept)", n)
	}
	checkReachable(t, s.egressDialer(t), backend, "b1", 5)

	// node-a's token rotates (same pod) and the old one is revoked:
	// node-a keeps its link. node-b's token is revoked: its link closes.
	api.issue("tok-a2", "node-a", "konnectivity-agent-aaaaa", "uid-a")
	writeFileAtomic(t, tokenA, []byte("tok-a2\n"))
	time.Sleep(500 * time.Millisecond) // a few token refreshes (100ms) pass
	api.revoke("tok-a1")
	api.revoke("tok-b1")
	revoked := time.Now()
	s.waitAgents(t, 1, 2*recheck+10*time.Second)
	closed := time.Since(revoked)
	waitFor(t, 5*time.Second, "the revoked link's log line", func() bool {
		return strings.Contains(s.proc.out.String(), "agent token no longer valid")
	})
	line := lineWith(s.proc.out.String(), "agent token no longer valid")
	if !strings.Contains(line, "agent=node-b") {
		t.Fatalf("the link closed for its token was not node-b's: %s", line)
	}
	t.Logf("node-b's link closed %v after its token was revoked (recheck %v, cache 500ms): %s", closed.Round(time.Millisecond), recheck, line)
	if v := metricValue(t, metrics, refusals, "reason", "token_invalid"); v != 1 {
		t.Errorf("%s{reason=token_invalid} = %v, want 1", refusals, v)
	}
	// Several rechecks later node-a still holds the link it had.
	time.Sleep(3 * recheck)
	for line := range strings.Lines(s.proc.out.String()) {
		if strings.Contains(line, "agent disconnected") && strings.Contains(line, "agent=node-a ") {
			t.Fatalf("node-a's link dropped across its token's rotation: %s", line)
		}
	}
	if n := s.agentCount(); n != 1 {
		t.Fatalf("server has %d agents, want node-a only", n)
	}
	checkReachable(t, s.egressDialer(t), backend, "b1", 10)

	// node-b gets a fresh token: it is admitted again.
	api.issue("tok-b2", "node-b", "konnectivity-agent-bbbbb", "uid-b")
	writeFileAtomic(t, tokenB, []byte("tok-b2\n"))
	back := s.waitAgents(t, 2, startTimeout)
	t.Logf("node-b back %v after its token file was rewritten", back.Round(time.Millisecond))
	if n := api.noCert.Load(); n > 0 {
		t.Errorf("%d apiserver requests came without the kubeconfig's client certificate", n)
	}
}
