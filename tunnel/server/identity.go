package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"log/slog"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/internal/promtext"
)

// Principal is what an agent's credential proves about it. The zero value
// proves nothing: an agent admitted without authentication.
type Principal struct {
	Kind PrincipalKind
	// Credential names the credential ("pod:<uid>", "cert:<subject>",
	// "sa:<user>"). A login with an agent ID that is already connected is
	// the same agent coming back only if both name the same credential.
	Credential string
	// Node is the node a bound token was issued for; empty when the
	// credential names none (an unbound token, or Kubernetes before 1.30).
	Node string
	// Pod is the pod a bound token was issued for (its name, without the
	// namespace); empty when the credential names none.
	Pod string
	// Names are a client certificate's CN and DNS SANs, Addrs its IP SANs.
	Names []string
	Addrs []netip.Addr
	// Account is a token's ServiceAccount, "namespace/name".
	Account string
	// Expires is when the credential stops being valid (a token's exp
	// claim); zero when unknown.
	Expires time.Time
}

// CertificatePrincipal is what a verified client certificate proves: its
// names and addresses. Agents sharing one certificate share a credential.
func CertificatePrincipal(cert *x509.Certificate) Principal {
	p := Principal{
		Kind:       PrincipalCertificate,
		Credential: "cert:" + cert.Issuer.String() + "/" + cert.Subject.String(),
		Expires:    cert.NotAfter,
	}
	if cn := cert.Subject.CommonName; cn != "" {
		p.Names = append(p.Names, cn)
	}
	p.Names = append(p.Names, cert.DNSNames...)
	for _, ip := range cert.IPAddresses {
		if a, ok := netip.AddrFromSlice(ip); ok {
			p.Addrs = append(p.Addrs, a.Unmap())
		}
	}
	return p
}

// PrincipalKind says what kind of credential an agent presented.
type PrincipalKind string

const (
	PrincipalNone        PrincipalKind = ""            // no authentication configured
	PrincipalToken       PrincipalKind = "token"       // a ServiceAccount token; reviewed again while the link lives
	PrincipalCertificate PrincipalKind = "certificate" // a client certificate from the cluster CA
)

// IdentityPolicy says how an agent's ID and identifiers are bound to its
// credential. The zero value binds token agents to their token's node and
// refuses cidr= and default-route from everyone.
type IdentityPolicy struct {
	// IgnoreNodeClaims admits a token agent under any ID and host=/ipv4=/
	// ipv6= identifiers, whatever node its token was issued for.
	IgnoreNodeClaims bool
	// CertificateNames requires an agent with a client certificate to use
	// one of the certificate's names (CN or DNS SAN) as its ID and host=
	// identifiers, and its IP SANs as ipv4=/ipv6=.
	CertificateNames bool
	// RouteAgents may advertise cidr= and default-route identifiers: agent
	// IDs, "serviceaccount:NAMESPACE/NAME", or "*" for every agent.
	RouteAgents []string
	// NodeAddresses returns a node's addresses, to check the ipv4=/ipv6=
	// identifiers of a node-bound agent. An error wrapping
	// ErrNodesForbidden (the server may not read Nodes), or a nil
	// NodeAddresses, drops such identifiers: the agent is admitted without
	// them. A StatusError 403 (no such node) refuses the agent; any other
	// error is a 503 (retry).
	NodeAddresses func(ctx context.Context, node string) ([]netip.Addr, error)
	// Recheck is how often a token agent's token is reviewed again while
	// its link lives (and at the token's expiry). Default one minute;
	// negative: never.
	Recheck time.Duration
	// DoubtGrace is how long a live link outlives reviews of its token
	// that answer ErrReviewUnsure, counted from the first: it takes no new
	// dial meanwhile, and the first such answer at or past the grace
	// closes it. Default one minute; negative: the first one closes it.
	DoubtGrace time.Duration
}

// ErrReviewUnsure is what an IdentifyAgent error wraps when the apiserver
// refused the token with an error of its own (TokenReview status.error):
// kube-apiserver answers so when a lookup behind the review failed (etcd,
// a webhook, the pod's lookup), and also, for some revocations, when it
// did not; the answer cannot tell them apart. A live link is not closed
// on such answers until they have lasted IdentityPolicy.DoubtGrace
// (reviewLink); any other refusal closes it at once.
var ErrReviewUnsure = errors.New("the apiserver refused the token with an error of its own")

// ErrNodesForbidden is what IdentityPolicy.NodeAddresses wraps when the
// apiserver forbids the server to read Nodes: the ipv4=/ipv6= identifiers
// of node-bound agents cannot be checked, so they are dropped.
var ErrNodesForbidden = errors.New("the server may not read Node objects")

// Why an agent's claims were refused (or, for address_unverifiable,
// dropped), also the metric labels.
const (
	identityNodeMismatch      = "node_mismatch"        // ID not the token's node or pod, or host= not its node
	identityAddressUnbacked   = "address_unbacked"     // ipv4=/ipv6= the credential cannot back
	identityAddressUnverified = "address_unverifiable" // ipv4=/ipv6= dropped: the Node cannot be read
	identityRouteUntrusted    = "route_untrusted"      // cidr=/default-route from an agent not trusted for them
	identityCertMismatch      = "certificate_mismatch" // ID or identifiers not in the certificate
	identityInUse             = "id_in_use"            // ID connected with another credential
	identityTokenInvalid      = "token_invalid"        // a live link's token refused, or its unsure refusals lasted the doubt grace: closed
	identityTokenDoubted      = "token_doubted"        // a live link's token refused with an apiserver error: no new dials until a review passes
)

var identityReasons = []string{identityNodeMismatch, identityAddressUnbacked, identityAddressUnverified, identityRouteUntrusted, identityCertMismatch, identityInUse, identityTokenInvalid, identityTokenDoubted}

// minTokenRefresh bounds how often an admitted agent can make the server
// review a new token it sends on its control stream.
const minTokenRefresh = time.Second

// revokeGrace is how long the tunnels of a link whose token is no longer
// valid may finish before the link is closed.
const revokeGrace = 5 * time.Second

// connCredential is the credential a live agent connection stands on.
type connCredential struct {
	tls tls.ConnectionState // fixed at login

	mu      sync.Mutex
	token   string      // latest valid token the agent presented; guarded by mu
	expires time.Time   // its exp claim; guarded by mu
	lastNew time.Time   // when the agent last sent a token; guarded by mu
	timer   *time.Timer // next review; guarded by mu
	ended   bool        // the link is gone: no more reviews; guarded by mu
	// doubted is when the reviews of the link's token began to answer
	// ErrReviewUnsure, zero while the last one that was done passed;
	// guarded by mu. The agent's doubted flag mirrors it for the dial
	// path.
	doubted time.Time
}

func (c *connCredential) currentToken() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.token
}

// identityState is the server's identity bookkeeping.
type identityState struct {
	refused        map[string]*promtext.Counter // by reason; fixed after New
	noClaimsOnce   sync.Once
	unverifiedOnce sync.Once // the warning that addresses are dropped
}

func newIdentityState(m *promtext.Registry) *identityState {
	st := &identityState{refused: map[string]*promtext.Counter{}}
	for _, r := range identityReasons {
		st.refused[r] = m.Counter(serverPrefix+"agent_identity_refusals_total", "Agent logins refused, links closed, and (address_unverifiable) identifiers dropped, because the credential does not back what the agent claims, by reason.", []string{"reason"}, r)
	}
	return st
}

func (s *Server) identityRefused(reason, format string, args ...any) error {
	if c := s.identity.refused[reason]; c != nil {
		c.Inc()
	}
	return wire.StatusErrorf(http.StatusForbidden, format, args...).WithReason(reason)
}

// authenticate checks an agent's credential and says what it proves.
func (s *Server) authenticate(ctx context.Context, c AgentCredentials) (Principal, error) {
	if s.cfg.IdentifyAgent != nil {
		return s.cfg.IdentifyAgent(ctx, c)
	}
	if s.cfg.AuthenticateAgent != nil {
		return Principal{}, s.cfg.AuthenticateAgent(ctx, c)
	}
	return Principal{}, nil
}

// checkIdentity refuses an agent whose identifiers its credential does
// not back, and a login under an ID that is connected with another
// credential. Refusals are 403s carrying the reason; a node lookup that
// could not be done is a 503 (retry). It returns the ID the agent is
// registered under and its identifiers: ids, less the ipv4=/ipv6= a
// node-bound agent claims when the server cannot read its Node (listed in
// Ignored).
//
// A node-bound agent's ID may be its token's node or pod name: the ID
// routes no dial (identifiers do), it names the link, and one credential
// holds an ID at a time, so either name is as strong. An ID that names
// neither (upstream's agent, whose DaemonSet passes no --agent-id, takes a
// random UUID) is not refused: the agent is registered under the identity
// its token proves, its pod's name (the node's when the token names no
// pod), and routed as the token's node; the ID it asked for stays a label.
func (s *Server) checkIdentity(ctx context.Context, p Principal, id string, ids wire.Identifiers) (string, wire.Identifiers, error) {
	pol := &s.cfg.Identity
	switch {
	case p.Kind == PrincipalToken && p.Node == "" && !pol.IgnoreNodeClaims:
		s.identity.noClaimsOnce.Do(func() {
			s.log.Warn("agent identity binding is off for tokens without node claims: the apiserver's TokenReview named no node (Kubernetes before 1.30, or a token not bound to a pod); such agents may use any ID and identifiers", "agent", id)
		})
	case p.Kind == PrincipalToken && p.Node != "" && !pol.IgnoreNodeClaims:
		if !strings.EqualFold(id, p.Node) && (p.Pod == "" || !strings.EqualFold(id, p.Pod)) {
			id = p.Pod
			if id == "" {
				id = p.Node
			}
		}
		for _, h := range ids.Hosts {
			if !strings.EqualFold(strings.TrimSuffix(h, "."), p.Node) {
				return id, ids, s.identityRefused(identityNodeMismatch, "identifier host=%s is not the node %q the agent's token was issued for", h, p.Node)
			}
		}
		if len(ids.Addrs) > 0 {
			verified, err := s.checkNodeAddrs(ctx, p.Node, ids.Addrs)
			if err != nil {
				return id, ids, err
			}
			if !verified {
				ids = s.dropUnverifiedAddrs(id, p.Node, ids)
			}
		}
	case p.Kind == PrincipalCertificate && pol.CertificateNames:
		if !containsFold(p.Names, id) {
			return id, ids, s.identityRefused(identityCertMismatch, "agent ID %q is not a name in its client certificate", id)
		}
		for _, h := range ids.Hosts {
			if !containsFold(p.Names, strings.TrimSuffix(h, ".")) {
				return id, ids, s.identityRefused(identityCertMismatch, "identifier host=%s is not a name in the agent's client certificate", h)
			}
		}
		for _, a := range ids.Addrs {
			if !slices.Contains(p.Addrs, a.Unmap()) {
				return id, ids, s.identityRefused(identityAddressUnbacked, "identifier %s is not an IP address in the agent's client certificate", addrIdentifier(a))
			}
		}
	}
	if (len(ids.CIDRs) > 0 || ids.DefaultRoute) && !s.trustedForRoutes(p, id) {
		return id, ids, s.identityRefused(identityRouteUntrusted, "cidr= and default-route identifiers are accepted only from agents listed in --route-agents (agent %q is not)", id)
	}
	if s.agents.connectedWithOther(id, p.Credential) {
		return id, ids, s.identityRefused(identityInUse, "agent ID %q is connected with another credential", id)
	}
	return id, ids, nil
}

// boundNode is the node an agent's credential binds it to, the node whose
// dials the node strategy sends it: a token's node claim (the apiserver
// issued the token to a pod on that node), or, when certificate names bind
// IDs, the agent's ID, a name its certificate carries. An agent whose
// credential proves no node serves none: the node strategy never routes by
// what an agent says about itself.
func (s *Server) boundNode(p Principal, id string) string {
	switch {
	case p.Kind == PrincipalToken:
		return p.Node
	case p.Kind == PrincipalCertificate && s.cfg.Identity.CertificateNames && containsFold(p.Names, id):
		return strings.ToLower(id)
	}
	return ""
}

// checkNodeAddrs checks claimed addresses against the node's. verified
// false with no error: the server cannot read the Node (no lookup, or the
// apiserver forbids it), so the addresses are neither backed nor refuted.
func (s *Server) checkNodeAddrs(ctx context.Context, node string, claimed []netip.Addr) (verified bool, err error) {
	lookup := s.cfg.Identity.NodeAddresses
	if lookup == nil {
		return false, nil
	}
	have, err := lookup(ctx, node)
	switch {
	case errors.Is(err, ErrNodesForbidden):
		return false, nil
	case err != nil && wire.StatusCode(err) == http.StatusForbidden:
		return false, s.identityRefused(identityAddressUnbacked, "identifiers ipv4=/ipv6= cannot be backed: %s", wire.ErrMsg(err))
	case err != nil:
		s.warnings.Log(s.log, slog.LevelWarn, "node lookup", "node address lookup failed; agents claiming ipv4=/ipv6= are refused until it works", "node", node, "err", err)
		return false, wire.StatusErrorf(http.StatusServiceUnavailable, "authentication unavailable: the node's addresses could not be read")
	}
	for _, a := range claimed {
		if !slices.Contains(have, a.Unmap()) {
			return false, s.identityRefused(identityAddressUnbacked, "identifier %s is not an address of node %q", addrIdentifier(a), node)
		}
	}
	return true, nil
}

// dropUnverifiedAddrs admits a node-bound agent without the ipv4=/ipv6=
// identifiers the server cannot check, so no dial is routed to it by
// them: counted per agent, the warning naming the fix logged once.
func (s *Server) dropUnverifiedAddrs(id, node string, ids wire.Identifiers) wire.Identifiers {
	s.identity.refused[identityAddressUnverified].Inc()
	s.identity.unverifiedOnce.Do(func() {
		why := "this server has no Node lookup"
		if s.cfg.Identity.NodeAddresses != nil {
			why = "the apiserver answered 403 to reading the Node"
		}
		s.log.Warn("ipv4=/ipv6= identifiers of agents with node-bound tokens are dropped (no dial is routed by them): "+why+"; grant get on nodes to the server's kubeconfig identity (docs/security.md \"Agent identity\") or run with --bind-agent-identity=false", "agent", id, "node", node)
	})
	for _, a := range ids.Addrs {
		ids.Ignored = append(ids.Ignored, addrIdentifier(a)+": cannot be verified against the Node")
	}
	ids.Addrs = nil
	return ids
}

func addrIdentifier(a netip.Addr) string {
	if a.Is4() {
		return "ipv4=" + a.String()
	}
	return "ipv6=" + a.String()
}

func containsFold(list []string, s string) bool {
	for _, v := range list {
		if strings.EqualFold(v, s) {
			return true
		}
	}
	return false
}

// trustedForRoutes reports whether the agent may advertise cidr= and
// default-route. An agent ID in the list is only as strong as the ID's
// binding: a node-bound token or CertificateNames.
func (s *Server) trustedForRoutes(p Principal, id string) bool {
	for _, t := range s.cfg.Identity.RouteAgents {
		switch {
		case t == "*", t == id:
			return true
		case p.Account != "" && t == "serviceaccount:"+p.Account:
			return true
		}
	}
	return false
}

// watchCredential starts the periodic review of a token agent's token.
// The link's end must call endCredential.
func (s *Server) watchCredential(a *agentConn, token string, tlsState tls.ConnectionState) {
	a.cred = &connCredential{tls: tlsState, token: token, expires: a.principal.Expires}
	if a.principal.Kind != PrincipalToken || s.cfg.Identity.Recheck < 0 {
		return
	}
	a.cred.mu.Lock()
	defer a.cred.mu.Unlock()
	s.scheduleReviewLocked(a)
}

func (s *Server) recheckInterval() time.Duration {
	if d := s.cfg.Identity.Recheck; d > 0 {
		return d
	}
	return time.Minute
}

func (s *Server) doubtGrace() time.Duration {
	switch d := s.cfg.Identity.DoubtGrace; {
	case d > 0:
		return d
	case d < 0:
		return 0
	}
	return time.Minute
}

// scheduleReviewLocked arms the next review: after the recheck interval,
// or just after the token expires, or when a doubt's grace ends, if that
// is sooner. The caller holds a.cred.mu.
func (s *Server) scheduleReviewLocked(a *agentConn) {
	if a.cred.ended {
		return
	}
	d := s.recheckInterval()
	if exp := a.cred.expires; !exp.IsZero() {
		d = min(d, time.Until(exp)+time.Second)
	}
	if !a.cred.doubted.IsZero() {
		d = min(d, time.Until(a.cred.doubted.Add(s.doubtGrace())))
	}
	d = max(d, minTokenRefresh)
	a.cred.timer = time.AfterFunc(d, func() { s.goroutineIfOpen(func() { s.reviewLink(a) }) })
}

// endCredential stops a link's reviews.
func (a *agentConn) endCredential() {
	if a.cred == nil {
		return
	}
	a.cred.mu.Lock()
	defer a.cred.mu.Unlock()
	a.cred.ended = true
	if a.cred.timer != nil {
		a.cred.timer.Stop()
	}
}

// reviewLink reviews a live link's latest token again. A refusal with an
// apiserver error (ErrReviewUnsure) is not trusted alone: kube-apiserver
// answers a lookup it could not do (etcd, a webhook) that way, and an
// outage of such answers must not drain the fleet. The first one stops new
// dials to the agent (doubted) and keeps its open tunnels; a pass takes
// dials again; the link is drained and closed once such answers have
// lasted the doubt grace (the review is due then). Any other refusal (a
// clean "not authenticated", 403, a token that now names another pod), or
// a refusal once the token's exp has passed, closes it at once. A review
// that could not be done (503) changes nothing until the next one.
func (s *Server) reviewLink(a *agentConn) {
	ctx, cancel := context.WithTimeout(s.baseCtx, s.cfg.HeaderTimeout)
	p, err := s.authenticate(ctx, AgentCredentials{AgentID: a.id, Token: a.cred.currentToken(), TLS: a.cred.tls})
	cancel()
	switch {
	case err == nil && p.Credential == a.principal.Credential:
		a.cred.mu.Lock()
		a.cred.expires = p.Expires
		s.trustAgainLocked(a)
		s.scheduleReviewLocked(a)
		a.cred.mu.Unlock()
		return
	case err != nil && wire.StatusCode(err) == http.StatusServiceUnavailable:
		s.warnings.Log(s.log, slog.LevelWarn, "review "+a.id, "agent token review failed; the link stays until the next review", "agent", a.id, "err", wire.ErrMsg(err))
		a.cred.mu.Lock()
		s.scheduleReviewLocked(a)
		a.cred.mu.Unlock()
		return
	}
	why := "its token now names another pod"
	if err != nil {
		why = wire.ErrMsg(err)
	}
	a.cred.mu.Lock()
	now, exp, since, grace := time.Now(), a.cred.expires, a.cred.doubted, s.doubtGrace()
	if errors.Is(err, ErrReviewUnsure) && grace > 0 && (exp.IsZero() || now.Before(exp)) {
		switch {
		case since.IsZero():
			a.cred.doubted = now
			a.doubted.Store(true)
			s.scheduleReviewLocked(a)
			a.cred.mu.Unlock()
			s.identity.refused[identityTokenDoubted].Inc()
			s.log.Warn("agent token review refused with an apiserver error: no new dials to the agent until a review passes; its open tunnels stay", "agent", a.id, "remote", a.remote, "reason", why, "doubt_grace", grace)
			return
		case now.Sub(since) < grace:
			s.scheduleReviewLocked(a)
			a.cred.mu.Unlock()
			return
		}
	}
	a.cred.mu.Unlock()
	attrs := []any{"agent", a.id, "remote", a.remote, "reason", why}
	if !since.IsZero() {
		attrs = append(attrs, "doubted_for", now.Sub(since).Round(time.Millisecond))
	}
	s.identity.refused[identityTokenInvalid].Inc()
	s.log.Warn("agent token no longer valid: draining and closing its link", attrs...)
	a.endCredential()
	a.draining.Store(true)
	ctx, cancel = context.WithTimeout(s.baseCtx, revokeGrace)
	defer cancel()
	a.shutdown(ctx)
	a.opener.close()
}

// newToken takes a rotated token an agent sent on its control stream. It
// is reviewed at once (at most one per minTokenRefresh per link) and used
// for the link's next reviews if it is valid and names the same
// credential; otherwise the link keeps the token it has.
func (s *Server) newToken(a *agentConn, token string) {
	if a.cred == nil || a.principal.Kind != PrincipalToken {
		return
	}
	a.cred.mu.Lock()
	if time.Since(a.cred.lastNew) < minTokenRefresh || token == a.cred.token {
		a.cred.mu.Unlock()
		return
	}
	a.cred.lastNew = time.Now()
	a.cred.mu.Unlock()
	ctx, cancel := context.WithTimeout(s.baseCtx, s.cfg.HeaderTimeout)
	p, err := s.authenticate(ctx, AgentCredentials{AgentID: a.id, Token: token, TLS: a.cred.tls})
	cancel()
	if err != nil || p.Credential != a.principal.Credential {
		why := "it names another pod"
		if err != nil {
			why = wire.ErrMsg(err)
		}
		s.warnings.Log(s.log, slog.LevelWarn, "token "+a.id, "agent sent a token that was not accepted; keeping the one it has", "agent", a.id, "reason", why)
		return
	}
	a.cred.mu.Lock()
	a.cred.token, a.cred.expires = token, p.Expires
	s.trustAgainLocked(a)
	a.cred.mu.Unlock()
	s.log.Debug("agent presented a rotated token", "agent", a.id)
}

// trustAgainLocked ends a doubt: a review of the link's token passed, so
// the agent takes dials again. The caller holds a.cred.mu.
func (s *Server) trustAgainLocked(a *agentConn) {
	if a.cred.doubted.IsZero() {
		return
	}
	s.log.Info("agent token review passed again: the agent takes dials again", "agent", a.id, "doubted_for", time.Since(a.cred.doubted).Round(time.Millisecond))
	a.cred.doubted = time.Time{}
	a.doubted.Store(false)
}
