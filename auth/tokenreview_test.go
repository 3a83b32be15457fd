package auth

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

const (
	testAudience = "system:konnectivity-server"
	testNS       = "kube-system"
	testSA       = "konnectivity-agent"
	agentUser    = "system:serviceaccount:kube-system:konnectivity-agent"
)

func TestAuthenticate(t *testing.T) {
	f, r := newReviewSetup(t, ReviewOptions{CacheTTL: -1})
	f.addToken(sampleToken, identity{agentUser, []string{testAudience}})
	f.addToken("other-audience", identity{agentUser, []string{"https://kubernetes.default.svc"}})
	f.addToken("wrong-namespace", identity{"system:serviceaccount:default:konnectivity-agent", []string{testAudience}})
	f.addToken("wrong-account", identity{"system:serviceaccount:kube-system:default", []string{testAudience}})
	f.addToken("not-a-service-account", identity{"kubernetes-admin", []string{testAudience}})

	tests := []struct {
		name, token string
		want        int
		reason      string
	}{
		{"valid", sampleToken, http.StatusOK, ""},
		{"apiserver rejects audience", "other-audience", http.StatusUnauthorized, "token rejected"},
		{"wrong namespace", "wrong-namespace", http.StatusForbidden, `"system:serviceaccount:default:konnectivity-agent" is not "system:serviceaccount:kube-system:konnectivity-agent"`},
		{"wrong service account", "wrong-account", http.StatusForbidden, `"system:serviceaccount:kube-system:default"`},
		{"not a service account", "not-a-service-account", http.StatusForbidden, "kubernetes-admin"},
		{"unauthenticated", "unknown-token", http.StatusUnauthorized, "not authenticated"},
		{"empty", "", http.StatusUnauthorized, "missing bearer token"},
		{"malformed", "two words", http.StatusUnauthorized, "malformed"},
		{"control char", "abc\x00def", http.StatusUnauthorized, "malformed"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := r.Authenticate(testCtx(t), tc.token)
			if got := StatusOf(err); got != tc.want {
				t.Fatalf("status %d (%v), want %d", got, err, tc.want)
			}
			if tc.reason != "" && !strings.Contains(err.Error(), tc.reason) {
				t.Errorf("error %q does not mention %q", err, tc.reason)
			}
			noToken(t, err, tc.token)
		})
	}
	if n := f.requests.Load(); n != 6 {
		t.Errorf("apiserver saw %d reviews, want 6 (empty and malformed tokens need none)", n)
	}
}

// Some authenticators (webhooks) ignore audiences: the reviewer must check
// status fields itself rather than trust "authenticated".
func TestAuthenticateChecksStatus(t *testing.T) {
	f, r := newReviewSetup(t, ReviewOptions{CacheTTL: -1})
	status := func(st map[string]any) func(reviewRequest) (int, any) {
		return func(req reviewRequest) (int, any) {
			if len(req.Spec.Audiences) != 1 || req.Spec.Audiences[0] != testAudience {
				t.Errorf("request audiences %q, want [%q]", req.Spec.Audiences, testAudience)
			}
			return http.StatusCreated, map[string]any{"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1", "status": st}
		}
	}
	tests := []struct {
		name   string
		status map[string]any
		want   int
		reason string
	}{
		{"ok", map[string]any{"authenticated": true, "user": map[string]any{"username": agentUser}, "audiences": []string{"x", testAudience}}, 200, ""},
		{"wrong audience", map[string]any{"authenticated": true, "user": map[string]any{"username": agentUser}, "audiences": []string{"other"}}, 401, "audience"},
		{"no audiences", map[string]any{"authenticated": true, "user": map[string]any{"username": agentUser}}, 401, "audience"},
		{"error set", map[string]any{"authenticated": true, "user": map[string]any{"username": agentUser}, "audiences": []string{testAudience}, "error": "webhook said no"}, 401, "webhook said no"},
		{"error echoes token", map[string]any{"authenticated": false, "error": "bad token " + sampleToken}, 401, "[redacted]"},
		{"not authenticated", map[string]any{"authenticated": false, "user": map[string]any{"username": agentUser}, "audiences": []string{testAudience}}, 401, "not authenticated"},
		{"username prefix only", map[string]any{"authenticated": true, "user": map[string]any{"username": agentUser + "x"}, "audiences": []string{testAudience}}, 403, "is not"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f.setOverride(status(tc.status))
			err := r.Authenticate(testCtx(t), sampleToken)
			if got := StatusOf(err); got != tc.want {
				t.Fatalf("status %d (%v), want %d", got, err, tc.want)
			}
			if tc.reason != "" && !strings.Contains(err.Error(), tc.reason) {
				t.Errorf("error %q does not mention %q", err, tc.reason)
			}
			noToken(t, err)
		})
	}
}

func TestAuthenticateNoAudience(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{requireClientCert: true})
	cfg := loadConfig(t, f.kubeconfigInline())
	r, err := NewTokenReviewer(cfg, ReviewOptions{Namespace: testNS, ServiceAccount: testSA})
	if err != nil {
		t.Fatal(err)
	}
	f.setOverride(func(req reviewRequest) (int, any) {
		if req.Spec.Audiences != nil {
			t.Errorf("audiences sent without --authentication-audience: %q", req.Spec.Audiences)
		}
		return http.StatusCreated, map[string]any{"status": map[string]any{
			"authenticated": true, "user": map[string]any{"username": agentUser}, "audiences": []string{"https://kubernetes.default.svc"}}}
	})
	if err := r.Authenticate(testCtx(t), sampleToken); err != nil {
		t.Fatal(err)
	}
}

func TestAuthenticateUnavailable(t *testing.T) {
	f, r := newReviewSetup(t, ReviewOptions{Timeout: 200 * time.Millisecond})
	f.addToken(sampleToken, identity{agentUser, []string{testAudience}})
	ctx := testCtx(t)

	for _, mode := range []string{"500", "hang", "garbage"} {
		t.Run(mode, func(t *testing.T) {
			f.setMode(mode)
			before := f.requests.Load()
			err := r.Authenticate(ctx, sampleToken)
			if StatusOf(err) != http.StatusServiceUnavailable {
				t.Fatalf("got %v, want 503", err)
			}
			noToken(t, err)
			if mode == "500" && !strings.Contains(err.Error(), "[redacted]") {
				t.Errorf("expected the echoed token to be redacted: %v", err)
			}
			// A 503 is not cached: once the apiserver recovers, the same
			// token is reviewed again and accepted.
			f.setMode("")
			if err := r.Authenticate(ctx, sampleToken); err != nil {
				t.Fatalf("after recovery: %v", err)
			}
			if n := f.requests.Load() - before; n != 2 {
				t.Errorf("%d reviews, want 2", n)
			}
			r.mu.Lock()
			clear(r.cache)
			clear(r.trusted) // the acceptance would answer the next mode (TestTrustDuringOutage)
			r.order.Init()
			r.mu.Unlock()
		})
	}

	t.Run("apiserver refuses our credentials", func(t *testing.T) {
		f.setOverride(func(reviewRequest) (int, any) {
			return http.StatusForbidden, map[string]any{"kind": "Status", "message": "tokenreviews.authentication.k8s.io is forbidden"}
		})
		err := r.Authenticate(ctx, "another-token")
		if StatusOf(err) != http.StatusServiceUnavailable || !strings.Contains(err.Error(), "403") {
			t.Fatalf("got %v, want 503 mentioning the apiserver's 403", err)
		}
	})

	t.Run("apiserver down", func(t *testing.T) {
		cfg := loadConfig(t, f.kubeconfigInline())
		f.srv.Close()
		r2, err := NewTokenReviewer(cfg, ReviewOptions{Namespace: testNS, ServiceAccount: testSA, Timeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		err = r2.Authenticate(ctx, sampleToken)
		if StatusOf(err) != http.StatusServiceUnavailable {
			t.Fatalf("got %v, want 503", err)
		}
		noToken(t, err)
	})
}

func TestAuthenticateCallerGivesUp(t *testing.T) {
	f, r := newReviewSetup(t, ReviewOptions{Timeout: 20 * time.Second})
	f.addToken(sampleToken, identity{agentUser, []string{testAudience}})
	f.setMode("hang")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := r.Authenticate(ctx, sampleToken); StatusOf(err) != http.StatusServiceUnavailable || !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want 503 wrapping context.Canceled", err)
	}
	f.setMode("") // lets the background review finish
}

// The review is shared by every caller with the same token and cancelled
// when the last of them gives up: a peer that resets its login leaves no
// call to the apiserver behind.
func TestAuthenticateLastWaiterCancels(t *testing.T) {
	f, r := newReviewSetup(t, ReviewOptions{Timeout: 20 * time.Second})
	f.setMode("hang")
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	ctx1, cancel1 := context.WithCancel(context.Background())
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	errs := make(chan error, 2)
	go func() { errs <- r.Authenticate(ctx1, sampleToken) }()
	waitFor("the review to reach the apiserver", func() bool { return f.hangs.Load() == 1 })
	go func() { errs <- r.Authenticate(ctx2, sampleToken) }()
	waitFor("the second caller to join", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		fl := r.inflight[sha256.Sum256([]byte(sampleToken))]
		return fl != nil && fl.waiters == 2
	})
	cancel1()
	if err := <-errs; !errors.Is(err, context.Canceled) {
		t.Fatalf("first caller: %v, want context.Canceled", err)
	}
	if n := f.hungUp.Load(); n != 0 {
		t.Fatalf("review cancelled while a caller still waits for it")
	}
	cancel2()
	if err := <-errs; !errors.Is(err, context.Canceled) {
		t.Fatalf("second caller: %v, want context.Canceled", err)
	}
	waitFor("the apiserver to see the review cancelled", func() bool { return f.hungUp.Load() == 1 })
	if n := f.requests.Load(); n != 1 {
		t.Errorf("%d reviews, want 1 shared", n)
	}
	r.mu.Lock()
	left := len(r.inflight)
	r.mu.Unlock()
	if left != 0 {
		t.Errorf("%d reviews still registered in flight", left)
	}
}

func TestCache(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1_700_000_000, 0)}
	f, r := newReviewSetup(t, ReviewOptions{CacheTTL: 10 * time.Second, Now: clock.Now})
	f.addToken(sampleToken, identity{agentUser, []string{testAudience}})
	f.addToken("wrong-account", identity{"system:serviceaccount:kube-system:default", []string{testAudience}})
	ctx := testCtx(t)

	check := func(token string, wantStatus int, wantRequests int64) {
		t.Helper()
		err := r.Authenticate(ctx, token)
		if StatusOf(err) != wantStatus {
			t.Fatalf("got %v, want %d", err, wantStatus)
		}
		if n := f.requests.Load(); n != wantRequests {
			t.Fatalf("apiserver saw %d reviews, want %d", n, wantRequests)
		}
	}
	check(sampleToken, 200, 1)
	check(sampleToken, 200, 1) // cache hit
	clock.Add(9 * time.Second)
	check(sampleToken, 200, 1)
	clock.Add(time.Second) // TTL over
	check(sampleToken, 200, 2)
	check("wrong-account", 403, 3) // refusals are cached too
	check("wrong-account", 403, 3)
	check("unknown", 401, 4)
	check("unknown", 401, 4)
}

func TestCacheRespectsTokenExpiry(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1_700_000_000, 0)}
	f, r := newReviewSetup(t, ReviewOptions{CacheTTL: time.Hour, Now: clock.Now})
	ctx := testCtx(t)
	short := makeJWT("short", clock.Now().Add(3*time.Second).Unix())
	expired := makeJWT("expired", clock.Now().Add(-time.Second).Unix())
	noExp := makeJWT("noexp", 0)
	for _, tok := range []string{short, expired, noExp} {
		f.addToken(tok, identity{agentUser, []string{testAudience}})
	}
	auth := func(tok string) {
		t.Helper()
		if err := r.Authenticate(ctx, tok); err != nil {
			t.Fatal(err)
		}
	}
	auth(short)
	clock.Add(2 * time.Second)
	auth(short)
	if n := f.requests.Load(); n != 1 {
		t.Fatalf("%d reviews before exp, want 1", n)
	}
	clock.Add(2 * time.Second) // past exp, well within TTL
	auth(short)
	if n := f.requests.Load(); n != 2 {
		t.Fatalf("%d reviews after exp, want 2: cache outlived the token", n)
	}
	auth(expired)
	auth(expired)
	if n := f.requests.Load(); n != 4 {
		t.Fatalf("%d reviews, want 4: an expired token must not be cached", n)
	}
	auth(noExp)
	clock.Add(30 * time.Minute)
	auth(noExp)
	if n := f.requests.Load(); n != 5 {
		t.Fatalf("%d reviews, want 5: token without exp uses the TTL", n)
	}
}

func TestCacheBounded(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1_700_000_000, 0)}
	f, r := newReviewSetup(t, ReviewOptions{Now: clock.Now})
	r.maxEntries = 4
	ctx := testCtx(t)
	tok := func(i int) string { return fmt.Sprintf("token-%d", i) }
	for i := range 10 {
		f.addToken(tok(i), identity{agentUser, []string{testAudience}})
		if err := r.Authenticate(ctx, tok(i)); err != nil {
			t.Fatal(err)
		}
		if n := r.cacheLen(); n > 4 {
			t.Fatalf("cache has %d entries, bound is 4", n)
		}
	}
	before := f.requests.Load()
	if err := r.Authenticate(ctx, tok(9)); err != nil { // newest: still cached
		t.Fatal(err)
	}
	if err := r.Authenticate(ctx, tok(0)); err != nil { // oldest: evicted
		t.Fatal(err)
	}
	if n := f.requests.Load() - before; n != 1 {
		t.Fatalf("%d reviews, want 1 (only the evicted token)", n)
	}
	// Expired entries are dropped before live ones.
	clock.Add(time.Minute)
	f.addToken("fresh", identity{agentUser, []string{testAudience}})
	if err := r.Authenticate(ctx, "fresh"); err != nil {
		t.Fatal(err)
	}
	if n := r.cacheLen(); n != 1 {
		t.Fatalf("cache has %d entries after expiry sweep, want 1", n)
	}
}

func TestAuthenticateConcurrent(t *testing.T) {
	f, r := newReviewSetup(t, ReviewOptions{})
	f.addToken(sampleToken, identity{agentUser, []string{testAudience}})
	f.addToken("wrong-account", identity{"system:serviceaccount:kube-system:default", []string{testAudience}})
	ctx := testCtx(t)
	const n = 16
	var wg sync.WaitGroup
	errs := make([]error, 2*n)
	for i := range n {
		wg.Go(func() { errs[i] = r.Authenticate(ctx, sampleToken) })
		wg.Go(func() { errs[n+i] = r.Authenticate(ctx, "wrong-account") })
	}
	wg.Wait()
	for i, err := range errs {
		want := 200
		if i >= n {
			want = 403
		}
		if StatusOf(err) != want {
			t.Errorf("call %d: %v, want %d", i, err, want)
		}
	}
	// Coalescing and caching: never more reviews than callers, and usually 2.
	if got := f.requests.Load(); got > 2*n {
		t.Errorf("%d reviews for %d calls", got, 2*n)
	}
}

func TestNewTokenReviewerValidates(t *testing.T) {
	cfg := loadConfig(t, "current-context: c\ncontexts: [{name: c, context: {cluster: k}}]\nclusters: [{name: k, cluster: {server: \"https://127.0.0.1:1\"}}]\n")
	for _, o := range []ReviewOptions{
		{Namespace: testNS},
		{ServiceAccount: testSA},
		{Namespace: "a:b", ServiceAccount: testSA},
	} {
		if _, err := NewTokenReviewer(cfg, o); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
	if _, err := NewTokenReviewer(nil, ReviewOptions{Namespace: testNS, ServiceAccount: testSA}); err == nil {
		t.Error("nil config accepted")
	}
	r, err := NewTokenReviewer(cfg, ReviewOptions{Namespace: testNS, ServiceAccount: testSA})
	if err != nil {
		t.Fatal(err)
	}
	if r.timeout != 5*time.Second || r.ttl != 10*time.Second || r.maxEntries != 4096 {
		t.Errorf("defaults: timeout %v ttl %v entries %d", r.timeout, r.ttl, r.maxEntries)
	}
}

func TestStatusOf(t *testing.T) {
	if StatusOf(nil) != 200 {
		t.Error("nil")
	}
	if StatusOf(errors.New("x")) != 503 {
		t.Error("plain error")
	}
	if StatusOf(fmt.Errorf("wrapped: %w", forbidden("no"))) != 403 {
		t.Error("wrapped 403")
	}
}

func TestTokenExpiry(t *testing.T) {
	if got := tokenExpiry(makeJWT("a", 1_700_000_123)); got.Unix() != 1_700_000_123 {
		t.Errorf("exp: %v", got)
	}
	for _, tok := range []string{
		"opaque", "a.b", "a.!!!.c", makeJWT("a", 0),
		"eyJ9.eyJleHAiOiJzb29uIn0.x", // {"exp":"soon"}
		"x.eyJleHAiOjEuNWUxMH0.y",    // {"exp":1.5e10}: within range
	} {
		got := tokenExpiry(tok)
		if tok == "x.eyJleHAiOjEuNWUxMH0.y" {
			if got.Unix() != 15_000_000_000 {
				t.Errorf("%q: %v", tok, got)
			}
			continue
		}
		if !got.IsZero() {
			t.Errorf("%q: got %v, want zero", tok, got)
		}
	}
}

// TestReviewRateBound: past Rate a token not in the cache is refused at
// once (503, no TokenReview sent, OnRateLimited called), a cached one is
// still answered, and the bound refills with time (half a second: 1.5 calls).
func TestReviewRateBound(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1000, 0)}
	limited := 0
	f, r := newReviewSetup(t, ReviewOptions{Rate: 3, Now: clock.Now, OnRateLimited: func() { limited++ }})
	var n atomic.Int64
	f.setOverride(func(reviewRequest) (int, any) {
		n.Add(1)
		return http.StatusCreated, map[string]any{"status": map[string]any{"authenticated": false}}
	})
	ctx := testCtx(t)
	for i := range 3 {
		if _, err := r.Review(ctx, fmt.Sprintf("garbage%d", i)); StatusOf(err) != http.StatusUnauthorized {
			t.Fatalf("review %d within the bound: %v", i, err)
		}
	}
	if _, err := r.Review(ctx, "garbage3"); StatusOf(err) != http.StatusServiceUnavailable || limited != 1 {
		t.Fatalf("past the bound: %v, %d limited; want 503 and 1", err, limited)
	}
	if _, err := r.Review(ctx, "garbage0"); StatusOf(err) != http.StatusUnauthorized {
		t.Fatalf("a cached outcome past the bound: %v, want 401", err)
	}
	clock.Add(time.Second / 2)
	if _, err := r.Review(ctx, "garbage4"); StatusOf(err) != http.StatusUnauthorized {
		t.Fatalf("after half a second: %v", err)
	}
	if got := n.Load(); got != 4 {
		t.Errorf("%d TokenReviews sent, want 4", got)
	}
}

// TestUnsureRefusalNotCached: kube-apiserver answers a lookup it could not
// do with authenticated=false and status.error, as it answers a revoked
// token. Such a refusal is a 401 marked Unsure and is not cached: the next
// review asks the apiserver again and, the lookup working again, admits.
// A refusal without status.error is cached and not Unsure.
func TestUnsureRefusalNotCached(t *testing.T) {
	f, r := newReviewSetup(t, ReviewOptions{CacheTTL: time.Minute})
	f.addToken(sampleToken, identity{agentUser, []string{testAudience}})
	ctx := testCtx(t)
	var failed atomic.Bool
	f.setOverride(func(req reviewRequest) (int, any) {
		if failed.CompareAndSwap(false, true) {
			return http.StatusCreated, map[string]any{"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
				"status": map[string]any{"authenticated": false, "error": "etcdserver: request timed out"}}
		}
		return http.StatusCreated, map[string]any{"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
			"status": map[string]any{"authenticated": true, "user": map[string]any{"username": agentUser}, "audiences": []string{testAudience}}}
	})
	err := r.Authenticate(ctx, sampleToken)
	if StatusOf(err) != http.StatusUnauthorized || !Unsure(err) {
		t.Fatalf("a refusal with status.error: %v (unsure %v), want an unsure 401", err, Unsure(err))
	}
	if err := r.Authenticate(ctx, sampleToken); err != nil {
		t.Fatalf("the review after an unsure refusal: %v, want a new review that admits", err)
	}
	if n := f.requests.Load(); n != 2 {
		t.Fatalf("apiserver saw %d reviews, want 2", n)
	}
	f.setOverride(func(req reviewRequest) (int, any) {
		return http.StatusCreated, map[string]any{"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
			"status": map[string]any{"authenticated": false}}
	})
	err = r.Authenticate(ctx, "other-token")
	if StatusOf(err) != http.StatusUnauthorized || Unsure(err) {
		t.Fatalf("a plain refusal: %v (unsure %v), want a sure 401", err, Unsure(err))
	}
	r.Authenticate(ctx, "other-token")
	if n := f.requests.Load(); n != 3 {
		t.Fatalf("apiserver saw %d reviews, want 3 (the plain refusal cached)", n)
	}
}

// The token must not show up in any error, whatever fails in a review.
func TestTokenNeverInErrors(t *testing.T) {
	f, r := newReviewSetup(t, ReviewOptions{Timeout: 200 * time.Millisecond, CacheTTL: -1})
	ctx := context.Background()
	var errs []error
	for _, mode := range []string{"", "500", "garbage", "hang"} {
		f.setMode(mode)
		errs = append(errs, r.Authenticate(ctx, sampleToken))
	}
	f.setOverride(func(reviewRequest) (int, any) {
		return http.StatusForbidden, map[string]any{"message": "token " + sampleToken + " refused"}
	})
	errs = append(errs, r.Authenticate(ctx, sampleToken))
	f.setOverride(func(reviewRequest) (int, any) {
		return http.StatusCreated, map[string]any{"status": map[string]any{"error": "invalid: " + sampleToken}}
	})
	errs = append(errs, r.Authenticate(ctx, sampleToken))
	f.setOverride(func(reviewRequest) (int, any) {
		return http.StatusCreated, map[string]any{"status": map[string]any{"authenticated": true, "user": map[string]any{"username": sampleToken}, "audiences": []string{testAudience}}}
	})
	errs = append(errs, r.Authenticate(ctx, sampleToken))
	errs = append(errs, r.Authenticate(ctx, sampleToken+" x"))
	for i, err := range errs {
		if err == nil {
			if i == 0 {
				continue // the unknown-token review fails with a plain 401
			}
			t.Errorf("case %d: no error", i)
			continue
		}
		noToken(t, err)
		// Even a fragment (the signature part) must not leak.
		if strings.Contains(err.Error(), sampleToken[strings.LastIndexByte(sampleToken, '.')+1:]) {
			t.Errorf("case %d leaks part of the token: %v", i, err)
		}
	}
}
