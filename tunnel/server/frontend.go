package server

import (
	"bufio"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// httpFront is the client's side of a tunnel on the HTTP CONNECT front
// door: its socket.
type httpFront struct {
	conn net.Conn        // immutable
	raw  syscall.RawConn // immutable: conn's, when it is a plain socket
}

// httpTunnel is a tunnel with its HTTP CONNECT front, in one allocation.
type httpTunnel struct {
	tunnel
	http httpFront
}

// newHTTPTunnel is the tunnel of a frontend connection.
func newHTTPTunnel(conn net.Conn) *tunnel {
	ht := &httpTunnel{http: httpFront{conn: conn, raw: wire.RawSocket(conn)}}
	ht.front = &ht.http
	return &ht.tunnel
}

// closeQuiet closes the client's socket: an idle keep-alive connection
// closed by the server, which the client dials again.
func (f *httpFront) closeQuiet(t *tunnel) {
	f.conn.Close()
	t.endStream()
}

func (f *httpFront) unread() bool { return f.raw != nil && unread(f.raw) }

func (f *httpFront) hangup() net.Conn {
	if _, ok := f.conn.(*net.UnixConn); ok {
		return f.conn
	}
	return nil // TCP peers cannot be told apart this way; mTLS frontends rely on TCP keepalive
}

func (f *httpFront) closeSocket() { f.conn.Close() }

// serveFrontendConn answers one CONNECT request and, on success, carries
// the connection's bytes to and from an agent stream until both sides are
// done or the tunnel moves to the next image; or it resumes a tunnel the
// previous image handed on (t.handed). pd is the dial's count as
// pending, from the head's end until the tunnel is open, where a drain or
// a restart finds it.
func (s *Server) serveFrontendConn(t *tunnel, pd *pendingDial) {
	conn := t.front.(*httpFront).conn
	if !s.enter(t) {
		conn.Close()
		return
	}
	s.metrics.httpConns.Add(1)
	defer func() { // one deferred closure: see "Parked stacks" in doc.go
		if t.body != nil {
			t.endStream()
		}
		s.metrics.httpConns.Add(-1)
		if !s.leave(t) {
			conn.Close()
		}
	}()
	if !s.openFrontendTunnel(t, conn, pd) {
		return
	}
	t.up.start()
	if body, ok := t.body.(*h2link.Body); ok && t.up.callerSends {
		s.carryDirect(t, conn, body, pd)
		return
	}
	pd.release()
	s.carryCopy(t, conn)
}

// openFrontendTunnel reads the CONNECT request, checks the peer, opens a
// stream through an agent, tells the client 200 and moves t to open; for
// a tunnel a previous image handed over, it opens the stream that carries
// it on. On failure it answers the error itself and returns false. It
// returns before the tunnel parks: see "Parked stacks" in doc.go.
func (s *Server) openFrontendTunnel(t *tunnel, conn net.Conn, pd *pendingDial) bool {
	if ok, resumed := s.hand.handedIn(t, conn); resumed {
		return ok
	}
	headDeadline := time.Now().Add(s.cfg.HeaderTimeout)
	conn.SetDeadline(headDeadline)
	lim := &wire.HeadLimiter{R: conn, Remaining: maxConnectHead, Limited: true}
	lim.Seen = s.hand.headSoFar(t)
	lim.Replay = len(lim.Seen)
	br := headReaders.Get().(*bufio.Reader) // back to the pool once drained: see sendBuffered
	br.Reset(lim)
	stop := s.hand.headStarted(t, conn)
	addr, err := wire.ReadConnect(br)
	stop()
	if !s.hand.headRead(t, pd, conn, lim.Seen) {
		return false
	}
	// The head's own bytes, saved while the dial may still move to the next
	// image (dialWaiting); bytes read past it are in br.
	head := lim.Seen[:max(0, len(lim.Seen)-br.Buffered())]
	if lim.Replay == 0 {
		lim.Seen = nil
	}
	if err != nil && wire.StatusCode(err) == http.StatusBadRequest && !time.Now().Before(headDeadline) {
		// net/http reports a line cut short by the deadline as malformed.
		err = wire.StatusErrorf(http.StatusRequestTimeout, "request head not received in time")
	}
	// A gRPC client is told it reached the HTTP CONNECT door, once its
	// peer is admitted (a refused peer gets the plain 400 below).
	if errors.Is(err, wire.ErrHTTP2Preface) && (s.cfg.CheckFrontendPeer == nil || s.cfg.CheckFrontendPeer(conn) == nil) {
		s.metrics.dialFailed(err)
		s.refuseGRPCClient(conn, br)
		return false
	}
	if err != nil {
		s.metrics.dialFailed(err)
		conn.SetWriteDeadline(time.Now().Add(s.cfg.HeaderTimeout))
		wire.WriteStatus(conn, wire.StatusCode(err), wire.ErrMsg(err))
		s.log.Debug("bad CONNECT request", "err", err)
		return false
	}
	// The peer is checked after its request is read: closing a Unix socket
	// with unread data resets it, and the client would never see the 403.
	if s.cfg.CheckFrontendPeer != nil {
		if err := s.cfg.CheckFrontendPeer(conn); err != nil {
			s.metrics.dialFailed(&wire.StatusError{Code: http.StatusForbidden})
			s.warnings.Log(s.log, slog.LevelWarn, "peer", "frontend peer refused", "err", err)
			conn.SetWriteDeadline(time.Now().Add(s.cfg.HeaderTimeout))
			wire.WriteStatus(conn, http.StatusForbidden, wire.ErrMsg(err))
			return false
		}
	}
	lim.Limited = false
	conn.SetDeadline(time.Time{})
	s.metrics.packets.Inc(wire.SegFromClient, grpcwire.DialReq) // a CONNECT request read and its peer admitted

	t.addr = addr
	s.initFrontendUpload(t, conn, br)
	if err := s.open(t); err != nil {
		if failureReason(err) == reasonShutdown && s.hand.dialWaiting(t, conn, head, br) {
			return false
		}
		s.metrics.dialFailed(err)
		if failureReason(err) == reasonFrontendClosed {
			s.metrics.packets.Inc(wire.SegFromClient, grpcwire.DialCls) // the client hung up during the dial
		}
		conn.SetWriteDeadline(time.Now().Add(s.cfg.HeaderTimeout))
		s.metrics.packets.Inc(wire.SegToClient, grpcwire.DialRsp)
		wire.WriteStatus(conn, wire.StatusCode(err), wire.ErrMsg(err))
		s.log.Debug("dial failed", "addr", addr, "err", err)
		return false
	}
	s.metrics.packets.Inc(wire.SegToClient, grpcwire.DialRsp)
	written := time.Now()
	_, err = io.WriteString(conn, wire.ConnectEstablished)
	s.metrics.frontendWrite.ObserveDuration(time.Since(written))
	if err != nil {
		return false
	}
	t.up.packets = wire.PacketCounter{&s.metrics.packets.N[wire.SegFromClient][grpcwire.Data], &s.metrics.packets.N[wire.SegToAgent][grpcwire.Data]}
	t.up.closes = wire.PacketCounter{&s.metrics.packets.N[wire.SegFromClient][grpcwire.CloseReq], &s.metrics.packets.N[wire.SegToAgent][grpcwire.CloseReq]}
	return t.move(tunnelOpen)
}

// initFrontendUpload sets up the upload of a frontend connection whose
// head br has read.
func (s *Server) initFrontendUpload(t *tunnel, conn net.Conn, br *bufio.Reader) {
	t.up.init(br, func() { conn.SetReadDeadline(time.Now()) }, &t.act, s.goroutine)
	t.up.raw = t.front.(*httpFront).raw
	t.up.callerSends = t.up.raw != nil // a link sends it from here: see carryDirect
	t.up.counters = []*atomic.Int64{&s.Stats.BytesToAgent}
}

// carryCopy carries a tunnel whose stream sends the upload itself (an
// upstream agent) or whose client is not a plain socket: this goroutine
// copies what the agent sends to the client.
func (s *Server) carryCopy(t *tunnel, conn net.Conn) {
	// Each write to the client is a DATA Packet received from the agent and
	// sent on to the client.
	to := &wire.PacketWriter{W: conn, C: wire.PacketCounter{&s.metrics.packets.N[wire.SegFromAgent][grpcwire.Data], &s.metrics.packets.N[wire.SegToClient][grpcwire.Data]}, Down: &t.act}
	n, err := wire.CopyStream(to, t.body, nil)
	t.fromAgent(n)
	if err != nil {
		// The agent reset the stream or the client went away: abort both.
		s.metrics.resets.Inc()
		s.metrics.streamErrs.Inc(wire.SegFromAgent, wire.StreamErrorCode(err), grpcwire.Data)
		return
	}
	s.metrics.countEnd()
	// The destination finished sending. Pass the half-close on and wait for
	// the client to finish sending too (or for the agent to stop reading).
	wire.CloseWrite(conn)
	select {
	case <-t.up.done:
	case <-s.baseCtx.Done():
	}
}

// watchDeliveries counts each write of the agent's bytes to the client as
// a DATA Packet and stamps the tunnel's activity toward the client. Cold
// work, apart from carryDirect: see "Parked stacks" in doc.go.
//
//go:noinline
func (s *Server) watchDeliveries(t *tunnel, body *h2link.Body) {
	fromAgent, toClient, act := &s.metrics.packets.N[wire.SegFromAgent][grpcwire.Data], &s.metrics.packets.N[wire.SegToClient][grpcwire.Data], &t.act
	body.OnWrite(func(int) {
		fromAgent.Add(1)
		toClient.Add(1)
		act.Down()
	})
}

// carryDirect carries a tunnel on a link between a plain client socket
// and the stream with this one goroutine: it sends the upload itself while
// the link's read loop writes what the agent sends straight to the socket
// (see sink.go). It releases pd once the delivery is set: only then can
// a handover pause the tunnel (pausable), so only then may a shutdown stop
// waiting for it.
func (s *Server) carryDirect(t *tunnel, conn net.Conn, body *h2link.Body, pd *pendingDial) {
	s.watchDeliveries(t, body)
	down := body.DeliverTo(conn, func(err error) error {
		if t.up.stopping.Load() {
			return err // the socket goes to the next image as it is
		}
		if err != nil {
			conn.SetReadDeadline(time.Now()) // the upload ends too
			return err
		}
		// The destination finished sending: pass the half-close on; the
		// client may still send.
		wire.CloseWrite(conn)
		return nil
	})
	t.down.Store(down)
	pd.release()
	s.hand.opened(t)
	body.SendUpload()
	// The client finished sending (or the stream ended): wait for the
	// destination's end.
	select {
	case <-down.Done():
	case <-s.baseCtx.Done():
		t.endStream()
		<-down.Done()
	}
	n, err := down.Result()
	t.fromAgent(n)
	if err != nil && !t.up.stopping.Load() {
		s.metrics.resets.Inc()
		s.metrics.streamErrs.Inc(wire.SegFromAgent, wire.StreamErrorCode(err), grpcwire.Data)
		return
	}
	s.metrics.countEnd()
}

// maxConnectHead bounds a CONNECT request head; kube-apiserver's is ~50 bytes.
const maxConnectHead = 16 << 10

// headReaders recycles the 4 KiB readers of CONNECT heads, one per dial
// for a head of about fifty bytes. A reader goes back only from the path
// where nothing else can still hold it (the upload has drained it after the
// client was told 200); readers of dials that failed go to the
// collector.
var headReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4096) }}
