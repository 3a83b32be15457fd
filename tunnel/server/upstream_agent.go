package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// Upstream konnectivity agents (the proxy-agent image) speak gRPC on the
// same agent port: TLS with ALPN h2, one bidirectional stream on
// /AgentService/Connect that carries every tunnel of the agent as Packets.
// They are served here so a cluster can move its servers first and its
// DaemonSet later. Each upstream agent has its own reader, so it cannot
// slow other agents or frontends; within one upstream agent, tunnels share
// the one stream (a tunnel whose client does not read stalls the agent's
// other tunnels once the stream window is spent), as with upstream itself.
const agentConnectMethod = "/AgentService/Connect"

// gRPC status codes for refusals on the agent port.
const (
	grpcResourceExhausted = 8
	grpcUnauthenticated   = 16
)

var errUpstreamGone = errors.New("upstream agent stream ended")

// serveUpstreamAgent runs the gRPC server side of one upstream agent
// connection until it ends. pc is the connection's admission: until its
// one login stream is admitted, the connection keeps the header deadline
// and every other stream is refused (see login).
func (s *Server) serveUpstreamAgent(conn net.Conn, tlsState tls.ConnectionState, remote string, pc *pendingConn) {
	var l *h2link.Conn // set before Serve starts any handler
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !pc.beginLogin() {
			// A second stream while the login runs, or any stream after
			// it: upstream agents use one stream per connection.
			grpcTrailersOnly(w, grpcResourceExhausted, "one agent login per connection")
			return
		}
		if !s.serveUpstreamConnect(w, r, tlsState, remote, pc, l) {
			// A refused login ends the connection once its answer is out
			// (the request context ends after the link has sent it): a
			// peer gets one review per connection.
			done := r.Context().Done()
			s.goroutine(func() {
				<-done
				ctx, cancel := context.WithTimeout(s.baseCtx, time.Second)
				defer cancel()
				l.Shutdown(ctx)
				l.Close()
			})
		}
	})
	// One stream carries all the agent's tunnels: a 16 MiB window for it,
	// once admitted; until then the peer may make this end hold little.
	l, err := h2link.NewServer(conn, h2link.Config{
		KeepAlive: s.cfg.KeepAlive, PingTimeout: s.cfg.PingTimeout, MaxConcurrentStreams: 4, StreamWindow: 16 << 20,
		PreAdmitStreamWindow: preAdmitStreamWindow, PreAdmitConnWindow: preAdmitConnWindow,
		BaseContext: s.baseCtx, Spawn: s.goroutine, Batch: wire.BatcherOf(conn),
	}, handler)
	if err != nil {
		s.log.Debug("upstream agent: no HTTP/2 connection", "remote", remote, "err", err)
		conn.Close()
		return
	}
	l.Serve()
	conn.Close()
}

// Receive windows of an upstream agent's connection before its login is
// admitted: the login's request body is empty until the answer, so a
// peer that has not logged in may make the server hold at most these.
const (
	preAdmitStreamWindow = 16 << 10
	preAdmitConnWindow   = 64 << 10
)

// serveUpstreamConnect serves the login stream: it admits the agent, gives
// its connection the full windows, and then carries its tunnels until the
// stream ends. False means the login was refused.
func (s *Server) serveUpstreamConnect(w http.ResponseWriter, r *http.Request, tlsState tls.ConnectionState, remote string, pc *pendingConn, l *h2link.Conn) bool {
	if r.Method != http.MethodPost || r.URL.Path != agentConnectMethod {
		grpcTrailersOnly(w, grpcUnimplemented, fmt.Sprintf("unknown method %s", r.URL.Path))
		return false
	}
	hello := wire.AgentHello{ID: r.Header.Get("agentid"), Identifiers: r.Header.Get("agentidentifiers")}
	if auth := r.Header.Get("Authorization"); auth != "" {
		token, ok := strings.CutPrefix(auth, "Bearer ")
		if !ok {
			grpcTrailersOnly(w, grpcUnauthenticated, "authorization is not a bearer token")
			return false
		}
		hello.Token = strings.TrimSpace(token)
	}
	err := wire.ValidID(hello.ID)
	var principal Principal
	var ids wire.Identifiers
	if err == nil {
		// The stream's context: a reset stream or a closed connection
		// (the header deadline included) cancels the review.
		principal, ids, err = s.admit(r.Context(), &hello, tlsState, remote)
	}
	if err != nil {
		s.Stats.AgentsRefused.Add(1)
		code := grpcUnavailable
		switch wire.StatusCode(err) {
		case http.StatusUnauthorized:
			code = grpcUnauthenticated
		case http.StatusForbidden:
			code = grpcPermissionDenied
		case http.StatusBadRequest:
			code = grpcInvalidArgument
		}
		grpcTrailersOnly(w, code, wire.ErrMsg(err))
		s.logRefusal(hello.ID, remote, err, "protocol", "grpc")
		return false
	}
	if !pc.admit() {
		return true // the header deadline came first: the connection is closed
	}
	l.RaiseWindows()

	h := w.Header()
	h.Set("Content-Type", "application/grpc")
	h.Set("serverid", s.cfg.ID)
	h.Set("servercount", strconv.Itoa(s.cfg.Count))
	w.WriteHeader(http.StatusOK)
	g := &grpcStream{w: w, flush: wire.FlusherOf(w)}
	g.flush()

	ua := &upstreamAgent{
		s:       s,
		link:    l,
		out:     g,
		pending: map[int64]chan dialAnswer{},
		conns:   map[int64]*upstreamTunnel{},
		done:    make(chan struct{}),
		stop:    make(chan struct{}),
	}
	a := &agentConn{id: hello.ID, claimedID: hello.Claimed, ids: ids, remote: remote, since: time.Now(), opener: ua, stopControl: func() {}, principal: principal, node: s.boundNode(principal, hello.ID), credKey: credKey(principal, remote)}
	ua.agent = a
	defer a.endCredential()
	if err := s.register(a, hello.Token, tlsState); err != nil {
		if errors.Is(err, errAgentLate) {
			g.finish(grpcUnavailable, "server is shutting down")
		} else {
			g.finish(grpcPermissionDenied, "agent ID is connected with another credential")
		}
		s.log.Info("agent refused: "+err.Error(), "agent", a.id, "remote", remote, "protocol", "grpc")
		return false
	}

	readDone := make(chan error, 1)
	go func() { readDone <- ua.readLoop(r.Body) }()
	// Logged once the agent is served.
	if !a.quiet.Load() {
		s.log.Info("agent connected", append(a.claimedAttr(), "remote", remote, "protocol", "grpc", "identifiers", hello.Identifiers, "routed_by", ids.String(), "agents", s.agents.len())...)
	}
	var why error
	select {
	case why = <-readDone:
	case <-ua.stop:
	case <-s.baseCtx.Done():
	}
	s.agents.remove(a)
	ua.close()
	r.Body.Close()
	if why == nil {
		select {
		case why = <-readDone:
		case <-time.After(time.Second):
		}
	}
	g.finish(grpcOK, "")
	if !a.quiet.Load() {
		s.log.Info("agent disconnected", "agent", a.id, "remote", remote, "protocol", "grpc", "err", why, "agents", s.agents.len())
	}
	return true
}

// upstreamAgent is the server's view of one upstream agent's stream, and
// what opens its tunnels (its agentConn's tunnelOpener).
// Its mu is a leaf: nothing else is locked under it, and the read loop
// (readLoop) is the only goroutine that delivers the agent's packets.
type upstreamAgent struct {
	// Immutable.
	s     *Server
	agent *agentConn
	link  *h2link.Conn  // the agent's connection (nil in index tests); a stalled one takes no dial
	out   *grpcStream   // its own lock: the packets written to the agent
	done  chan struct{} // closed by close
	stop  chan struct{} // closed, once by stopOnce, to end the stream: after a drain, or by close

	mu       sync.Mutex
	pending  map[int64]chan dialAnswer // guarded by mu: dials waiting for DIAL_RSP, by random
	conns    map[int64]*upstreamTunnel // guarded by mu: open tunnels, by connect ID
	closed   bool                      // guarded by mu
	stopping bool                      // guarded by mu: shutting down, no new dials
	stopOnce sync.Once
	wg       sync.WaitGroup // upload goroutines; close waits for them
}

// upstreamTunnel is one tunnel through an upstream agent: one connect ID
// on its stream, the body of the tunnel's answer.
type upstreamTunnel struct {
	// Immutable once in upstreamAgent.conns.
	ua     *upstreamAgent
	id     int64
	pr     *io.PipeReader // the agent's bytes, read by the tunnel
	pw     *io.PipeWriter // written by the agent's read loop
	upload io.ReadCloser  // the client's bytes, sent by sendUpload

	closeOnce sync.Once
	agentDone atomic.Bool // the agent reported the end (CLOSE_RSP): no CLOSE_REQ is owed
}

// takesNew reports whether the agent takes a new tunnel: its stream is
// not closed or stopping, and its connection not stalled.
func (ua *upstreamAgent) takesNew() bool {
	ua.mu.Lock()
	defer ua.mu.Unlock()
	return !ua.closed && !ua.stopping && (ua.link == nil || !ua.link.Stalled())
}

// readLoop handles the agent's packets until the stream ends.
func (ua *upstreamAgent) readLoop(body io.Reader) error {
	var buf []byte
	for {
		var msg []byte
		var err error
		if msg, buf, err = grpcwire.ReadMessage(body, buf, grpcwire.MaxMessageLen); err != nil {
			return err
		}
		p, err := grpcwire.Decode(msg)
		if err != nil {
			return fmt.Errorf("bad packet from agent: %w", err)
		}
		switch p.Type {
		case grpcwire.DialRsp:
			ua.dialAnswered(p)
		case grpcwire.Data:
			ua.mu.Lock()
			c := ua.conns[p.ConnectID]
			ua.mu.Unlock()
			if c == nil {
				ua.out.send(grpcwire.Packet{Type: grpcwire.CloseReq, ConnectID: p.ConnectID}) // unknown: tell it to drop it
				continue
			}
			if len(p.Data) > 0 {
				// Blocks while this tunnel's client does not read: the
				// stream is shared, as upstream's design has it.
				if _, err := c.pw.Write(p.Data); err != nil {
					c.close(false)
				}
				ua.s.Stats.BytesFromAgent.Add(int64(len(p.Data)))
				ua.agent.bytesFrom.Add(int64(len(p.Data)))
			}
		case grpcwire.CloseRsp:
			ua.mu.Lock()
			c := ua.conns[p.ConnectID]
			ua.mu.Unlock()
			if c != nil {
				c.endFromAgent(p.Error)
			}
		case grpcwire.DialCls:
			ua.mu.Lock()
			ch := ua.pending[p.Random]
			delete(ua.pending, p.Random)
			ua.mu.Unlock()
			if ch != nil {
				ch <- dialAnswer{err: "the agent closed the dial"}
			}
		case grpcwire.Drain:
			// Preferred last, its idle tunnels closed, as for our own agents.
			ua.s.log.Info("agent draining: new dials prefer other agents; its idle tunnels close at quiet moments", "agent", ua.agent.id, "protocol", "grpc")
			ua.s.agentDraining(ua.agent, agentDrainAssumed)
		}
	}
}

// dialAnswered takes a DIAL_RSP. A connect ID names one tunnel for as long
// as the agent holds it: an answer that names one in use (or none) fails
// its dial and does not touch the tunnel that holds the ID, so every
// tunnel stays in conns, and close ends them all. The agent is not told:
// a CLOSE_REQ for that ID would end the other tunnel.
func (ua *upstreamAgent) dialAnswered(p grpcwire.Packet) {
	ua.mu.Lock()
	ch := ua.pending[p.Random]
	delete(ua.pending, p.Random)
	_, inUse := ua.conns[p.ConnectID]
	refused := ch != nil && p.Error == "" && (inUse || p.ConnectID == 0)
	ans := dialAnswer{err: p.Error}
	switch {
	case ch == nil || p.Error != "":
	case refused:
		ans.err = fmt.Sprintf("the agent answered the dial with connect ID %d, which is not free (0, or a tunnel's that is open)", p.ConnectID)
	case ua.closed:
		// Its tunnels have all ended: no tunnel, and roundTrip fails.
	default:
		// Registered before the answer is delivered, so DATA that follows
		// the DIAL_RSP at once has somewhere to go.
		pr, pw := io.Pipe()
		ans.c = &upstreamTunnel{ua: ua, id: p.ConnectID, pr: pr, pw: pw}
		ua.conns[p.ConnectID] = ans.c
	}
	ua.mu.Unlock()
	if refused {
		ua.s.warnings.Log(ua.s.log, slog.LevelWarn, "connect ID "+ua.agent.id, "upstream agent answered a dial with a connect ID that is not free: the dial fails", "agent", ua.agent.id, "connect_id", p.ConnectID)
	}
	switch {
	case ch == nil && p.Error == "" && p.ConnectID != 0 && !inUse:
		// The dial was given up (timeout, client gone): free the agent's side.
		ua.out.send(grpcwire.Packet{Type: grpcwire.CloseReq, ConnectID: p.ConnectID})
	case ch != nil:
		ch <- ans
	}
}

// dialAnswer is what a dial waiting for its DIAL_RSP gets: its tunnel,
// or why there is none.
type dialAnswer struct {
	c   *upstreamTunnel
	err string
}

// roundTrip is the upstream-agent counterpart of an HTTP/2 CONNECT stream:
// DIAL_REQ, wait for DIAL_RSP, then DATA both ways.
func (ua *upstreamAgent) roundTrip(req *http.Request) (*http.Response, error) {
	random := rand.Int64N(1<<62) + 1
	ch := make(chan dialAnswer, 1)
	ua.mu.Lock()
	if ua.closed {
		ua.mu.Unlock()
		return nil, errUpstreamGone
	}
	ua.pending[random] = ch
	ua.mu.Unlock()
	if err := ua.out.send(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: req.Host, Random: random}); err != nil {
		ua.forget(random)
		return nil, fmt.Errorf("send DIAL_REQ: %w", err)
	}
	var ans dialAnswer
	select {
	case ans = <-ch:
	case <-req.Context().Done():
		ua.forget(random)
		select {
		case ans = <-ch: // answered meanwhile: its tunnel has no one to serve
			if ans.c != nil {
				ans.c.close(true)
			}
		default:
			ua.out.send(grpcwire.Packet{Type: grpcwire.DialCls, Random: random})
		}
		return nil, req.Context().Err()
	case <-ua.done:
		return nil, errUpstreamGone
	}
	if ans.err != "" {
		return &http.Response{StatusCode: http.StatusBadGateway, Body: io.NopCloser(strings.NewReader(ans.err))}, nil
	}
	c := ans.c
	if c == nil {
		return nil, errUpstreamGone
	}
	c.upload = req.Body
	ua.wg.Add(1)
	go func() {
		defer ua.wg.Done()
		c.sendUpload()
	}()
	return &http.Response{StatusCode: http.StatusOK, Body: c}, nil
}

// probe asks the agent's connection for a sign of life (h2link.Probe);
// its end ends the stream, and with it every dial waiting on it.
func (ua *upstreamAgent) probe(since time.Time, wait time.Duration) {
	if ua.link != nil {
		ua.link.Probe(since, wait)
	}
}

func (ua *upstreamAgent) forget(random int64) {
	ua.mu.Lock()
	delete(ua.pending, random)
	ua.mu.Unlock()
}

// sendUpload turns the client's bytes into DATA packets. Upstream's
// protocol has no half-close, so the client's end closes the tunnel.
func (c *upstreamTunnel) sendUpload() {
	bp := wire.LargeBufs.Get().(*[]byte)
	defer wire.LargeBufs.Put(bp)
	for {
		n, err := c.upload.Read(*bp)
		if n > 0 {
			if serr := c.ua.out.send(grpcwire.Packet{Type: grpcwire.Data, ConnectID: c.id, Data: (*bp)[:n]}); serr != nil {
				c.close(false)
				return
			}
		}
		if err != nil {
			c.close(true)
			return
		}
	}
}

func (c *upstreamTunnel) Read(p []byte) (int, error) { return c.pr.Read(p) }

// Close is the server ending the tunnel (client gone or reset).
func (c *upstreamTunnel) Close() error {
	c.close(true)
	return nil
}

// close ends the tunnel once; tellAgent sends CLOSE_REQ so the agent
// closes its destination connection.
func (c *upstreamTunnel) close(tellAgent bool) {
	c.closeOnce.Do(func() {
		c.ua.forgetTunnel(c)
		if tellAgent && !c.agentDone.Load() {
			c.ua.out.send(grpcwire.Packet{Type: grpcwire.CloseReq, ConnectID: c.id})
		}
		c.pw.CloseWithError(errUpstreamGone)
		c.pr.Close()
		if c.upload != nil {
			c.upload.Close()
		}
	})
}

// forgetTunnel takes c out of conns, freeing its connect ID.
func (ua *upstreamAgent) forgetTunnel(c *upstreamTunnel) {
	ua.mu.Lock()
	if ua.conns[c.id] == c {
		delete(ua.conns, c.id)
	}
	ua.mu.Unlock()
}

// endFromAgent is the agent's CLOSE_RSP: the destination is done.
func (c *upstreamTunnel) endFromAgent(errText string) {
	c.agentDone.Store(true)
	c.ua.forgetTunnel(c)
	if errText != "" {
		c.pw.CloseWithError(errors.New(errText))
	} else {
		c.pw.Close() // EOF after what was delivered
	}
}

// close ends every tunnel and pending dial of the agent, and its stream.
func (ua *upstreamAgent) close() {
	defer ua.stopOnce.Do(func() { close(ua.stop) })
	ua.mu.Lock()
	if ua.closed {
		ua.mu.Unlock()
		return
	}
	ua.closed = true
	conns := make([]*upstreamTunnel, 0, len(ua.conns))
	for _, c := range ua.conns {
		conns = append(conns, c)
	}
	ua.mu.Unlock()
	close(ua.done)
	for _, c := range conns {
		c.close(false)
	}
	ua.wg.Wait()
}

// shutdown stops new dials, waits for the agent's tunnels to end (or
// ctx), then ends the stream; upstream agents then reconnect.
func (ua *upstreamAgent) shutdown(ctx context.Context) {
	ua.mu.Lock()
	ua.stopping = true
	ua.mu.Unlock()
	for ctx.Err() == nil {
		ua.mu.Lock()
		n := len(ua.conns) + len(ua.pending)
		ua.mu.Unlock()
		if n == 0 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	ua.stopOnce.Do(func() { close(ua.stop) })
}
