package auth

import (
	"errors"
	"net/http"
	"net/netip"
	"slices"
	"testing"
	"time"
)

func TestReviewBoundIdentity(t *testing.T) {
	clock := &fakeClock{now: time.Now()}
	f, r := newReviewSetup(t, ReviewOptions{Now: clock.Now, CacheTTL: 10 * time.Second})
	exp := time.Now().Add(time.Hour).Unix()
	bound := makeJWT("bound", exp)
	f.addBoundToken(bound, "node-a", "konnectivity-agent-x1", "uid-1")
	plain := makeJWT("plain", exp)
	f.addToken(plain, identity{agentUser, []string{testAudience}})
	odd := makeJWT("odd", 0)
	f.addToken(odd, identity{agentUser, []string{testAudience}})
	f.mu.Lock()
	f.extras[odd] = map[string][]string{
		ExtraNodeName: {"node-a", "node-b"}, // two values: no claim
		ExtraPodName:  {"pod name"},         // not a name
		ExtraPodUID:   {""},
	}
	f.mu.Unlock()

	id, err := r.Review(testCtx(t), bound)
	if err != nil {
		t.Fatal(err)
	}
	want := Identity{Username: agentUser, Node: "node-a", Pod: "konnectivity-agent-x1", PodUID: "uid-1", Expires: time.Unix(exp, 0)}
	if id != want {
		t.Errorf("bound token: got %+v, want %+v", id, want)
	}
	before := f.requests.Load()
	if id2, err := r.Review(testCtx(t), bound); err != nil || id2 != want {
		t.Errorf("cached review: %+v, %v", id2, err)
	}
	if n := f.requests.Load() - before; n != 0 {
		t.Errorf("cached review sent %d requests", n)
	}

	id, err = r.Review(testCtx(t), plain)
	if err != nil || id.Node != "" || id.Pod != "" || id.PodUID != "" || id.Username != agentUser {
		t.Errorf("plain token: %+v, %v", id, err)
	}
	id, err = r.Review(testCtx(t), odd)
	if err != nil || id.Node != "" || id.Pod != "" || id.PodUID != "" {
		t.Errorf("malformed claims must read as none: %+v, %v", id, err)
	}

	// A revoked token stays accepted for the cache TTL only.
	f.revoke(bound)
	if _, err := r.Review(testCtx(t), bound); err != nil {
		t.Errorf("within the TTL the cached answer stands: %v", err)
	}
	clock.Add(11 * time.Second)
	if id, err := r.Review(testCtx(t), bound); StatusOf(err) != http.StatusUnauthorized || id.Node != "" {
		t.Errorf("revoked token after the TTL: %+v, %v", id, err)
	}
}

func TestNodeLookup(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{requireClientCert: true})
	cfg := loadConfig(t, f.kubeconfigInline())
	n, err := NewNodeLookup(cfg, time.Second, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	f.setNode("node-a", 0, "10.0.0.11", "2001:db8::11")
	f.setNode("secret", http.StatusForbidden)
	f.setNode("broken", http.StatusInternalServerError)

	addrs, err := n.Addresses(testCtx(t), "node-a")
	want := []netip.Addr{netip.MustParseAddr("10.0.0.11"), netip.MustParseAddr("2001:db8::11")}
	if err != nil || !slices.Equal(addrs, want) {
		t.Fatalf("node-a: %v, %v", addrs, err)
	}
	before := f.requests.Load()
	if _, err := n.Addresses(testCtx(t), "node-a"); err != nil || f.requests.Load() != before {
		t.Errorf("second lookup should be cached: err %v, requests %d", err, f.requests.Load()-before)
	}
	if _, err := n.Addresses(testCtx(t), "missing"); StatusOf(err) != http.StatusForbidden {
		t.Errorf("missing node: want 403, got %v", err)
	}
	for _, name := range []string{"secret", "broken"} {
		if _, err := n.Addresses(testCtx(t), name); StatusOf(err) != http.StatusServiceUnavailable {
			t.Errorf("%s: want 503, got %v", name, err)
		}
	}
	// A 403 (the server may not get nodes) is told apart from a failure,
	// and remembered for the TTL; a failure is not.
	before = f.requests.Load()
	if _, err := n.Addresses(testCtx(t), "secret"); !errors.Is(err, ErrNodesForbidden) || f.requests.Load() != before {
		t.Errorf("secret again: want ErrNodesForbidden from the cache, got %v (%d requests)", err, f.requests.Load()-before)
	}
	if _, err := n.Addresses(testCtx(t), "broken"); errors.Is(err, ErrNodesForbidden) || f.requests.Load() != before+1 {
		t.Errorf("broken again: want a new request and no ErrNodesForbidden, got %v (%d requests)", err, f.requests.Load()-before)
	}
	if _, err := n.Addresses(testCtx(t), ""); StatusOf(err) != http.StatusForbidden {
		t.Errorf("empty name: %v", err)
	}
	// Names travel escaped: a name cannot reach another path.
	if _, err := n.Addresses(testCtx(t), "../namespaces"); StatusOf(err) != http.StatusForbidden {
		t.Errorf("escaped name: %v", err)
	}
}
