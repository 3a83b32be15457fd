package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// Dial-failure reasons, also used as metric labels.
const (
	reasonNoAgent        = "no_agent"
	reasonErrorResponse  = "error_response"
	reasonDialTimeout    = "backend_dial_timeout"
	reasonFrontendClosed = "frontend_close"
	reasonBadRequest     = "bad_request"
	reasonForbidden      = "forbidden"
	reasonBackendClosed  = "backend_close"
	reasonShutdown       = "shutdown"
	reasonNoFD           = "too_many_open_files"
	reasonStalledBudget  = "stalled_budget"
)

// failureReason names why a dial failed, for the dial_failure_count metric.
func failureReason(err error) string {
	var se *wire.StatusError
	if !errors.As(err, &se) {
		return reasonBackendClosed // the agent connection broke mid-dial
	}
	if se.Reason != "" {
		return se.Reason
	}
	switch se.Code {
	case http.StatusBadRequest, http.StatusMethodNotAllowed, http.StatusRequestTimeout, http.StatusRequestHeaderFieldsTooLarge:
		return reasonBadRequest
	case http.StatusForbidden:
		return reasonForbidden
	case http.StatusGatewayTimeout:
		return reasonDialTimeout
	}
	return reasonErrorResponse
}

// open picks an agent and opens t's CONNECT stream to t.addr through it.
// It returns once the agent has dialled the destination, or with a
// *StatusError. A dial that meets a connection that died before the agent
// answered is retried on another agent, within the same deadline: the
// agent's side of a dial it may have begun ends with its connection, so
// nothing is lost. A dial that waits on a quiet connection probes it
// (dialProbe), so a connection that died silently is found while the
// dial can still go elsewhere.
func (s *Server) open(t *tunnel) error {
	if q := s.queued.Load(); q > s.cfg.StalledBudget {
		return wire.StatusErrorf(http.StatusServiceUnavailable, "server memory budget for stalled tunnels used up (%d MiB queued for clients that do not read)", q>>20).WithReason(reasonStalledBudget)
	}
	start := time.Now()
	s.metrics.pending.Add(1)
	defer s.metrics.pending.Add(-1)
	host := hostOf(t.addr)
	deadline := time.Now().Add(s.cfg.DialTimeout)
	tried := map[*agentConn]bool{}
	for attempt := 0; ; attempt++ {
		a, err := s.waitAgent(host, tried, &t.up)
		if err != nil {
			return err
		}
		err = s.roundTrip(t, a, deadline, "")
		if err == nil {
			s.metrics.dialDuration.ObserveDuration(time.Since(start))
			return nil
		}
		var se *wire.StatusError
		if errors.As(err, &se) || attempt >= 2 || time.Now().After(deadline) {
			return err
		}
		tried[a] = true
		s.log.Debug("dial retried on another agent", "addr", t.addr, "agent", a.id, "err", err)
	}
}

// waitAgent returns an agent for host, waiting up to AgentWait for one to
// connect. It gives up early if the client goes away.
func (s *Server) waitAgent(host string, exclude map[*agentConn]bool, up *upload) (*agentConn, error) {
	maxStreams := int64(s.cfg.MaxStreamsPerAgent)
	d := dest{host: host}
	var timer *time.Timer
	leaving, last := s.leaving.Done(), false
	for {
		changed := s.agents.waitChan()
		if s.nodeRank >= 0 {
			d.node, d.mapLoaded = s.cfg.NodeOf(host) // again on each wake: the map follows the apiserver
		}
		if a, used := s.agents.pick(d, s.cfg.Strategies, maxStreams, exclude); a != nil {
			if timer != nil {
				timer.Stop()
			}
			s.countNodeRoute(used, a)
			return a, nil
		}
		if last {
			// A leaving server admits no agent: none will come for this
			// dial here (a handover passes it on: dialWaiting).
			return nil, wire.StatusErrorf(http.StatusServiceUnavailable, "server shutting down: no agent available for %s", host).WithReason(reasonShutdown)
		}
		if timer == nil {
			timer = time.NewTimer(s.cfg.AgentWait)
			defer timer.Stop()
		}
		select {
		case <-leaving:
			last = true // one more look: the agents it has still take dials
		case <-changed:
		case <-timer.C:
			s.countNodeRoute("", nil)
			return nil, wire.StatusErrorf(http.StatusServiceUnavailable, "no agent available for %s: waited %s%s", host, s.cfg.AgentWait, s.nodeRouteWhy(d)).WithReason(reasonNoAgent)
		case <-up.clientGone:
			return nil, wire.StatusErrorf(http.StatusServiceUnavailable, "client closed the connection while waiting for an agent").WithReason(reasonFrontendClosed)
		case <-s.baseCtx.Done():
			return nil, wire.StatusErrorf(http.StatusServiceUnavailable, "server shutting down").WithReason(reasonShutdown)
		}
	}
}

// Results of the node strategy, the labels of node_route_total.
const (
	nodeRouted      = "routed"         // the agent bound to the owning node took the dial
	nodeFellThrough = "fallen_through" // no such agent; a later strategy found one
	nodeRefused     = "refused"        // no such agent, and no later strategy found one: 503
)

// countNodeRoute counts what the node strategy did for a dial that found
// agent a by strategy used (nil and "": none found). A dial that an
// earlier strategy routed never asked the node strategy.
func (s *Server) countNodeRoute(used Strategy, a *agentConn) {
	if s.nodeRank < 0 {
		return
	}
	switch {
	case used == StrategyNode:
		s.metrics.nodeRoutes[nodeRouted].Inc()
	case a == nil:
		s.metrics.nodeRoutes[nodeRefused].Inc()
	case slices.Index(s.cfg.Strategies, used) > s.nodeRank:
		s.metrics.nodeRoutes[nodeFellThrough].Inc()
	}
}

// nodeRouteWhy says why the node strategy found no agent, for a 503.
func (s *Server) nodeRouteWhy(d dest) string {
	switch {
	case s.nodeRank < 0:
		return ""
	case d.node == "" && !d.mapLoaded:
		return "; node strategy: the server has not read the apiserver's Nodes and EndpointSlices yet (its log says why: apiserver unreachable, or RBAC missing)"
	case d.node == "":
		return fmt.Sprintf("; node strategy: no node the apiserver lists owns %s", d.host)
	}
	return fmt.Sprintf("; node strategy: no agent bound to node %q (which owns %s) is connected", d.node, d.host)
}

// dialProbe is when a dial still unanswered probes its agent's
// connection, and how long the probe's PING may go unanswered. The probe
// does nothing when the connection read anything since the dial was sent
// (an agent that is there and slow to dial); otherwise a connection that
// answers the PING, or sends anything, within wait is there, and one that
// does not is closed as dead and the dial retried on
// another agent (open) with what is left of DialTimeout: after a fifth of
// it (at most a second) and within half of it (at most PingTimeout), a
// silently dead connection costs a dial at most 0.7 of DialTimeout. A
// live connection answers a PING within a round trip.
func (s *Server) dialProbe() (after, wait time.Duration) {
	return min(time.Second, s.cfg.DialTimeout/5), min(s.cfg.PingTimeout, s.cfg.DialTimeout/2)
}

// roundTrip sends t's CONNECT stream to one agent and waits for its
// answer; on success t is established through a. The request context
// lives as long as the tunnel, so the dial deadline is a timer that
// cancels it only while the answer is outstanding. A token asks the agent
// for the destination connection it holds under it (handover.go) instead
// of a new one.
func (s *Server) roundTrip(t *tunnel, a *agentConn, deadline time.Time, token string) error {
	addr, up := t.addr, &t.up
	ctx, cancel := context.WithCancel(s.baseCtx)
	var why atomic.Value // string: why ctx was cancelled before the answer
	timer := time.AfterFunc(time.Until(deadline), func() { why.Store(reasonDialTimeout); cancel() })
	up.cancelOnGone(func() { why.Store(reasonFrontendClosed); cancel() })

	body := up.attempt()
	req := &http.Request{
		Method: http.MethodConnect,
		URL:    &url.URL{Host: addr},
		Host:   addr,
		Header: make(http.Header),
		Body:   body,
	}
	if token != "" {
		req.Header.Set(wire.HdrResumeToken, token)
	}
	req = req.WithContext(ctx)
	a.tunnels.Add(1)
	s.metrics.packets.Inc(wire.SegToAgent, grpcwire.DialReq)
	var probe *time.Timer
	if token == "" { // a resume has no other agent to go to
		sent := time.Now()
		after, wait := s.dialProbe()
		probe = time.AfterFunc(after, func() { a.opener.probe(sent, wait) })
	}
	resp, err := a.opener.roundTrip(req)
	if probe != nil {
		probe.Stop()
	}
	timer.Stop()
	up.cancelOnGone(nil)
	if err != nil {
		if why.Load() == reasonFrontendClosed {
			s.metrics.packets.Inc(wire.SegToAgent, grpcwire.DialCls) // RST_STREAM before the answer
		} else {
			s.metrics.streamErrs.Inc(wire.SegToAgent, wire.StreamErrorCode(err), grpcwire.DialReq)
		}
		body.abandon()
		a.tunnels.Add(-1)
		cancel()
		switch why.Load() {
		case reasonDialTimeout:
			return wire.StatusErrorf(http.StatusGatewayTimeout, "dial %s through agent %s: no answer within %s", addr, a.id, s.cfg.DialTimeout).WithReason(reasonDialTimeout)
		case reasonFrontendClosed:
			return wire.StatusErrorf(http.StatusServiceUnavailable, "client closed the connection during the dial").WithReason(reasonFrontendClosed)
		}
		return fmt.Errorf("dial %s through agent %s: %w", addr, a.id, err)
	}
	s.metrics.packets.Inc(wire.SegFromAgent, grpcwire.DialRsp)
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		resp.Body.Close()
		body.abandon()
		a.tunnels.Add(-1)
		cancel()
		if token != "" && resp.Header.Get(wire.HdrAgentRestarting) != "" {
			return fmt.Errorf("agent %s: %w", a.id, errAgentRestarting)
		}
		code := resp.StatusCode
		if code != http.StatusGatewayTimeout && code != http.StatusForbidden && code != http.StatusBadRequest {
			code = http.StatusBadGateway
		}
		return wire.StatusErrorf(code, "agent %s: %s", a.id, strings.TrimSpace(wire.CleanErr(errors.New(strings.TrimSpace(string(msg))))))
	}
	t.established(a, resp.Body, cancel)
	return nil
}
