package tunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// stream is one open tunnel through an agent.
type stream struct {
	agent   *agentConn
	body    io.ReadCloser
	cancel  context.CancelFunc
	once    sync.Once
	since   time.Time
	metrics *serverMetrics
}

// close ends the tunnel (RST_STREAM if it is still open); safe to repeat.
func (st *stream) close() {
	st.once.Do(func() {
		st.body.Close()
		st.cancel()
		st.agent.streams.Add(-1)
		st.metrics.established.Add(-1)
		st.metrics.connDuration.ObserveDuration(time.Since(st.since))
	})
}

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
)

// failureReason names why a dial failed, for the dial_failure_count metric.
func failureReason(err error) string {
	var se *StatusError
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

func errMsg(err error) string {
	var se *StatusError
	if errors.As(err, &se) {
		return se.Msg
	}
	return err.Error()
}

// open picks an agent and opens a CONNECT stream to addr through it. It
// returns once the agent has dialled the destination, or with a *StatusError.
// A dial that meets a connection that died before the agent answered is
// retried on another agent: nothing was sent, so nothing is lost.
func (s *Server) open(addr string, up *upload) (*stream, error) {
	start := time.Now()
	s.metrics.pending.Add(1)
	defer s.metrics.pending.Add(-1)
	host := hostOf(addr)
	deadline := time.Now().Add(s.cfg.DialTimeout)
	tried := map[*agentConn]bool{}
	for attempt := 0; ; attempt++ {
		a, err := s.waitAgent(host, tried, up)
		if err != nil {
			return nil, err
		}
		st, err := s.roundTrip(a, addr, up, deadline, "")
		if err == nil {
			s.established(st, a, up)
			s.metrics.dialDuration.ObserveDuration(time.Since(start))
			return st, nil
		}
		var se *StatusError
		if errors.As(err, &se) || attempt >= 2 || time.Now().After(deadline) {
			return nil, err
		}
		tried[a] = true
		s.log.Debug("dial retried on another agent", "addr", addr, "agent", a.id, "err", err)
	}
}

// established counts a tunnel the agent answered.
func (s *Server) established(st *stream, a *agentConn, up *upload) {
	st.since, st.metrics = time.Now(), s.metrics
	up.counters = append(up.counters, &a.bytesTo) // read only after start
	s.metrics.established.Add(1)
}

// waitAgent returns an agent for host, waiting up to AgentWait for one to
// connect. It gives up early if the client goes away.
func (s *Server) waitAgent(host string, exclude map[*agentConn]bool, up *upload) (*agentConn, error) {
	maxStreams := int64(s.cfg.MaxStreamsPerAgent)
	var timer *time.Timer
	for {
		changed := s.agents.waitChan()
		if a := s.agents.pick(host, s.cfg.Strategies, maxStreams, exclude); a != nil {
			if timer != nil {
				timer.Stop()
			}
			return a, nil
		}
		if timer == nil {
			timer = time.NewTimer(s.cfg.AgentWait)
			defer timer.Stop()
		}
		select {
		case <-changed:
		case <-timer.C:
			return nil, statusErrorf(http.StatusServiceUnavailable, "no agent available for %s: waited %s", host, s.cfg.AgentWait).withReason(reasonNoAgent)
		case <-up.clientGone:
			return nil, statusErrorf(http.StatusServiceUnavailable, "client closed the connection while waiting for an agent").withReason(reasonFrontendClosed)
		case <-s.baseCtx.Done():
			return nil, statusErrorf(http.StatusServiceUnavailable, "server shutting down").withReason(reasonShutdown)
		}
	}
}

// roundTrip sends the CONNECT stream to one agent and waits for its answer.
// The request context lives as long as the tunnel, so the dial deadline is a
// timer that cancels it only while the answer is outstanding. A resume
// token asks the agent for the destination connection it holds under it
// (handover.go) instead of a new one.
func (s *Server) roundTrip(a *agentConn, addr string, up *upload, deadline time.Time, resume string) (*stream, error) {
	ctx, cancel := context.WithCancel(s.baseCtx)
	var why atomic.Value // string: why ctx was cancelled before the answer
	timer := time.AfterFunc(time.Until(deadline), func() { why.Store(reasonDialTimeout); cancel() })
	stopGone := context.AfterFunc(up.clientGoneCtx, func() { why.Store(reasonFrontendClosed); cancel() })

	body := up.attempt()
	req := &http.Request{
		Method: http.MethodConnect,
		URL:    &url.URL{Host: addr},
		Host:   addr,
		Header: make(http.Header),
		Body:   body,
	}
	if resume != "" {
		req.Header.Set(hdrResumeToken, resume)
	}
	req = req.WithContext(ctx)
	a.streams.Add(1)
	s.metrics.packets.inc(segToAgent, grpcwire.DialReq)
	resp, err := a.roundTrip(req)
	timer.Stop()
	stopGone()
	if err != nil {
		if why.Load() == reasonFrontendClosed {
			s.metrics.packets.inc(segToAgent, grpcwire.DialCls) // RST_STREAM before the answer
		} else {
			s.metrics.streamErrs.inc(segToAgent, streamErrorCode(err), grpcwire.DialReq)
		}
		body.abandon()
		a.streams.Add(-1)
		cancel()
		switch why.Load() {
		case reasonDialTimeout:
			return nil, statusErrorf(http.StatusGatewayTimeout, "dial %s through agent %s: no answer within %s", addr, a.id, s.cfg.DialTimeout).withReason(reasonDialTimeout)
		case reasonFrontendClosed:
			return nil, statusErrorf(http.StatusServiceUnavailable, "client closed the connection during the dial").withReason(reasonFrontendClosed)
		}
		return nil, fmt.Errorf("dial %s through agent %s: %w", addr, a.id, err)
	}
	s.metrics.packets.inc(segFromAgent, grpcwire.DialRsp)
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		resp.Body.Close()
		body.abandon()
		a.streams.Add(-1)
		cancel()
		code := resp.StatusCode
		if code != http.StatusGatewayTimeout && code != http.StatusForbidden && code != http.StatusBadRequest {
			code = http.StatusBadGateway
		}
		return nil, statusErrorf(code, "agent %s: %s", a.id, strings.TrimSpace(cleanErr(errors.New(strings.TrimSpace(string(msg))))))
	}
	return &stream{agent: a, body: resp.Body, cancel: cancel}, nil
}
