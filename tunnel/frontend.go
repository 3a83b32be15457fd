package tunnel

import (
	"bufio"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// serveFrontendConn answers one CONNECT request and, on success, carries the
// connection's bytes to and from an agent stream until both sides are done
// or a handover pauses the tunnel; or it carries on a tunnel a previous
// image paused (see openFrontendTunnel). release ends the dial's count as
// pending once the tunnel is where a drain or a handover finds it.
func (s *Server) serveFrontendConn(conn net.Conn, release func()) {
	if !s.trackFrontend(conn, true) {
		conn.Close()
		return
	}
	s.Stats.FrontendOpen.Add(1)
	s.metrics.httpConns.Add(1)
	defer func() {
		s.metrics.httpConns.Add(-1)
		s.Stats.FrontendOpen.Add(-1)
		s.trackFrontend(conn, false)
		conn.Close()
	}()
	st, up := s.openFrontendTunnel(conn, release)
	if st == nil {
		return
	}
	defer st.close()
	s.watchTunnel(conn, st, up)
	defer s.unwatchTunnel(conn, up)
	up.start()
	if body, ok := st.body.(*h2link.Body); ok && up.callerSends {
		s.carryDirect(conn, st, up, body, release)
		return
	}
	release()
	s.carryCopy(conn, st, up)
}

// watchTunnel registers an open tunnel with the sweeper (its client hung
// up) and with a drain (a quiet moment to close it) until unwatchTunnel.
// Cold work, apart from serveFrontendConn: see "Parked stacks" in doc.go.
//
//go:noinline
func (s *Server) watchTunnel(conn net.Conn, st *stream, up *upload) {
	s.hangups.add(conn, func() {
		s.log.Debug("client closed its socket; ending the tunnel")
		st.close()
		conn.Close()
	})
	s.addQuiet(&quietTunnel{quiet: drainQuiet, act: &up.act, raw: up.raw, conn: conn, st: st, up: up, closeQuiet: func() {
		conn.Close()
		st.close()
	}})
}

func (s *Server) unwatchTunnel(conn net.Conn, up *upload) {
	s.hangups.remove(conn)
	s.removeQuiet(&up.act)
}

// openFrontendTunnel reads the CONNECT request, checks the peer, opens a
// stream through an agent and tells the client 200; for a connection a
// previous image paused (Resume), it opens the stream that resumes it. On failure it answers
// the error itself and returns nil. It returns before the tunnel parks:
// see "Parked stacks" in doc.go.
func (s *Server) openFrontendTunnel(conn net.Conn, release func()) (*stream, *upload) {
	if s.resuming.Load() > 0 {
		if p := s.takeResume(conn); p != nil {
			return s.openResumed(conn, p)
		}
	}
	headDeadline := time.Now().Add(s.cfg.HeaderTimeout)
	conn.SetDeadline(headDeadline)
	lim := &headLimiter{r: conn, remaining: maxConnectHead, limited: true}
	br := headReaders.Get().(*bufio.Reader) // back to the pool once drained: see sendBuffered
	br.Reset(lim)
	addr, err := readConnect(br)
	if err != nil && StatusCode(err) == http.StatusBadRequest && !time.Now().Before(headDeadline) {
		// net/http reports a line cut short by the deadline as malformed.
		err = statusErrorf(http.StatusRequestTimeout, "request head not received in time")
	}
	if err != nil {
		s.Stats.DialsFailed.Add(1)
		s.metrics.dialFailed(err)
		s.log.Debug("bad CONNECT request", "err", err)
		conn.SetWriteDeadline(time.Now().Add(s.cfg.HeaderTimeout))
		writeStatus(conn, StatusCode(err), errMsg(err))
		return nil, nil
	}
	// The peer is checked after its request is read: closing a Unix socket
	// with unread data resets it, and the client would never see the 403.
	if s.cfg.CheckFrontendPeer != nil {
		if err := s.cfg.CheckFrontendPeer(conn); err != nil {
			s.Stats.DialsFailed.Add(1)
			s.metrics.dialFailed(&StatusError{Code: http.StatusForbidden})
			s.quiet.log(s.log, slog.LevelWarn, "peer", "frontend peer refused", "err", err)
			conn.SetWriteDeadline(time.Now().Add(s.cfg.HeaderTimeout))
			writeStatus(conn, http.StatusForbidden, errMsg(err))
			return nil, nil
		}
	}
	lim.limited = false
	conn.SetDeadline(time.Time{})
	s.metrics.packets.inc(segFromClient, grpcwire.DialReq) // a CONNECT request read and its peer admitted

	up := s.newFrontendUpload(conn, br)
	up.addr = addr
	st, err := s.open(addr, up)
	if err != nil {
		release()
		s.Stats.DialsFailed.Add(1)
		s.metrics.dialFailed(err)
		s.log.Debug("dial failed", "addr", addr, "err", err)
		if failureReason(err) == reasonFrontendClosed {
			s.metrics.packets.inc(segFromClient, grpcwire.DialCls) // the client hung up during the dial
		}
		conn.SetWriteDeadline(time.Now().Add(s.cfg.HeaderTimeout))
		s.metrics.packets.inc(segToClient, grpcwire.DialRsp)
		writeStatus(conn, StatusCode(err), errMsg(err))
		return nil, nil
	}
	s.Stats.DialsOK.Add(1)
	s.metrics.packets.inc(segToClient, grpcwire.DialRsp)
	written := time.Now()
	_, err = io.WriteString(conn, connectEstablished)
	s.metrics.frontendWrite.ObserveDuration(time.Since(written))
	if err != nil {
		st.close()
		return nil, nil
	}
	up.packets = packetCounter{&s.metrics.packets.n[segFromClient][grpcwire.Data], &s.metrics.packets.n[segToAgent][grpcwire.Data]}
	up.closes = packetCounter{&s.metrics.packets.n[segFromClient][grpcwire.CloseReq], &s.metrics.packets.n[segToAgent][grpcwire.CloseReq]}
	return st, up
}

// newFrontendUpload is the upload of a frontend connection whose head br
// has read.
func (s *Server) newFrontendUpload(conn net.Conn, br *bufio.Reader) *upload {
	up := newUpload(br, func() { conn.SetReadDeadline(time.Now()) }, s.goroutine)
	up.raw = rawSocket(conn)
	up.callerSends = up.raw != nil // a link sends it from here: see carryDirect
	up.counters = []*atomic.Int64{&s.Stats.BytesToAgent}
	return up
}

// carryCopy carries a tunnel whose stream sends the upload itself (an
// upstream agent) or whose client is not a plain socket: this goroutine
// copies what the agent sends to the client.
func (s *Server) carryCopy(conn net.Conn, st *stream, up *upload) {
	// Each write to the client is a DATA Packet received from the agent and
	// sent on to the client.
	to := &packetWriter{w: conn, c: packetCounter{&s.metrics.packets.n[segFromAgent][grpcwire.Data], &s.metrics.packets.n[segToClient][grpcwire.Data]}, down: &up.act}
	n, err := copyStream(to, st.body, nil)
	s.Stats.BytesFromAgent.Add(n)
	st.agent.bytesFrom.Add(n)
	if err != nil {
		// The agent reset the stream or the client went away: abort both.
		s.metrics.resets.Inc()
		s.metrics.streamErrs.inc(segFromAgent, streamErrorCode(err), grpcwire.Data)
		return
	}
	s.metrics.countEnd()
	// The destination finished sending. Pass the half-close on and wait for
	// the client to finish sending too (or for the agent to stop reading).
	closeWrite(conn)
	select {
	case <-up.done:
	case <-s.baseCtx.Done():
	}
}

// watchDeliveries counts each write of the agent's bytes to the client as
// a DATA Packet and stamps the tunnel's activity toward the client. Cold
// work, apart from carryDirect: see "Parked stacks" in doc.go.
//
//go:noinline
func (s *Server) watchDeliveries(body *h2link.Body, up *upload) {
	fromAgent, toClient, act := &s.metrics.packets.n[segFromAgent][grpcwire.Data], &s.metrics.packets.n[segToClient][grpcwire.Data], &up.act
	body.OnWrite(func(int) {
		fromAgent.Add(1)
		toClient.Add(1)
		act.down()
	})
}

// carryDirect carries a tunnel on a link between a plain client socket
// and the stream with this one goroutine: it sends the upload itself while
// the link's read loop writes what the agent sends straight to the socket
// (see sink.go). It calls release once the delivery is set: only then can
// a handover pause the tunnel (pausable), so only then may a shutdown stop
// waiting for it.
func (s *Server) carryDirect(conn net.Conn, st *stream, up *upload, body *h2link.Body, release func()) {
	s.watchDeliveries(body, up)
	down := body.DeliverTo(conn, func(err error) error {
		if up.pausing.Load() {
			return err // the socket goes to the next image as it is
		}
		if err != nil {
			conn.SetReadDeadline(time.Now()) // the upload ends too
			return err
		}
		// The destination finished sending: pass the half-close on; the
		// client may still send.
		closeWrite(conn)
		return nil
	})
	up.down.Store(down)
	release()
	body.SendUpload()
	// The client finished sending (or the stream ended): wait for the
	// destination's end.
	select {
	case <-down.Done():
	case <-s.baseCtx.Done():
		st.close()
		<-down.Done()
	}
	n, err := down.Result()
	s.Stats.BytesFromAgent.Add(n)
	st.agent.bytesFrom.Add(n)
	if err != nil && !up.pausing.Load() {
		s.metrics.resets.Inc()
		s.metrics.streamErrs.inc(segFromAgent, streamErrorCode(err), grpcwire.Data)
		return
	}
	s.metrics.countEnd()
}

// maxConnectHead bounds a CONNECT request head; kube-apiserver's is ~50 bytes.
const maxConnectHead = 16 << 10

// headReaders recycles the 4 KiB readers of CONNECT heads, one per dial
// for a head of about fifty bytes. A reader goes back only from the path
// where nothing else can still hold it (the upload has drained it after the
// client was told 200); readers of dials that failed are left to the
// collector.
var headReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4096) }}
