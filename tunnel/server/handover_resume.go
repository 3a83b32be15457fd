package server

// The resume part of the handover: a tunnel a previous image (or an
// agent's restart) paused waits for its agent and goes on (step 5).

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// Resume takes up the tunnels a previous image of this process paused:
// each waits for its agent to log in again (up to resumeWait) and
// continues on a new stream. Call it once the agent listener serves. A tunnel that
// cannot resume is closed, and logged.
//
// A tunnel waiting for its agent is held in the table: a restart that
// comes meanwhile passes it on to the next image as it is (takeHeld). From
// the agent's return until the tunnel is where a handover can pause it
// again, it counts as pending (Server.pending), as an accepted dial does,
// so that a restart waits for it rather than letting the drain close it.
//
// An Unasked connection is served at once, as a new one.
func (s *Server) Resume(paused []*PausedTunnel) {
	h := s.hand
	held := make([]*tunnel, 0, len(paused))
	s.mu.Lock()
	for _, p := range paused {
		if !p.Unasked {
			held = append(held, h.holdLocked(p))
		}
	}
	s.mu.Unlock()
	for _, p := range paused {
		if p.Unasked {
			s.goroutine(func() { h.resumeUnasked(p) })
		}
	}
	for _, ht := range held {
		s.goroutine(func() { h.resumeTunnel(ht) })
	}
}

// resumeUnasked serves a connection the previous image took before its
// client asked for anything, as a new one that has already sent p.Head.
func (h *handover) resumeUnasked(p *PausedTunnel) {
	s := h.s
	c := p.Socket
	c.SetDeadline(time.Time{}) // a pause may have set one
	t := newHTTPTunnel(c)
	t.state, t.handed = tunnelReading, p
	pd := &pendingDial{s: s}
	defer pd.release()
	s.serveFrontendConn(t, pd)
}

// resumeTunnel waits for the agent of ht, a held tunnel, and resumes it
// as a new tunnel once the agent is back.
func (h *handover) resumeTunnel(ht *tunnel) {
	s := h.s
	p := ht.handed
	wait := p.waitFor()
	a := h.waitAgentID(p.Agent, nil, wait)
	s.mu.Lock()
	if ht.state != tunnelHeld || s.shutting {
		// A handover passes it on, or Close drops it.
		s.mu.Unlock()
		return
	}
	ht.moveLocked(tunnelClosed) // the tunnel that resumes it enters below
	if a != nil {
		s.pending.Add(1) // under mu: a shutdown either waits for it or saw it waiting
	}
	s.mu.Unlock()
	if a == nil {
		p.Socket.Close()
		h.resumeFailed(p, resultTimeout, fmt.Errorf("agent not back within %s", wait.Round(time.Millisecond)))
		return
	}
	pd := &pendingDial{s: s}
	pd.v.Store(dialCounted)
	defer pd.release()
	c := p.Socket
	c.SetDeadline(time.Time{}) // a pause may have set one
	if p.GRPC != nil {
		h.resumeGRPC(c, p, pd)
		return
	}
	// The tunnel's own path is that of a new one, so that it parks as
	// shallow (see "Parked stacks" in doc.go).
	t := newHTTPTunnel(c)
	t.handed = p
	s.serveFrontendConn(t, pd)
}

func (h *handover) resumeFailed(p *PausedTunnel, result string, err error) {
	s := h.s
	h.metrics.resumed[result].Inc()
	s.log.Warn("paused tunnel could not be resumed; client connection closed", "addr", p.Addr, "agent", p.Agent, "err", err)
}

// resumeGRPC rebuilds a gRPC front door connection whose call was paused
// and serves it: the call goes on as the one paused, and any call the
// client opens later is served as usual. pd is the resume's count as
// pending.
func (h *handover) resumeGRPC(conn net.Conn, p *PausedTunnel, pd *pendingDial) {
	s := h.s
	if !s.enterGRPCConn() {
		conn.Close()
		return
	}
	c := &grpcConn{s: s, socket: conn, pend: pd}
	stop := context.AfterFunc(s.baseCtx, c.closeSocket)
	defer func() {
		stop()
		c.closeSocket()
		s.leaveGRPCConn()
	}()
	resumed := func(w http.ResponseWriter, r *http.Request) {
		if h.resumeGRPCCall(c, w, r, p) == errHandedOn {
			h2link.Detach(w)
		}
		// errWaiterEnds: the call's waiter ends it (waitGRPC)
	}
	h2conn := grpcLinkConn(conn)
	l, err := h2link.ResumeServer(h2conn, s.grpcLinkConfig(conn, h2conn, 0), p.GRPC.Link, c, resumed)
	if err != nil {
		h.resumeFailed(p, resultFailed, err)
		return
	}
	c.link = l
	l.Serve()
}

// resumeGRPCCall resumes a paused gRPC call: what DIAL_RSP set up is
// rebuilt, the agent is asked for the kept destination, and the tunnel is
// carried as proxyGRPC carries it. If the tunnel cannot resume, the client
// is told as when the destination breaks (CLOSE_RSP with the error).
func (h *handover) resumeGRPCCall(c *grpcConn, w http.ResponseWriter, r *http.Request, p *PausedTunnel) error {
	s := h.s
	c.calls.Add(1)
	s.metrics.grpcConns.Add(1)
	outlives := false // the call goes on after the handler returns: its waiter ends it
	defer func() {
		if !outlives {
			s.grpcCallEnded()
			c.callDone(false, true)
		}
	}()
	t := newGRPCTunnel(c, w, r)
	f := t.front.(*grpcFront)
	f.connectID, t.addr, t.handed, f.resumed = p.GRPC.ConnectID, p.Addr, p, true
	t.act.InheritQuiet(p.Quiet)
	if !s.enter(t) {
		c.pend.release()
		return nil
	}
	defer func() {
		if !outlives {
			s.leave(t)
		}
	}()
	s.initGRPCUpload(t, nil, p.GRPC.Partial)
	if err := h.resumeStream(t); err != nil {
		c.pend.release() // the connection is served on; the tunnel is not
		s.sendGRPC(f.g, grpcwire.Packet{Type: grpcwire.CloseRsp, ConnectID: f.connectID, Error: "tunnel lost in a server restart: " + wire.ErrMsg(err)})
		f.g.finish(grpcOK, "")
		return nil
	}
	code, msg, err := s.carryGRPC(t)
	switch err {
	case errWaiterEnds:
		outlives = true
		return err
	case errHandedOn:
		return err
	}
	f.g.finish(code, msg)
	return nil
}

// resumeStream opens the stream that carries t.handed's bytes through its
// agent, which resumeTunnel saw back; a failure is logged and counted, and
// the upload released.
func (h *handover) resumeStream(t *tunnel) error {
	s := h.s
	p := t.handed
	a := s.agents.byID(p.Agent)
	err, result := errors.New("agent gone again before the tunnel resumed"), resultFailed
	for tries := 0; a != nil; tries++ {
		err = s.roundTrip(t, a, time.Now().Add(s.cfg.DialTimeout), p.Token)
		if !agentLeaving(err) || tries == maxAgentRestarts {
			break
		}
		if a = h.waitAgentID(p.Agent, a, p.waitFor()); a == nil {
			err, result = errors.New("agent restarted and not back while the tunnel could resume"), resultTimeout
		}
	}
	if err != nil {
		t.up.unblock()
		h.resumeFailed(p, result, err)
		return err
	}
	h.metrics.resumed[resultOK].Inc()
	s.log.Debug("tunnel resumed", "addr", p.Addr, "agent", p.Agent, "grpc", p.GRPC != nil)
	return nil
}

// waitAgentID returns the connected agent with id once it is there, or nil
// after wait or once the server shuts down: a shutdown waits for resumes
// (Server.pending), and must not wait for an agent that is not back. An
// agent restarting in place, or the connection not, is not the one
// waited for.
func (h *handover) waitAgentID(id string, not *agentConn, wait time.Duration) *agentConn {
	s := h.s
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		a, changed := s.agents.arrival(id, not)
		if a != nil {
			return a
		}
		if s.isShutting() {
			return nil
		}
		select {
		case <-changed:
		case <-timer.C:
			return nil
		case <-s.baseCtx.Done():
			return nil
		}
	}
}
