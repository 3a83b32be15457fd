package auth

import (
	"encoding/hex"
	"net/http"
	"time"
)

// A token the apiserver accepted stays trusted while the apiserver cannot
// answer (it is down, it resets, it answers 429 or 5xx): a review that
// could not be done is answered with the last acceptance of the same
// token, until the token's expiry and at most maxTrust after that
// acceptance. A refusal (401, 403) ends the trust at once. The accepted
// reviews cross a restart in place (Reviewed, Trust), so a reload during
// an apiserver outage re-admits the agents the running image had admitted
// instead of refusing them all (docs/security.md, "What is trusted for how
// long").

// maxTrust bounds how long an acceptance stands in for a review the
// apiserver cannot give, for a token without an expiry or a far one.
const maxTrust = time.Hour

// trustEntry is an accepted review remembered for an outage.
type trustEntry struct {
	id    Identity
	until time.Time
}

// Reviewed is an accepted review as it crosses a restart: the token's
// SHA-256 (never the token), what the apiserver said, and until when it
// stands in for a review that cannot be done.
type Reviewed struct {
	Key   string    `json:"key"`
	ID    Identity  `json:"identity"`
	Until time.Time `json:"until"`
}

// trustLocked records what a review of key ended with and returns what
// its caller is told: an acceptance is remembered, a refusal forgets, and
// a review that could not be done is answered with the acceptance
// remembered, while it holds. r.mu is held.
func (r *TokenReviewer) trustLocked(key [32]byte, id Identity, err error) (Identity, error) {
	switch StatusOf(err) {
	case http.StatusOK:
		now := r.now()
		until := now.Add(maxTrust)
		if !id.Expires.IsZero() && id.Expires.Before(until) {
			until = id.Expires
		}
		r.rememberLocked(key, trustEntry{id: id, until: until})
	case http.StatusServiceUnavailable:
		if e, ok := r.trustedLocked(key); ok {
			return e.id, nil
		}
	default:
		delete(r.trusted, key)
	}
	return id, err
}

// trustedLocked is the acceptance remembered for key, if it still holds.
// r.mu is held.
func (r *TokenReviewer) trustedLocked(key [32]byte) (trustEntry, bool) {
	e, ok := r.trusted[key]
	if !ok {
		return trustEntry{}, false
	}
	if !r.now().Before(e.until) {
		delete(r.trusted, key)
		return trustEntry{}, false
	}
	return e, true
}

// rememberLocked keeps e for key, within maxEntries: when full, the
// expired entries go, or else the one that expires first. r.mu is held.
func (r *TokenReviewer) rememberLocked(key [32]byte, e trustEntry) {
	if !r.now().Before(e.until) {
		return
	}
	if _, ok := r.trusted[key]; !ok && len(r.trusted) >= r.maxEntries {
		now := r.now()
		var first [32]byte
		var firstUntil time.Time
		for k, old := range r.trusted {
			if !now.Before(old.until) {
				delete(r.trusted, k)
				continue
			}
			if firstUntil.IsZero() || old.until.Before(firstUntil) {
				first, firstUntil = k, old.until
			}
		}
		if len(r.trusted) >= r.maxEntries {
			delete(r.trusted, first)
		}
	}
	r.trusted[key] = e
}

// Reviewed returns the acceptances that still hold, for the next image of
// the process (Trust).
func (r *TokenReviewer) Reviewed() []Reviewed {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	out := make([]Reviewed, 0, len(r.trusted))
	for k, e := range r.trusted {
		if now.Before(e.until) {
			out = append(out, Reviewed{Key: hex.EncodeToString(k[:]), ID: e.id, Until: e.until})
		}
	}
	return out
}

// Trust takes over the acceptances a previous image of the process held
// (Reviewed). An entry that is malformed, expired, or claims more than
// maxTrust from now is dropped or cut to it; it returns how many it took.
func (r *TokenReviewer) Trust(list []Reviewed) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	taken := 0
	for _, e := range list {
		var key [32]byte
		b, err := hex.DecodeString(e.Key)
		if err != nil || len(b) != len(key) {
			continue
		}
		copy(key[:], b)
		until := e.Until
		if until.After(now.Add(maxTrust)) {
			until = now.Add(maxTrust)
		}
		if !now.Before(until) || e.ID.Username != r.username {
			continue
		}
		r.rememberLocked(key, trustEntry{id: e.ID, until: until})
		taken++
	}
	return taken
}
