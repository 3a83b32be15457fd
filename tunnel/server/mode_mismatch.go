package server

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"golang.org/x/sys/unix"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/wire"
)

// Each front door speaks one protocol (--mode); kube-apiserver's
// proxyProtocol must be the same. A client of the other protocol is told
// so in terms it shows its operator, and the server logs one line naming
// both modes (limited per interval): the HTTP CONNECT door answers a gRPC
// client's call with a status and a GOAWAY whose texts say it, and the
// gRPC door answers an HTTP/1.1 request with a status that says it.

const (
	grpcMismatchText    = "konnectivity server runs --mode=http-connect; this client speaks gRPC (proxyProtocol: GRPC): set proxyProtocol: HTTPConnect, or run the server with --mode=grpc"
	connectMismatchText = "konnectivity server runs --mode=grpc; this client speaks HTTP CONNECT (proxyProtocol: HTTPConnect): set proxyProtocol: GRPC, or run the server with --mode=http-connect"
)

// logModeMismatch is the server's line for a client of the other protocol.
func (s *Server) logModeMismatch(serverMode, clientMode, proxyProtocol string) {
	s.warnings.Log(s.log, slog.LevelWarn, "mode mismatch", "frontend refused a client of the other protocol: kube-apiserver's egress selector and --mode disagree",
		"server_mode", serverMode, "client_mode", clientMode, "fix", "proxyProtocol: "+proxyProtocol+" in kube-apiserver's egress selector configuration, or --mode="+clientMode)
}

// refuseGRPCClient answers a gRPC client's HTTP/2 connection on the HTTP
// CONNECT door, whose preface's request line ReadConnect has read from br:
// the server's SETTINGS; on the client's first call, its DIAL_REQ answered
// by a DIAL_RSP carrying the reason (konnectivity-client returns it as the
// dial's error) and the call ended FAILED_PRECONDITION with the reason
// (what konnectivity-client logs as its stream's error); then GOAWAY
// (HTTP_1_1_REQUIRED) with the reason as debug data. A client that sends
// no DIAL_REQ gets the status when the frames or the time run out. What
// it reads is bounded by br's head limit, a count of frames and the head
// deadline; the rest of what the client sends is read before the close,
// so that the close does not reset the connection before the client has
// read the answer.
func (s *Server) refuseGRPCClient(conn net.Conn, br *bufio.Reader) {
	s.logModeMismatch("http-connect", "grpc", "HTTPConnect")
	conn.SetDeadline(time.Now().Add(s.cfg.HeaderTimeout))
	var rest [len(http2PrefaceRest)]byte
	if _, err := io.ReadFull(br, rest[:]); err != nil || string(rest[:]) != http2PrefaceRest {
		return
	}
	fr := http2.NewFramer(conn, br)
	fr.SetMaxReadFrameSize(16 << 10)
	if fr.WriteSettings() != nil {
		return
	}
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	headers := func(id uint32, end bool, fields ...string) error {
		block.Reset()
		for i := 0; i+1 < len(fields); i += 2 {
			enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
		}
		return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block.Bytes(), EndStream: end, EndHeaders: true})
	}
	status := []string{"grpc-status", strconv.Itoa(grpcFailedPrecondition), "grpc-message", grpcEncodeMessage(grpcMismatchText)}
	call := uint32(0) // the client's first call
	var msg []byte    // what it sent on it
	answered := false
	for range 32 {
		f, err := fr.ReadFrame()
		if err != nil {
			break
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() && fr.WriteSettingsAck() != nil {
				return
			}
		case *http2.HeadersFrame:
			if call == 0 {
				call = f.StreamID
			}
		case *http2.DataFrame:
			if f.StreamID == call {
				msg = append(msg, f.Data()...)
			}
		}
		if len(msg) < grpcwire.HeaderLen || len(msg) < grpcwire.HeaderLen+int(binary.BigEndian.Uint32(msg[1:])) {
			continue
		}
		p, err := grpcwire.Decode(msg[grpcwire.HeaderLen : grpcwire.HeaderLen+int(binary.BigEndian.Uint32(msg[1:]))])
		if err != nil || p.Type != grpcwire.DialReq {
			break
		}
		rsp := grpcwire.AppendMessage(nil, grpcwire.Packet{Type: grpcwire.DialRsp, Random: p.Random, Error: grpcMismatchText})
		if headers(call, false, ":status", "200", "content-type", "application/grpc") != nil ||
			fr.WriteData(call, false, rsp) != nil || headers(call, true, status...) != nil {
			return
		}
		answered = true
		break
	}
	// The answer has a time of its own: the head's may be spent.
	conn.SetDeadline(time.Now().Add(s.cfg.HeaderTimeout))
	if call != 0 && !answered {
		if headers(call, true, append([]string{":status", "200", "content-type", "application/grpc"}, status...)...) != nil {
			return
		}
	}
	if fr.WriteGoAway(call, http2.ErrCodeHTTP11Required, []byte(grpcMismatchText)) == nil {
		io.Copy(io.Discard, io.LimitReader(br, 64<<10)) // until the client closes, or the deadline
	}
}

// http2PrefaceRest is what follows the request head "PRI * HTTP/2.0\r\n\r\n"
// in the HTTP/2 client connection preface.
const http2PrefaceRest = "SM\r\n\r\n"

// refuseConnectClient answers an HTTP/1.1 request on the gRPC door when
// conn's first bytes are one (they are peeked, not read: an HTTP/2 client
// goes on to the link untouched) and reports whether it ended the
// connection: after that answer, or when nothing arrived within the header
// timeout. Only plain sockets are looked at; on TLS, ALPN keeps the
// protocols apart.
func (s *Server) refuseConnectClient(conn net.Conn) bool {
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	var buf [64]byte
	n := 0
	conn.SetReadDeadline(time.Now().Add(s.cfg.HeaderTimeout))
	rerr := rc.Read(func(fd uintptr) bool {
		m, _, err := unix.Recvfrom(int(fd), buf[:], unix.MSG_PEEK)
		if errors.Is(err, unix.EAGAIN) {
			return false
		}
		n = max(m, 0)
		return true
	})
	conn.SetReadDeadline(time.Time{})
	if errors.Is(rerr, os.ErrDeadlineExceeded) {
		s.log.Debug("gRPC frontend: nothing received in time")
		conn.Close()
		return true
	}
	head := string(buf[:n])
	if rerr != nil || n == 0 || strings.HasPrefix(http2Preface, head) || strings.HasPrefix(head, http2Preface) {
		return false
	}
	// A known HTTP/1.1 method: anything else goes on to the link, which
	// refuses a bad preface as HTTP/2 requires.
	method, _, _ := strings.Cut(head, " ")
	switch method {
	case http.MethodConnect, http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut,
		http.MethodPatch, http.MethodDelete, http.MethodOptions, http.MethodTrace:
	default:
		return false
	}
	s.logModeMismatch("grpc", "http-connect", "GRPC")
	s.metrics.dialFailed(&wire.StatusError{Code: http.StatusBadRequest})
	conn.SetDeadline(time.Now().Add(s.cfg.HeaderTimeout))
	// The request head first, so that the close after the answer does not
	// reset the connection (a CONNECT has no body).
	readHead(conn)
	conn.SetWriteDeadline(time.Now().Add(s.cfg.HeaderTimeout))
	wire.WriteStatus(conn, http.StatusBadRequest, connectMismatchText)
	return true
}

// readHead reads an HTTP/1.1 request head (to its empty line), at most
// 16 KiB, under the connection's deadline.
func readHead(conn net.Conn) {
	var b [1]byte
	tail := 0
	for i := 0; i < 16<<10 && tail < 4; i++ {
		if _, err := conn.Read(b[:]); err != nil {
			return
		}
		switch {
		case b[0] == '\n' && (tail == 1 || tail == 3):
			tail++
		case b[0] == '\r' && (tail == 0 || tail == 2):
			tail++
		default:
			tail = 0
		}
	}
}
