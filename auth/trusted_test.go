package auth

import (
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestTrustDuringOutage: a token the apiserver accepted stays accepted
// while the apiserver cannot answer (500, a hang, garbage, the rate
// bound), also in the next image of the process (Reviewed, Trust), until
// the trust's bound; a refusal ends it at once; a token never accepted
// gets its 503.
func TestTrustDuringOutage(t *testing.T) {
	now := time.Now()
	clock := func() time.Time { return now }
	f, r := newReviewSetup(t, ReviewOptions{Timeout: 200 * time.Millisecond, CacheTTL: -1, Now: clock})
	f.addToken(sampleToken, identity{agentUser, []string{testAudience}})
	ctx := testCtx(t)
	if _, err := r.Review(ctx, sampleToken); err != nil {
		t.Fatal(err)
	}
	const other = "eyJhbGciOiJSUzI1NiJ9.b3RoZXI.c2ln"
	for _, mode := range []string{"500", "hang", "garbage"} {
		f.setMode(mode)
		id, err := r.Review(ctx, sampleToken)
		if err != nil || id.Username != agentUser {
			t.Errorf("%s: accepted token during the outage: %+v, %v; want its identity", mode, id, err)
		}
		if _, err := r.Review(ctx, other); StatusOf(err) != http.StatusServiceUnavailable {
			t.Errorf("%s: a token never accepted: %v, want 503", mode, err)
		}
	}

	// The next image of the process takes the acceptance over; the
	// token's hash crosses, never the token.
	list := r.Reviewed()
	if len(list) != 1 || strings.Contains(list[0].Key, sampleToken) || list[0].Until.After(now.Add(maxTrust)) {
		t.Fatalf("reviewed %+v: want one entry, the token's hash, trusted at most %s", list, maxTrust)
	}
	nextAPI, next := newReviewSetup(t, ReviewOptions{Timeout: 200 * time.Millisecond, CacheTTL: -1, Now: clock})
	if n := next.Trust(append(list, Reviewed{Key: "zz", ID: list[0].ID, Until: now.Add(time.Minute)}, Reviewed{Key: list[0].Key, ID: Identity{Username: "system:serviceaccount:x:y"}, Until: now.Add(time.Minute)})); n != 1 {
		t.Errorf("next image trusted %d entries, want 1 (a malformed key and another account dropped)", n)
	}
	nextAPI.setMode("500")
	if id, err := next.Review(ctx, sampleToken); err != nil || id.Username != agentUser {
		t.Errorf("next image, apiserver down: %+v, %v; want the acceptance taken over", id, err)
	}
	now = now.Add(maxTrust)
	if _, err := next.Review(ctx, sampleToken); StatusOf(err) != http.StatusServiceUnavailable {
		t.Errorf("past the trust's bound: %v, want 503", err)
	}
	now = now.Add(-maxTrust)

	// A refusal ends the trust.
	f.setMode("")
	f.revoke(sampleToken)
	if _, err := r.Review(ctx, sampleToken); StatusOf(err) != http.StatusUnauthorized {
		t.Fatalf("revoked: %v, want 401", err)
	}
	f.setMode("500")
	if _, err := r.Review(ctx, sampleToken); StatusOf(err) != http.StatusServiceUnavailable {
		t.Errorf("revoked, then an outage: %v, want 503 (no trust left)", err)
	}
}
