package auth

import (
	"container/list"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeapi"
	"github.com/spinifex/konnectivity/internal/kubeclient"
)

const (
	defaultReviewTimeout = 5 * time.Second
	defaultCacheTTL      = 10 * time.Second
	defaultCacheEntries  = 4096
	maxTokenLen          = 64 << 10
	maxReviewBody        = 1 << 20
	tokenReviewPath      = "/apis/authentication.k8s.io/v1/tokenreviews"
)

// Error is an authentication failure with the HTTP status the server should
// send to the agent (401, 403 or 503) or the frontend client (403).
type Error struct {
	Status int    // http.StatusUnauthorized, StatusForbidden or StatusServiceUnavailable
	Reason string // human-readable, never contains the token
	err    error  // cause, for 503s
	// unsure marks a refusal that came with status.error: kube-apiserver
	// reports a lookup it could not do (etcd, a webhook) the same way as a
	// revoked token, so the answer is not cached (see Unsure).
	unsure bool
}

// Unsure reports whether err is a refusal the apiserver gave with an error
// of its own (TokenReview status.error): a revoked token or a lookup that
// failed, which the answer cannot tell apart. It is never cached; callers
// that can wait (a re-review of a live connection) act on it only once
// such answers have lasted a grace (server.ErrReviewUnsure).
func Unsure(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.unsure
}

func (e *Error) Error() string {
	if e.err != nil {
		return fmt.Sprintf("%s: %s: %v", http.StatusText(e.Status), e.Reason, e.err)
	}
	return fmt.Sprintf("%s: %s", http.StatusText(e.Status), e.Reason)
}

func (e *Error) Unwrap() error { return e.err }

// StatusOf maps an error from this package to the HTTP status to answer
// with: 200 for nil, the Error's status, and 503 for anything else (an
// unexpected failure is ours, so the agent should retry).
func StatusOf(err error) int {
	if err == nil {
		return http.StatusOK
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Status
	}
	return http.StatusServiceUnavailable
}

func unauthorized(format string, args ...any) error {
	return &Error{Status: http.StatusUnauthorized, Reason: fmt.Sprintf(format, args...)}
}

func forbidden(format string, args ...any) error {
	return &Error{Status: http.StatusForbidden, Reason: fmt.Sprintf(format, args...)}
}

func unavailable(reason string, err error) error {
	return &Error{Status: http.StatusServiceUnavailable, Reason: reason, err: err}
}

// ReviewOptions configures a TokenReviewer.
type ReviewOptions struct {
	// Audience the token must be issued for (--authentication-audience).
	// Empty: do not ask for one, accept the apiserver's default audiences.
	Audience string
	// The agent's ServiceAccount: the token's user must be exactly
	// system:serviceaccount:<Namespace>:<ServiceAccount>. Both required.
	Namespace      string
	ServiceAccount string
	// Timeout bounds one TokenReview call. Default 5s.
	Timeout time.Duration
	// CacheTTL is how long a 200/401/403 outcome is reused for the same
	// token (never past the token's exp claim); a refusal that came with
	// status.error is never reused (Unsure). Default 10s; negative
	// disables caching. A revoked token may thus be accepted for CacheTTL.
	CacheTTL time.Duration
	// Now is the clock used for the cache; default time.Now.
	Now func() time.Time
	// Rate bounds the TokenReview calls sent per second, with a burst of
	// one second's worth: a token not in the cache past it is answered
	// 503 at once, so that peers with garbage tokens cannot turn their
	// handshakes into apiserver load. Cached outcomes and callers joining
	// a review in flight are not counted. Zero: no bound.
	Rate float64
	// OnRateLimited, if set, is called for each review Rate refused.
	OnRateLimited func()
}

// TokenReviewer authenticates agent bearer tokens with the kube-apiserver's
// TokenReview API. It is safe for concurrent use.
type TokenReviewer struct {
	client     *kubeclient.Client
	audience   string
	username   string
	timeout    time.Duration
	ttl        time.Duration
	now        func() time.Time
	maxEntries int

	rate      float64 // immutable: TokenReview calls per second, 0 unbounded
	onLimited func()  // immutable

	mu       sync.Mutex
	cache    map[[32]byte]*list.Element // of *cacheEntry; guarded by mu
	order    *list.List                 // insertion order, front = oldest; guarded by mu
	inflight map[[32]byte]*flight       // guarded by mu
	trusted  map[[32]byte]trustEntry    // acceptances that stand in for a review the apiserver cannot give (trusted.go); guarded by mu
	credit   float64                    // guarded by mu: calls the rate allows now (a token bucket)
	refilled time.Time                  // guarded by mu: when credit was last brought up to date
}

type cacheEntry struct {
	key     [32]byte
	id      Identity // set when err is nil
	err     error    // nil: accepted
	expires time.Time
}

// flight is one TokenReview in progress; identical concurrent requests wait
// for it instead of sending their own.
type flight struct {
	done    chan struct{}
	id      Identity           // set before done is closed
	err     error              // set before done is closed
	cancel  context.CancelFunc // ends the review: its last waiter left, or it is done
	waiters int                // callers waiting for done; guarded by TokenReviewer.mu
}

// NewTokenReviewer returns a reviewer that calls the apiserver described by
// cfg.
func NewTokenReviewer(cfg *kubeclient.Config, opts ReviewOptions) (*TokenReviewer, error) {
	if cfg == nil {
		return nil, errors.New("token reviewer: no apiserver config")
	}
	if opts.Namespace == "" || opts.ServiceAccount == "" {
		return nil, errors.New("token reviewer: agent namespace and service account are required")
	}
	if strings.Contains(opts.Namespace, ":") || strings.Contains(opts.ServiceAccount, ":") {
		return nil, errors.New("token reviewer: agent namespace and service account must not contain ':'")
	}
	r := &TokenReviewer{
		client:     kubeclient.New(cfg),
		audience:   opts.Audience,
		username:   "system:serviceaccount:" + opts.Namespace + ":" + opts.ServiceAccount,
		timeout:    opts.Timeout,
		ttl:        opts.CacheTTL,
		now:        opts.Now,
		maxEntries: defaultCacheEntries,
		cache:      map[[32]byte]*list.Element{},
		order:      list.New(),
		inflight:   map[[32]byte]*flight{},
		trusted:    map[[32]byte]trustEntry{},
		rate:       opts.Rate,
		onLimited:  opts.OnRateLimited,
		credit:     opts.Rate,
	}
	if r.timeout <= 0 {
		r.timeout = defaultReviewTimeout
	}
	if r.ttl == 0 {
		r.ttl = defaultCacheTTL
	}
	if r.now == nil {
		r.now = time.Now
	}
	return r, nil
}

// Review is Authenticate that also returns what the apiserver said about
// an accepted token: its user and, for a token bound to a pod, the pod and
// node it was issued for.
func (r *TokenReviewer) Review(ctx context.Context, bearerToken string) (Identity, error) {
	if bearerToken == "" {
		return Identity{}, unauthorized("missing bearer token")
	}
	if !validToken(bearerToken) {
		return Identity{}, unauthorized("malformed bearer token")
	}
	key := sha256.Sum256([]byte(bearerToken))

	r.mu.Lock()
	if id, err, ok := r.lookup(key); ok {
		r.mu.Unlock()
		return id, err
	}
	f, ok := r.inflight[key]
	if !ok && !r.allowLocked() {
		e, trusted := r.trustedLocked(key)
		r.mu.Unlock()
		if trusted {
			return e.id, nil
		}
		if r.onLimited != nil {
			r.onLimited()
		}
		return Identity{}, unavailable("TokenReview rate bound reached", nil)
	}
	if !ok {
		// The review runs on its own so that a caller giving up does not
		// fail the others waiting for it; the last one to give up cancels
		// it, so a peer that leaves leaves no call behind. Timeout bounds
		// its life.
		runCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.timeout)
		f = &flight{done: make(chan struct{}), cancel: cancel}
		r.inflight[key] = f
		go r.run(runCtx, key, bearerToken, f)
	}
	f.waiters++
	r.mu.Unlock()

	select {
	case <-f.done:
		return f.id, f.err
	case <-ctx.Done():
		r.mu.Lock()
		f.waiters--
		if f.waiters == 0 && r.inflight[key] == f {
			delete(r.inflight, key) // a later caller starts afresh
			f.cancel()
		}
		r.mu.Unlock()
		return Identity{}, unavailable("authentication abandoned", ctx.Err())
	}
}

func (r *TokenReviewer) run(ctx context.Context, key [32]byte, token string, f *flight) {
	defer f.cancel()
	id, err := r.review(ctx, token)
	id.Expires = tokenExpiry(token)

	r.mu.Lock()
	if r.inflight[key] == f {
		delete(r.inflight, key)
	}
	if StatusOf(err) != http.StatusServiceUnavailable && !Unsure(err) {
		r.store(key, id, err, id.Expires)
	}
	f.id, f.err = r.trustLocked(key, id, err)
	r.mu.Unlock()
	close(f.done)
}

// allowLocked takes one call from the rate bound, if it allows one now.
// r.mu is held.
func (r *TokenReviewer) allowLocked() bool {
	if r.rate <= 0 {
		return true
	}
	now := r.now()
	if !r.refilled.IsZero() {
		r.credit = min(r.rate, r.credit+now.Sub(r.refilled).Seconds()*r.rate)
	}
	r.refilled = now
	if r.credit < 1 {
		return false
	}
	r.credit--
	return true
}

// lookup returns a cached outcome; r.mu must be held.
func (r *TokenReviewer) lookup(key [32]byte) (Identity, error, bool) {
	el, ok := r.cache[key]
	if !ok {
		return Identity{}, nil, false
	}
	e := el.Value.(*cacheEntry)
	if !r.now().Before(e.expires) {
		r.order.Remove(el)
		delete(r.cache, key)
		return Identity{}, nil, false
	}
	return e.id, e.err, true
}

// store caches an outcome until now+TTL or the token's expiry, whichever is
// first; r.mu must be held.
func (r *TokenReviewer) store(key [32]byte, id Identity, err error, exp time.Time) {
	if r.ttl < 0 {
		return
	}
	now := r.now()
	expires := now.Add(r.ttl)
	if !exp.IsZero() && exp.Before(expires) {
		expires = exp
	}
	if !now.Before(expires) {
		return
	}
	if el, ok := r.cache[key]; ok {
		r.order.Remove(el)
		delete(r.cache, key)
	}
	for r.order.Len() >= r.maxEntries {
		r.evict(now)
	}
	r.cache[key] = r.order.PushBack(&cacheEntry{key: key, id: id, err: err, expires: expires})
}

// evict drops every expired entry, or if none has expired the oldest one.
func (r *TokenReviewer) evict(now time.Time) {
	removed := false
	for el := r.order.Front(); el != nil; {
		next := el.Next()
		if e := el.Value.(*cacheEntry); !now.Before(e.expires) {
			r.order.Remove(el)
			delete(r.cache, e.key)
			removed = true
		}
		el = next
	}
	if !removed {
		oldest := r.order.Front()
		r.order.Remove(oldest)
		delete(r.cache, oldest.Value.(*cacheEntry).key)
	}
}

type tokenReview struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Spec       tokenReviewSpec   `json:"spec"`
	Status     tokenReviewStatus `json:"status"`
}

type tokenReviewSpec struct {
	Token     string   `json:"token"`
	Audiences []string `json:"audiences,omitempty"`
}

type tokenReviewStatus struct {
	Authenticated bool     `json:"authenticated"`
	User          userInfo `json:"user"`
	Audiences     []string `json:"audiences"`
	Error         string   `json:"error"`
}

type userInfo struct {
	Username string              `json:"username"`
	Extra    map[string][]string `json:"extra"`
}

func (r *TokenReviewer) review(ctx context.Context, token string) (Identity, error) {
	req := tokenReview{
		APIVersion: "authentication.k8s.io/v1",
		Kind:       "TokenReview",
		Spec:       tokenReviewSpec{Token: token},
	}
	if r.audience != "" {
		req.Spec.Audiences = []string{r.audience}
	}
	body, err := json.Marshal(struct {
		APIVersion string          `json:"apiVersion"`
		Kind       string          `json:"kind"`
		Spec       tokenReviewSpec `json:"spec"`
	}{req.APIVersion, req.Kind, req.Spec})
	if err != nil {
		return Identity{}, unavailable("tokenreview", err)
	}
	data, err := r.client.Call(ctx, http.MethodPost, tokenReviewPath, body, maxReviewBody)
	if e, ok := errors.AsType[*kubeapi.Error](err); ok {
		// E.g. 403 when the server's own identity may not create
		// tokenreviews: our problem, not the agent's, hence 503.
		return Identity{}, unavailable("tokenreview: apiserver answered "+statusLine(e.Code), errors.New(snippet(e.Body, token)))
	}
	if err != nil {
		return Identity{}, unavailable("tokenreview request failed", redactErr(err, token))
	}
	var out tokenReview
	if err := json.Unmarshal(data, &out); err != nil {
		return Identity{}, unavailable("tokenreview: undecodable response", errors.New("invalid JSON"))
	}
	st := out.Status
	if st.Error != "" {
		return Identity{}, &Error{Status: http.StatusUnauthorized, unsure: true,
			Reason: "token rejected: " + snippet([]byte(st.Error), token)}
	}
	if !st.Authenticated {
		return Identity{}, unauthorized("token not authenticated")
	}
	// A token for another audience is not a credential here at all:
	// kube-apiserver answers it 401, as it answers a bad token.
	if r.audience != "" && !contains(st.Audiences, r.audience) {
		return Identity{}, unauthorized("token is not for audience %q", r.audience)
	}
	if st.User.Username != r.username {
		return Identity{}, forbidden("token user %q is not %q", snippet([]byte(st.User.Username), token), r.username)
	}
	return boundIdentity(st.User), nil
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// validToken accepts printable ASCII without spaces (RFC 6750 b64token and
// then some); anything else cannot be a ServiceAccount token.
func validToken(t string) bool {
	if len(t) > maxTokenLen {
		return false
	}
	for i := 0; i < len(t); i++ {
		if t[i] <= ' ' || t[i] >= 0x7f {
			return false
		}
	}
	return true
}

// tokenExpiry reads the exp claim of a JWT without verifying it (the
// apiserver did that); zero if the token is not a JWT or has no exp.
func tokenExpiry(token string) time.Time {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return time.Time{}
	}
	payload, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(parts[1], "="))
	if err != nil {
		return time.Time{}
	}
	var claims struct {
		Exp json.Number `json:"exp"`
	}
	if json.Unmarshal(payload, &claims) != nil || claims.Exp == "" {
		return time.Time{}
	}
	f, err := strconv.ParseFloat(string(claims.Exp), 64)
	if err != nil || f <= 0 || f > 1<<40 {
		return time.Time{}
	}
	return time.Unix(int64(f), 0)
}

// snippet makes apiserver-provided text safe to put in an error: bounded,
// one line, and without the token should the apiserver echo it.
func snippet(data []byte, token string) string {
	return oneLine(strings.ReplaceAll(string(data), token, "[redacted]"))
}

// oneLine is apiserver-provided text as one line of at most 256 bytes.
func oneLine(s string) string {
	return clip(strings.Join(strings.Fields(s), " "), 256)
}

// statusLine is an HTTP status as a status line shows it: "403 Forbidden".
func statusLine(code int) string {
	return strconv.Itoa(code) + " " + http.StatusText(code)
}

func clip(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

func redactErr(err error, token string) error {
	if strings.Contains(err.Error(), token) {
		return errors.New(strings.ReplaceAll(err.Error(), token, "[redacted]"))
	}
	return err
}
