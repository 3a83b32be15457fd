package server

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// The gRPC front door: kube-apiserver's proxyProtocol GRPC. Each dial is a
// bidirectional stream on /ProxyService/Proxy carrying konnectivity
// Packets; it is mapped onto the same CONNECT stream to an agent as the
// HTTP CONNECT front door, so both share one data path.

// gRPC status codes used here.
const (
	grpcOK                 = 0
	grpcCancelled          = 1
	grpcInvalidArgument    = 3
	grpcDeadlineExceeded   = 4
	grpcPermissionDenied   = 7
	grpcFailedPrecondition = 9
	grpcUnimplemented      = 12
	grpcUnavailable        = 14
)

// ServeGRPC accepts kube-apiserver's gRPC connections (HTTP/2 with prior
// knowledge, or TLS with ALPN h2) on ln until Shutdown or Close.
func (s *Server) ServeGRPC(ln net.Listener) error {
	return s.serve(ln, true, func(c net.Conn) {
		pd := &pendingDial{s: s}
		defer pd.release()
		s.serveGRPCConn(c, pd)
	})
}

// grpcConn is one kube-apiserver connection to the gRPC front door: the
// handler of its link's calls.
type grpcConn struct {
	// Immutable once the link serves.
	s       *Server
	socket  net.Conn
	link    *h2link.Conn // set before Serve: handlers run only from then on
	pend    *pendingDial // its first dial's count as pending (konnectivity-client dials one per connection)
	refused error        // why the peer was refused, if it was

	calls      atomic.Int32 // calls whose handler runs; a connection with more than one is not handed over
	handedOver atomic.Bool  // the socket went to a handover (grpcFront.pause): closeSocket does not close it
	goingAway  sync.Once
}

// closeSocket closes the connection's socket unless it was handed over.
func (c *grpcConn) closeSocket() {
	if !c.handedOver.Load() {
		c.socket.Close()
	}
}

// serveGRPCConn serves one kube-apiserver connection; pd counts its first
// dial as pending from its DIAL_REQ until it is answered (the client uses
// a connection per dial). A shutdown ends what has not asked for anything
// (leaving): a TLS handshake or an HTTP/2 preface in progress is closed, a
// connection with no call gets GOAWAY.
func (s *Server) serveGRPCConn(conn net.Conn, pd *pendingDial) {
	if !s.enterGRPCConn() {
		conn.Close()
		return
	}
	c := &grpcConn{s: s, socket: conn, pend: pd}
	stop := context.AfterFunc(s.baseCtx, c.closeSocket) // Close ends the connection
	defer func() {
		stop()
		c.closeSocket()
		s.leaveGRPCConn()
	}()
	if tc, ok := conn.(*tls.Conn); ok {
		ctx, cancel := context.WithTimeout(s.leaving, s.cfg.HeaderTimeout)
		err := tc.HandshakeContext(ctx)
		cancel()
		if err != nil {
			s.log.Debug("gRPC frontend TLS handshake failed", "err", err)
			return
		}
	}
	// A refused peer is told so on each of its streams (PERMISSION_DENIED)
	// rather than by a reset connection it could not tell from a crash;
	// it keeps the connection only for the header timeout, with small
	// windows, as a peer not admitted on the agent port.
	var small int32
	if s.cfg.CheckFrontendPeer != nil {
		if c.refused = s.cfg.CheckFrontendPeer(conn); c.refused != nil {
			s.warnings.Log(s.log, slog.LevelWarn, "peer", "frontend peer refused", "err", c.refused)
			cut := time.AfterFunc(s.cfg.HeaderTimeout, func() { conn.Close() })
			defer cut.Stop()
			small = preAdmitStreamWindow
		}
	}
	noPreface := context.AfterFunc(s.leaving, func() { conn.Close() })
	if c.refused == nil && s.refuseConnectClient(conn) {
		noPreface()
		return
	}
	h2conn := grpcLinkConn(conn)
	l, err := h2link.NewServer(h2conn, s.grpcLinkConfig(conn, h2conn, small), c)
	if !noPreface() || err != nil {
		s.log.Debug("gRPC frontend: no HTTP/2 connection", "err", err)
		return
	}
	c.link = l
	idle := context.AfterFunc(s.leaving, c.goAwayIfIdle)
	defer idle()
	l.Serve()
}

// ServeHTTP serves one call. A draining server lets the connection go
// once its calls are done: GOAWAY, then close when idle
// (konnectivity-client uses one connection per dial and closes it itself
// on CLOSE_RSP).
func (c *grpcConn) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	defer c.pend.release()
	if c.refused != nil {
		grpcTrailersOnly(w, grpcPermissionDenied, wire.ErrMsg(c.refused))
		return
	}
	c.calls.Add(1)
	err := c.s.serveGRPCStream(c, w, r)
	if err == errWaiterEnds {
		return // the call's waiter ends it (waitGRPC)
	}
	c.callDone(err == errHandedOn, false)
}

// callDone counts a call on c as ended. A draining server lets the
// connection go then; not one whose call went to the next image (the
// connection goes as it is), nor one the previous image handed on
// (resumed: the calls its client opens later are served as usual).
func (c *grpcConn) callDone(handedOn, resumed bool) {
	if !handedOn && !resumed && c.s.isShutting() {
		c.goAway()
	}
	c.calls.Add(-1)
}

// goAway lets the connection go: GOAWAY, then close when idle. Once. It
// runs from goAwayIfIdle's AfterFunc too, so its goroutine starts only
// while the server is open (Close ends the connection itself).
func (c *grpcConn) goAway() {
	c.goingAway.Do(func() { c.s.goroutineIfOpen(func() { c.link.Shutdown(c.s.baseCtx) }) })
}

// goAwayIfIdle lets a connection with no call go when a shutdown begins:
// its client asked for nothing, so GOAWAY loses nothing, and the client
// opens its next connection to whoever serves then. A call that begins
// meanwhile lets it go when it ends (ServeHTTP).
func (c *grpcConn) goAwayIfIdle() {
	if c.calls.Load() == 0 {
		c.goAway()
	}
}

// grpcLinkConn is what the link writes to: the same HTTP/2 link as an
// agent connection, in the serving role: every frame written by whoever
// has it, two DATA frames per system call (the batcher also gathers frames
// on a plain socket).
func grpcLinkConn(conn net.Conn) net.Conn {
	if _, isTLS := conn.(*tls.Conn); isTLS {
		return conn
	}
	return h2link.NewBatcher(conn)
}

// grpcLinkConfig configures a frontend connection's link. One on a plain
// socket can move to the next image of the process (handover.go).
func (s *Server) grpcLinkConfig(conn, h2conn net.Conn, small int32) h2link.Config {
	return h2link.Config{
		KeepAlive: s.cfg.KeepAlive, PingTimeout: s.cfg.PingTimeout, MaxConcurrentStreams: grpcMaxStreams,
		PreAdmitStreamWindow: small, PreAdmitConnWindow: small,
		BaseContext: s.baseCtx, Spawn: s.goroutine, Batch: wire.BatcherOf(h2conn),
		Freezable: small == 0 && wire.RawSocket(conn) != nil,
	}
}

// grpcMaxStreams bounds the calls open at once on one frontend connection;
// kube-apiserver opens one per connection.
const grpcMaxStreams = 1000

// grpcTrailersOnly ends a call before any message, as gRPC's
// "Trailers-Only" response: status in the only HEADERS frame.
func grpcTrailersOnly(w http.ResponseWriter, code int, msg string) {
	h := w.Header()
	h.Set("Content-Type", "application/grpc")
	h.Set("Grpc-Status", fmt.Sprint(code))
	if msg != "" {
		h.Set("Grpc-Message", grpcEncodeMessage(msg))
	}
	w.WriteHeader(http.StatusOK)
}

// grpcEncodeMessage percent-encodes a status message as gRPC requires.
func grpcEncodeMessage(msg string) string {
	var b strings.Builder
	for i := 0; i < len(msg); i++ {
		c := msg[i]
		if c >= 0x20 && c <= 0x7e && c != '%' {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// grpcStream writes Packets on one call; writes are serialized because the
// dial answer, downstream data and the close come from different places.
type grpcStream struct {
	mu    sync.Mutex
	w     http.ResponseWriter
	flush func()
	buf   []byte
	err   error
}

func (g *grpcStream) send(p grpcwire.Packet) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.err != nil {
		return g.err
	}
	g.buf = grpcwire.AppendMessage(g.buf[:0], p)
	if _, err := g.w.Write(g.buf); err != nil {
		g.err = err
		return err
	}
	g.flush()
	return nil
}

// write sends an already framed message.
func (g *grpcStream) write(msg []byte) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.err != nil {
		return g.err
	}
	if _, err := g.w.Write(msg); err != nil {
		g.err = err
		return err
	}
	g.flush()
	return nil
}

// finish sets the call's status trailers; the handler's return sends them.
func (g *grpcStream) finish(code int, msg string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.w.Header().Set(http.TrailerPrefix+"Grpc-Status", fmt.Sprint(code))
	if msg != "" {
		g.w.Header().Set(http.TrailerPrefix+"Grpc-Message", grpcEncodeMessage(msg))
	}
}

// errDialCancelled ends the upload of a dial the client gave up on.
var errDialCancelled = errors.New("dial cancelled by the client (DIAL_CLS)")

// errHandedOn: the call's tunnel went to the next image of the process;
// its stream stays open for the link to move with it (handover.go).
var errHandedOn = errors.New("tunnel handed to the next image")

// errWaiterEnds: the call goes on after its handler returns, and its
// waiter ends it (waitGRPC); the handler does nothing more.
var errWaiterEnds = errors.New("the call's waiter ends it")

// serveGRPCStream runs one /ProxyService/Proxy call on link l over the
// frontend socket conn: DIAL_REQ, DIAL_RSP, then DATA both ways until
// either side closes, or the call moves to the next image (errHandedOn).
func (s *Server) serveGRPCStream(c *grpcConn, w http.ResponseWriter, r *http.Request) error {
	if ct := r.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/grpc") {
		// Not gRPC at all (a probe, curl, a conformance suite): a plain
		// HTTP answer says what this socket is. What the request still
		// sends is read first (at most 64 KiB, for at most a second), so
		// the client gets the answer, or the link's verdict on a malformed
		// body, rather than a reset of a request it is still sending.
		stop := time.AfterFunc(time.Second, func() { r.Body.Close() })
		io.Copy(io.Discard, io.LimitReader(r.Body, 64<<10))
		stop.Stop()
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusUnsupportedMediaType)
		io.WriteString(w, "konnectivity gRPC frontend: requests must be gRPC (POST, content-type application/grpc)\n")
		return nil
	}
	if r.Method != http.MethodPost || r.URL.Path != grpcwire.ProxyMethod {
		grpcTrailersOnly(w, grpcUnimplemented, fmt.Sprintf("unknown method %s", r.URL.Path))
		return nil
	}
	s.metrics.grpcConns.Add(1)
	outlives := false // the call goes on after the handler returns: its waiter ends it
	defer func() {
		if !outlives {
			s.grpcCallEnded()
		}
	}()

	// The first message must be the DIAL_REQ, within the header bound.
	first := make(chan error, 1)
	var req grpcwire.Packet
	var buf []byte
	go func() {
		var msg []byte
		var err error
		if msg, buf, err = grpcwire.ReadMessage(r.Body, buf, grpcwire.MaxDialRequestLen); err == nil {
			req, err = grpcwire.Decode(msg)
		}
		first <- err
	}()
	timer := time.NewTimer(s.cfg.HeaderTimeout)
	select {
	case err := <-first:
		timer.Stop()
		if err != nil {
			grpcTrailersOnly(w, grpcInvalidArgument, fmt.Sprintf("read DIAL_REQ: %v", err))
			return nil
		}
	case <-timer.C:
		r.Body.Close()
		<-first
		grpcTrailersOnly(w, grpcDeadlineExceeded, "no DIAL_REQ received in time")
		return nil
	}
	if req.Type != grpcwire.DialReq {
		grpcTrailersOnly(w, grpcInvalidArgument, fmt.Sprintf("first packet is %s, want DIAL_REQ", req.Type))
		return nil
	}
	s.metrics.packets.Inc(wire.SegFromClient, grpcwire.DialReq)
	c.pend.ask()

	w.Header().Set("Content-Type", "application/grpc")
	w.WriteHeader(http.StatusOK)
	t := newGRPCTunnel(c, w, r)
	if !s.enter(t) {
		return nil
	}
	defer func() {
		if !outlives {
			s.leave(t)
		}
	}()
	f := t.front.(*grpcFront)
	f.g.flush()
	code, msg, err := s.proxyGRPC(t, req, buf)
	switch err {
	case errWaiterEnds:
		outlives = true
		return err
	case errHandedOn:
		h2link.Detach(w)
		return err
	}
	f.g.finish(code, msg)
	return nil
}

// grpcCallEnded counts a call of the front door as ended.
func (s *Server) grpcCallEnded() {
	s.metrics.grpcConns.Add(-1)
}

// grpcFront is the client's side of a tunnel on the gRPC front door: one
// call on a connection.
type grpcFront struct {
	// Immutable once the tunnel carries bytes.
	conn      *grpcConn
	ctx       context.Context // the call's
	g         *grpcStream
	body      io.ReadCloser // the call's request body: the client's Packets
	in        *grpcUploadReader
	quiet     *quietReader // what in reads the call's body through, when it parks
	connectID int64
	end       func() // h2link.Outlive's: the handler's return, made by the waiter
	// events carries what ends the call, each kind sent once: the
	// download's end (grpcDownEnded, by its last carrier), the drain's
	// (grpcDrained, by closeQuiet) and CLOSE_REQ (grpcCloseReq, by the
	// upload's reader). One channel, buffered for all three so that no
	// sender waits: a parked waiter waits on it and the call's context
	// only (see "Parked stacks" in doc.go).
	events chan grpcEvent
	// downErr is the download's end: written by its last carrier before
	// it sends grpcDownEnded, read after that is received.
	downErr error
	resumed bool // the call was handed on by the previous image (next to handedOn: the tunnel's allocation stays in a smaller size class)

	// handedOn is set before the agent's stream ends when the call goes
	// to the next image as it is.
	handedOn atomic.Bool

	// The carriers of the upload (the call's body, watcher's Peek
	// included) and of the download (the agent's stream), when the agent
	// is on one of our links; see carrier. downSize is owned by the
	// download's carrier: its next buffer's size.
	upCarrier, downCarrier carrier
	downSize               int
}

// grpcTunnel is a tunnel with its gRPC front, in one allocation.
type grpcTunnel struct {
	tunnel
	grpc grpcFront
}

// newGRPCTunnel is the tunnel of one call on c.
func newGRPCTunnel(c *grpcConn, w http.ResponseWriter, r *http.Request) *tunnel {
	gt := &grpcTunnel{grpc: grpcFront{conn: c, ctx: r.Context(), g: &grpcStream{w: w, flush: wire.FlusherOf(w)}, body: r.Body, events: make(chan grpcEvent, numGRPCEnds)}}
	gt.front = &gt.grpc
	return &gt.tunnel
}

// closeQuiet has carryGRPC end the call with CLOSE_RSP.
func (f *grpcFront) closeQuiet(*tunnel) { f.events <- grpcDrained }

// downEnded tells the call's waiter that the download ended, with err
// (nil at its clean end). Once.
func (f *grpcFront) downEnded(err error) {
	f.downErr = err
	f.events <- grpcDownEnded
}

// awaitDown waits for the download's end after the agent's stream was
// ended, letting the other events go.
func (f *grpcFront) awaitDown() {
	for ev := range f.events {
		if ev == grpcDownEnded {
			return
		}
	}
}

func (f *grpcFront) unread() bool     { return false }
func (f *grpcFront) hangup() net.Conn { return nil }
func (f *grpcFront) closeSocket()     { f.conn.socket.Close() }

// proxyGRPC dials for one call and carries it. It returns the call's
// final status, or errHandedOn.
func (s *Server) proxyGRPC(t *tunnel, req grpcwire.Packet, buf []byte) (int, string, error) {
	f := t.front.(*grpcFront)
	g := f.g
	if req.Protocol != "" && req.Protocol != "tcp" {
		s.metrics.dialFailed(&wire.StatusError{Code: http.StatusBadRequest})
		s.sendGRPC(g, grpcwire.Packet{Type: grpcwire.DialRsp, Random: req.Random, Error: fmt.Sprintf("protocol %q not supported: only tcp", req.Protocol)})
		return grpcOK, "", nil
	}
	if err := wire.CheckDialTarget(req.Address); err != nil {
		s.metrics.dialFailed(err)
		g.send(grpcwire.Packet{Type: grpcwire.DialRsp, Random: req.Random, Error: wire.ErrMsg(err)})
		return grpcOK, "", nil
	}
	f.connectID = s.nextConnectID.Add(1)
	t.addr = req.Address
	s.initGRPCUpload(t, buf, nil)
	if err := s.open(t); err != nil {
		f.conn.pend.release()
		f.body.Close()
		s.metrics.dialFailed(err)
		s.log.Debug("dial failed", "addr", req.Address, "err", err, "frontend", "grpc")
		s.sendGRPC(g, grpcwire.Packet{Type: grpcwire.DialRsp, Random: req.Random, Error: wire.ErrMsg(err)})
		return grpcOK, "", nil
	}
	if err := s.sendGRPC(g, grpcwire.Packet{Type: grpcwire.DialRsp, Random: req.Random, ConnectID: f.connectID}); err != nil {
		f.conn.pend.release()
		t.endStream()
		f.body.Close()
		return grpcUnavailable, "write DIAL_RSP", nil
	}
	return s.carryGRPC(t)
}

// initGRPCUpload sets up the client-to-agent direction: the client's
// packets are decoded as the upload is read, DATA payloads becoming upload
// bytes without a copy through a pipe or a goroutine. buf holds what the
// DIAL_REQ's read left; partial, a message cut short when the call moved
// from the previous image.
func (s *Server) initGRPCUpload(t *tunnel, buf, partial []byte) {
	f := t.front.(*grpcFront)
	f.in = &grpcUploadReader{body: f.body, mr: grpcwire.NewMessageReader(buf, grpcwire.MaxMessageLen), events: f.events, packets: &s.metrics.packets}
	f.in.mr.Prime(partial) // before the upload's watcher reads
	body := f.body
	// The reader only answers the watcher's Peek: reads pass it by into
	// the caller's buffer, so it is the smallest bufio allows.
	br := bufio.NewReaderSize(f.in, 16)
	unblock := func() { body.Close() }
	hb, parks := body.(*h2link.Body)
	if !parks {
		t.up.init(br, unblock, &t.act, s.goroutine)
	} else {
		// The upload's carrier reads the call, its watcher's Peek
		// included, and lets its goroutine go while the call is quiet.
		f.upCarrier.step = func() bool { return s.stepUp(t) }
		f.upCarrier.spawn = s.goroutine
		f.quiet = &quietReader{body: hb, wake: f.upCarrier.wake}
		f.in.body = f.quiet
		t.up.prepare(br, unblock, &t.act)
		t.up.parks = true
		t.up.callerSends = true // by the carrier, on our agents' links (stepUp)
		f.upCarrier.wake()
	}
	t.up.counters = []*atomic.Int64{&s.Stats.BytesToAgent}
	t.up.packets = wire.PacketCounter{&s.metrics.packets.N[wire.SegToAgent][grpcwire.Data]}
}

// carryGRPC carries an established call's tunnel until either side
// closes, a drain ends it at a quiet moment, or it moves to the next
// image. On our agents' links it returns errWaiterEnds once the tunnel is open:
// the handler returns, and a waiter of its own, on a fresh goroutine
// whose stack nothing grew, waits for the call's end (waitGRPC). The
// handler's stack, which the dial grew, is then not pinned by an idle call.
func (s *Server) carryGRPC(t *tunnel) (int, string, error) {
	f := t.front.(*grpcFront)
	// A draining server ends a quiet tunnel as the destination closing
	// would: CLOSE_RSP, which konnectivity-client turns into EOF on the
	// connection its HTTP client holds idle.
	down := h2link.NewDelivery()
	t.down.Store(down)
	t.move(tunnelOpen)
	f.conn.pend.release() // the dial is answered and the tunnel open: see Server.serve

	// Downstream: the agent's bytes become DATA packets, read straight into
	// place behind room for the packet's prefix, and written as one message.
	// On our agents' links both directions are carried only while bytes
	// move (see carrier); an upstream agent's stream is read by a
	// goroutine of its own, as is the call for it.
	f.downSize = wire.SmallBufSize
	body, ours := t.body.(*h2link.Body)
	if !ours && f.quiet != nil {
		f.quiet.blocks.Store(true) // before start lets the agent read
	}
	t.up.start()
	if !ours {
		s.goroutine(func() { f.downEnded(s.sendDownGRPC(t, down)) })
		ev, err := awaitGRPC(f)
		return s.endGRPC(t, ev, err)
	}
	f.downCarrier.step = func() bool { return s.stepDown(t, body) }
	f.downCarrier.spawn = s.goroutine
	f.downCarrier.wake()
	f.upCarrier.wake()
	s.hand.opened(t)
	if f.end = h2link.Outlive(f.g.w); f.end == nil {
		ev, err := awaitGRPC(f)
		return s.endGRPC(t, ev, err)
	}
	s.goroutine(func() { s.waitGRPC(t) })
	return 0, "", errWaiterEnds
}

// grpcEvent is what ends a call (awaitGRPC).
type grpcEvent uint8

const (
	grpcDownEnded grpcEvent = iota // the agent's stream ended (or the tunnel was handed on)
	grpcDrained                    // a drain closes the call at a quiet moment
	grpcCloseReq                   // the client sent CLOSE_REQ
	numGRPCEnds                    // the events sent on grpcFront.events

	grpcCancelledByClient = numGRPCEnds // the client reset the call or went away: its context ended
)

// awaitGRPC waits for what ends the call; with the download's end, its
// error. Its frame is the most of a waiter's parked stack, so it does
// nothing else (see "Parked stacks" in doc.go).
func awaitGRPC(f *grpcFront) (grpcEvent, error) {
	select {
	case ev := <-f.events:
		if ev == grpcDownEnded {
			return ev, f.downErr
		}
		return ev, nil
	case <-f.ctx.Done():
		return grpcCancelledByClient, nil
	}
}

// waitGRPC is an outliving call's waiter (see carryGRPC): it waits for the
// call's end, then ends the call as its handler would have.
func (s *Server) waitGRPC(t *tunnel) {
	ev, err := awaitGRPC(t.front.(*grpcFront))
	s.endOutlivingGRPC(t, ev, err)
}

// endOutlivingGRPC ends an outliving call after ev: what the returns of carryGRPC,
// of serveGRPCStream (or resumeGRPCCall) and of the handler would have
// done. Apart from waitGRPC, whose frame stays on parked stacks.
//
//go:noinline
func (s *Server) endOutlivingGRPC(t *tunnel, ev grpcEvent, downErr error) {
	f := t.front.(*grpcFront)
	code, msg, err := s.endGRPC(t, ev, downErr)
	if err == errHandedOn {
		h2link.Detach(f.g.w)
	} else {
		f.g.finish(code, msg)
	}
	s.leave(t)
	s.grpcCallEnded()
	f.conn.callDone(err == errHandedOn, f.resumed)
	f.end()
}

// endGRPC ends the call's tunnel after ev, and returns the call's status,
// or errHandedOn.
func (s *Server) endGRPC(t *tunnel, ev grpcEvent, downErr error) (int, string, error) {
	f := t.front.(*grpcFront)
	g := f.g
	defer func() {
		if !f.handedOn.Load() {
			f.body.Close()
			t.endStream()
		}
	}()
	switch ev {
	case grpcDownEnded:
		if f.handedOn.Load() {
			// The agent's stream ended for the move: the call goes to
			// the next image, nothing is written here any more.
			return 0, "", errHandedOn
		}
		// The destination closed (or the agent stream broke): tell the client.
		rsp := grpcwire.Packet{Type: grpcwire.CloseRsp, ConnectID: f.connectID}
		if downErr != nil {
			rsp.Error = downErr.Error()
			s.metrics.streamErrs.Inc(wire.SegFromAgent, wire.StreamErrorCode(downErr), grpcwire.Data)
		} else {
			s.metrics.packets.Inc(wire.SegFromAgent, grpcwire.CloseRsp)
		}
		s.sendGRPC(g, rsp)
		return grpcOK, "", nil
	case grpcDrained:
		// Drained at a quiet moment: the client's connection was idle.
		// CLOSE_RSP goes first, so the client sees the end (and its
		// next write fails, unsent, so its HTTP client retries) as
		// soon as possible; the agent's stream ends after.
		s.sendGRPC(g, grpcwire.Packet{Type: grpcwire.CloseRsp, ConnectID: f.connectID})
		t.endStream()
		f.awaitDown()
		return grpcOK, "", nil
	case grpcCloseReq:
		// The client closed the connection: end the tunnel, then confirm.
		t.endStream()
		f.awaitDown()
		s.metrics.packets.Inc(wire.SegToAgent, grpcwire.CloseReq)
		s.sendGRPC(g, grpcwire.Packet{Type: grpcwire.CloseRsp, ConnectID: f.connectID})
		return grpcOK, "", nil
	default:
		// The client reset the call or went away.
		t.endStream()
		f.awaitDown()
		return grpcCancelled, "call ended by the client", nil
	}
}

// stepDown is the download's carrier step on one of our agents' links:
// it writes the agent's bytes to the client as DATA packets while the
// stream has them, and parks once it is quiet (the stream wakes the
// carrier). At the stream's end it ends the delivery and tells carryGRPC.
func (s *Server) stepDown(t *tunnel, body *h2link.Body) (ended bool) {
	f := t.front.(*grpcFront)
	for body.Notify(f.downCarrier.wake) {
		if done, err := s.sendDownOnce(t, f); done {
			t.down.Load().Complete(err)
			f.downEnded(err)
			return true
		}
	}
	return false
}

// sendDownGRPC writes an upstream agent's bytes to the client as DATA
// packets until the stream ends, on a goroutine of its own.
func (s *Server) sendDownGRPC(t *tunnel, down *h2link.Delivery) (err error) {
	defer func() { down.Complete(err) }()
	f := t.front.(*grpcFront)
	for {
		if done, err := s.sendDownOnce(t, f); done {
			return err
		}
	}
}

// sendDownOnce makes one read of the agent's stream and writes what it
// read as one DATA packet, counted in the tunnel's delivery. It borrows a
// buffer for the read only (a small one, a large one while reads fill
// it). done is the stream's end; err is nil at its clean end.
func (s *Server) sendDownOnce(t *tunnel, f *grpcFront) (done bool, err error) {
	bp := wire.GetBuf(f.downSize)
	buf := *bp
	n, err := t.body.Read(buf[grpcwire.DataPrefixRoom:])
	switch {
	case n == len(buf)-grpcwire.DataPrefixRoom:
		f.downSize = wire.LargeBufSize
	case n < wire.SmallBufSize:
		f.downSize = wire.SmallBufSize
	}
	if n <= 0 {
		wire.PutBuf(bp)
	} else {
		t.fromAgent(int64(n))
		msg := grpcwire.PutDataPrefix(buf, f.connectID, n)
		s.metrics.packets.Inc(wire.SegFromAgent, grpcwire.Data)
		s.metrics.packets.Inc(wire.SegToClient, grpcwire.Data)
		written := time.Now()
		werr := f.g.write(msg)
		wire.PutBuf(bp)
		t.act.Down()
		t.down.Load().Add(int64(n))
		s.metrics.frontendWrite.ObserveDuration(time.Since(written))
		if werr != nil {
			s.metrics.streamErrs.Inc(wire.SegToClient, wire.CodeUnavailable, grpcwire.Data)
			return true, werr
		}
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			return true, nil
		}
		return true, err
	}
	return false, nil
}

// stepUp is the upload's carrier step: the watcher's Peek until it
// returns, then, once the tunnel is open on one of our agents' links, the
// upload until the call is quiet (SendUpload returns with the upload
// parked) or the upload ends. carryGRPC wakes the carrier when the tunnel
// opens; an upstream agent reads the upload itself.
func (s *Server) stepUp(t *tunnel) (ended bool) {
	if !t.up.peekParking() || !t.up.isEstablished.Load() {
		return false
	}
	body, ours := t.body.(*h2link.Body)
	if !ours {
		return true
	}
	if !t.up.isDone() {
		body.SendUpload()
	}
	return t.up.isDone()
}

// quietReader reads the call's body for the upload's carrier: where a
// Read would wait it returns errQuiet, having asked the body to wake the
// carrier when bytes come. For an upstream agent, which reads the upload
// on a goroutine of its own, it waits instead (blocks).
type quietReader struct {
	body   *h2link.Body // immutable
	wake   func()       // immutable
	blocks atomic.Bool  // set once, before the upload is read after the dial
}

func (r *quietReader) Read(p []byte) (int, error) {
	if !r.blocks.Load() && !r.body.Notify(r.wake) {
		return 0, errQuiet
	}
	return r.body.Read(p)
}

// grpcUploadReader reads the client's Packets as a byte stream: DATA
// payloads are the bytes; CLOSE_REQ ends it (and is sent on events);
// DIAL_CLS ends it with errDialCancelled; the client's half-close is EOF.
// A message cut short when the call moves to the next image stays in mr.
type grpcUploadReader struct {
	body    io.Reader
	mr      *grpcwire.MessageReader
	pending []byte           // the rest of the current DATA payload (aliases mr's buffer)
	events  chan<- grpcEvent // the call's (grpcFront.events)
	err     error
	packets *wire.PacketCounts
}

func (u *grpcUploadReader) Read(p []byte) (int, error) {
	for len(u.pending) == 0 {
		if u.err != nil {
			return 0, u.err
		}
		msg, err := u.mr.Next(u.body)
		if err == errQuiet {
			return 0, err // what the message has so far stays in mr
		}
		if err != nil {
			u.err = err
			return 0, err
		}
		pkt, err := grpcwire.Decode(msg)
		if err != nil {
			u.err = fmt.Errorf("bad packet: %w", err)
			return 0, u.err
		}
		if pkt.Type >= 0 && int(pkt.Type) < wire.NumPacketTypes {
			u.packets.Inc(wire.SegFromClient, pkt.Type)
		}
		switch pkt.Type {
		case grpcwire.Data:
			u.pending = pkt.Data
		case grpcwire.CloseReq:
			u.events <- grpcCloseReq // once: u.err ends the reads
			u.err = io.EOF
		case grpcwire.DialCls:
			u.err = errDialCancelled
		}
	}
	n := copy(p, u.pending)
	u.pending = u.pending[n:]
	return n, nil
}

// sendGRPC writes one Packet to the frontend, counted and timed as
// upstream's frontend writes are.
func (s *Server) sendGRPC(g *grpcStream, p grpcwire.Packet) error {
	s.metrics.packets.Inc(wire.SegToClient, p.Type)
	written := time.Now()
	err := g.send(p)
	s.metrics.frontendWrite.ObserveDuration(time.Since(written))
	return err
}
