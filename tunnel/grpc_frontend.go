package tunnel

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

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// The gRPC front door: kube-apiserver's proxyProtocol GRPC. Each dial is a
// bidirectional stream on /ProxyService/Proxy carrying konnectivity
// Packets; it is mapped onto the same CONNECT stream to an agent as the
// HTTP CONNECT front door, so both share one data path.
const grpcProxyMethod = "/ProxyService/Proxy"

// gRPC status codes used here.
const (
	grpcOK               = 0
	grpcCancelled        = 1
	grpcInvalidArgument  = 3
	grpcDeadlineExceeded = 4
	grpcPermissionDenied = 7
	grpcUnimplemented    = 12
	grpcInternal         = 13
	grpcUnavailable      = 14
)

// ServeGRPC accepts kube-apiserver's gRPC connections (HTTP/2 with prior
// knowledge, or TLS with ALPN h2) on ln until Shutdown or Close.
func (s *Server) ServeGRPC(ln net.Listener) error {
	return s.serve(ln, true, s.serveGRPCConn)
}

// serveGRPCConn serves one kube-apiserver connection; release is called
// once its first dial is answered (the client uses a connection per dial).
func (s *Server) serveGRPCConn(conn net.Conn, release func()) {
	if !s.trackFrontend(conn, true) {
		conn.Close()
		return
	}
	defer func() {
		s.trackFrontend(conn, false)
		conn.Close()
	}()
	if tc, ok := conn.(*tls.Conn); ok {
		ctx, cancel := context.WithTimeout(s.baseCtx, s.cfg.HeaderTimeout)
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
	var refused error
	var small int32
	if s.cfg.CheckFrontendPeer != nil {
		if refused = s.cfg.CheckFrontendPeer(conn); refused != nil {
			s.quiet.log(s.log, slog.LevelWarn, "peer", "frontend peer refused", "err", refused)
			cut := time.AfterFunc(s.cfg.HeaderTimeout, func() { conn.Close() })
			defer cut.Stop()
			small = preAdmitStreamWindow
		}
	}
	// A draining server lets the connection go once its calls are done:
	// GOAWAY, then close when idle (konnectivity-client uses one
	// connection per dial and closes it itself on CLOSE_RSP).
	var l *h2link.Conn
	var goingAway sync.Once
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer release()
		if refused != nil {
			grpcTrailersOnly(w, grpcPermissionDenied, errMsg(refused))
			return
		}
		s.serveGRPCStream(w, r, release)
		if s.isShutting() {
			goingAway.Do(func() { s.goroutine(func() { l.Shutdown(s.baseCtx) }) })
		}
	})
	// The same HTTP/2 link as an agent connection, in the serving role:
	// every frame written by whoever has it, two DATA frames per system
	// call (the batcher also gathers frames on a plain socket).
	var h2conn net.Conn = conn
	if _, isTLS := conn.(*tls.Conn); !isTLS {
		h2conn = h2link.NewBatcher(conn)
	}
	var err error
	l, err = h2link.NewServer(h2conn, h2link.Config{
		KeepAlive: s.cfg.KeepAlive, PingTimeout: s.cfg.PingTimeout, MaxConcurrentStreams: grpcMaxStreams,
		PreAdmitStreamWindow: small, PreAdmitConnWindow: small,
		BaseContext: s.baseCtx, Spawn: s.goroutine, Batch: batcherOf(h2conn),
	}, handler)
	if err != nil {
		s.log.Debug("gRPC frontend: no HTTP/2 connection", "err", err)
		release()
		return
	}
	l.Serve()
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

// serveGRPCStream runs one /ProxyService/Proxy call: DIAL_REQ, DIAL_RSP,
// then DATA both ways until either side closes.
func (s *Server) serveGRPCStream(w http.ResponseWriter, r *http.Request, release func()) {
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
		return
	}
	if r.Method != http.MethodPost || r.URL.Path != grpcProxyMethod {
		grpcTrailersOnly(w, grpcUnimplemented, fmt.Sprintf("unknown method %s", r.URL.Path))
		return
	}
	if ct := r.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/grpc") {
		grpcTrailersOnly(w, grpcInvalidArgument, "content-type must be application/grpc")
		return
	}
	s.Stats.FrontendOpen.Add(1)
	s.metrics.grpcConns.Add(1)
	defer func() {
		s.metrics.grpcConns.Add(-1)
		s.Stats.FrontendOpen.Add(-1)
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
			return
		}
	case <-timer.C:
		r.Body.Close()
		<-first
		grpcTrailersOnly(w, grpcDeadlineExceeded, "no DIAL_REQ received in time")
		return
	}
	if req.Type != grpcwire.DialReq {
		grpcTrailersOnly(w, grpcInvalidArgument, fmt.Sprintf("first packet is %s, want DIAL_REQ", req.Type))
		return
	}
	s.metrics.packets.inc(segFromClient, grpcwire.DialReq)

	w.Header().Set("Content-Type", "application/grpc")
	w.WriteHeader(http.StatusOK)
	g := &grpcStream{w: w, flush: flusherOf(w)}
	g.flush()
	code, msg := s.proxyGRPC(r.Context(), g, r.Body, req, buf, release)
	g.finish(code, msg)
}

// proxyGRPC carries one dial. It returns the call's final status.
func (s *Server) proxyGRPC(ctx context.Context, g *grpcStream, body io.ReadCloser, req grpcwire.Packet, buf []byte, release func()) (int, string) {
	if req.Protocol != "" && req.Protocol != "tcp" {
		s.Stats.DialsFailed.Add(1)
		s.metrics.dialFailed(&StatusError{Code: http.StatusBadRequest})
		s.sendGRPC(g, grpcwire.Packet{Type: grpcwire.DialRsp, Random: req.Random, Error: fmt.Sprintf("protocol %q not supported: only tcp", req.Protocol)})
		return grpcOK, ""
	}
	if err := checkDialTarget(req.Address); err != nil {
		s.Stats.DialsFailed.Add(1)
		s.metrics.dialFailed(err)
		g.send(grpcwire.Packet{Type: grpcwire.DialRsp, Random: req.Random, Error: errMsg(err)})
		return grpcOK, ""
	}
	connectID := s.nextConnectID.Add(1)
	// The client's packets are decoded as the upload is read: DATA payloads
	// become upload bytes without a copy through a pipe or a goroutine.
	in := &grpcUploadReader{body: body, buf: buf, closeReq: make(chan struct{}), packets: &s.metrics.packets}
	up := newUpload(bufio.NewReaderSize(in, 4096), func() { body.Close() }, s.goroutine)
	up.counters = []*atomic.Int64{&s.Stats.BytesToAgent}
	up.packets = packetCounter{&s.metrics.packets.n[segToAgent][grpcwire.Data]}
	closeReq := in.closeReq
	defer body.Close()

	st, err := s.open(req.Address, up)
	release()
	if err != nil {
		s.Stats.DialsFailed.Add(1)
		s.metrics.dialFailed(err)
		s.log.Debug("dial failed", "addr", req.Address, "err", err, "frontend", "grpc")
		s.sendGRPC(g, grpcwire.Packet{Type: grpcwire.DialRsp, Random: req.Random, Error: errMsg(err)})
		return grpcOK, ""
	}
	s.Stats.DialsOK.Add(1)
	defer st.close()
	if err := s.sendGRPC(g, grpcwire.Packet{Type: grpcwire.DialRsp, Random: req.Random, ConnectID: connectID}); err != nil {
		return grpcUnavailable, "write DIAL_RSP"
	}
	// A draining server ends a quiet tunnel as the destination closing
	// would: CLOSE_RSP, which konnectivity-client turns into EOF on the
	// connection its HTTP client holds idle.
	quietCh := make(chan struct{})
	qt := &quietTunnel{quiet: drainQuietGRPC, act: &up.act, closeQuiet: func() { close(quietCh) }}
	s.addQuiet(qt)
	defer s.removeQuiet(qt.act)
	up.start()

	// Downstream: the agent's bytes become DATA packets, read straight into
	// place behind room for the packet's prefix, and written as one message.
	downDone := make(chan error, 1)
	s.goroutine(func() {
		bp := largeBufs.Get().(*[]byte)
		defer largeBufs.Put(bp)
		buf := *bp
		for {
			n, err := st.body.Read(buf[grpcwire.DataPrefixRoom:])
			if n > 0 {
				s.Stats.BytesFromAgent.Add(int64(n))
				st.agent.bytesFrom.Add(int64(n))
				msg := grpcwire.PutDataPrefix(buf, connectID, n)
				s.metrics.packets.inc(segFromAgent, grpcwire.Data)
				s.metrics.packets.inc(segToClient, grpcwire.Data)
				written := time.Now()
				werr := g.write(msg)
				up.act.down()
				s.metrics.frontendWrite.ObserveDuration(time.Since(written))
				if werr != nil {
					s.metrics.streamErrs.inc(segToClient, codeUnavailable, grpcwire.Data)
					downDone <- werr
					return
				}
			}
			if err != nil {
				if errors.Is(err, io.EOF) {
					err = nil
				}
				downDone <- err
				return
			}
		}
	})
	select {
	case err := <-downDone:
		// The destination closed (or the agent stream broke): tell the client.
		rsp := grpcwire.Packet{Type: grpcwire.CloseRsp, ConnectID: connectID}
		if err != nil {
			rsp.Error = err.Error()
			s.metrics.streamErrs.inc(segFromAgent, streamErrorCode(err), grpcwire.Data)
		} else {
			s.metrics.packets.inc(segFromAgent, grpcwire.CloseRsp)
		}
		s.sendGRPC(g, rsp)
		return grpcOK, ""
	case <-quietCh:
		// Drained at a quiet moment: the client's connection was idle.
		// CLOSE_RSP goes first, so the client sees the end (and its
		// next write fails, unsent, so its HTTP client retries) as
		// soon as possible; the agent's stream ends after.
		s.sendGRPC(g, grpcwire.Packet{Type: grpcwire.CloseRsp, ConnectID: connectID})
		st.close()
		<-downDone
		return grpcOK, ""
	case <-closeReq:
		// The client closed the connection: end the tunnel, then confirm.
		st.close()
		<-downDone
		s.metrics.packets.inc(segToAgent, grpcwire.CloseReq)
		s.sendGRPC(g, grpcwire.Packet{Type: grpcwire.CloseRsp, ConnectID: connectID})
		return grpcOK, ""
	case <-ctx.Done():
		// The client reset the call or went away.
		st.close()
		<-downDone
		return grpcCancelled, "call ended by the client"
	}
}

// grpcUploadReader reads the client's Packets as a byte stream: DATA
// payloads are the bytes; CLOSE_REQ ends it (and is signalled on closeReq);
// DIAL_CLS ends it with errDialCancelled; the client's half-close is EOF.
type grpcUploadReader struct {
	body     io.Reader
	buf      []byte
	pending  []byte // the rest of the current DATA payload (aliases buf)
	closeReq chan struct{}
	err      error
	packets  *packetCounts
}

func (u *grpcUploadReader) Read(p []byte) (int, error) {
	for len(u.pending) == 0 {
		if u.err != nil {
			return 0, u.err
		}
		var msg []byte
		msg, u.buf, u.err = grpcwire.ReadMessage(u.body, u.buf, grpcwire.MaxMessageLen)
		if u.err != nil {
			return 0, u.err
		}
		pkt, err := grpcwire.Decode(msg)
		if err != nil {
			u.err = fmt.Errorf("bad packet: %w", err)
			return 0, u.err
		}
		if pkt.Type >= 0 && int(pkt.Type) < numPacketTypes {
			u.packets.inc(segFromClient, pkt.Type)
		}
		switch pkt.Type {
		case grpcwire.Data:
			u.pending = pkt.Data
		case grpcwire.CloseReq:
			close(u.closeReq)
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
	s.metrics.packets.inc(segToClient, p.Type)
	written := time.Now()
	err := g.send(p)
	s.metrics.frontendWrite.ObserveDuration(time.Since(written))
	return err
}
