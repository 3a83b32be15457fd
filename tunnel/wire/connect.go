package wire

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
)

// StatusError is a failure with the HTTP status a client should see.
type StatusError struct {
	Code   int
	Msg    string
	Reason string // for dial failures: the metric label (no_agent, backend_dial_timeout, ...)
	// RetryAfter is when the agent port said to come back (HdrRetryAfterMs);
	// zero when it did not say.
	RetryAfter time.Duration
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("%d %s: %s", e.Code, http.StatusText(e.Code), e.Msg)
}

func StatusErrorf(code int, format string, args ...any) *StatusError {
	return &StatusError{Code: code, Msg: fmt.Sprintf(format, args...)}
}

func (e *StatusError) WithReason(r string) *StatusError {
	e.Reason = r
	return e
}

// StatusCode returns the HTTP status carried by err, or 502 for any other error.
func StatusCode(err error) int {
	var se *StatusError
	if errors.As(err, &se) {
		return se.Code
	}
	return http.StatusBadGateway
}

// HeadLimiter caps how many bytes the request head may use. After the head is
// parsed the cap is lifted so the bufio.Reader on top keeps serving tunnel
// bytes that arrived behind the head.
type HeadLimiter struct {
	R         io.Reader
	Remaining int64
	Limited   bool
	// Seen is every byte read while limited, so that a connection whose
	// head a handover interrupts goes to the next image with what was
	// read (PausedTunnel.Head); replay is how many of its last bytes are
	// still to be read again, in the next image.
	Seen   []byte
	Replay int
}

var ErrHeadTooLarge = errors.New("request head too large")

func (l *HeadLimiter) Read(p []byte) (int, error) {
	if l.Replay > 0 {
		n := copy(p, l.Seen[len(l.Seen)-l.Replay:])
		l.Replay -= n
		l.Remaining -= int64(n)
		return n, nil
	}
	if !l.Limited {
		return l.R.Read(p)
	}
	if l.Remaining <= 0 {
		return 0, ErrHeadTooLarge
	}
	if int64(len(p)) > l.Remaining {
		p = p[:l.Remaining]
	}
	n, err := l.R.Read(p)
	l.Remaining -= int64(n)
	l.Seen = append(l.Seen, p[:n]...)
	return n, err
}

// ErrHTTP2Preface is what ReadConnect returns for the start of an HTTP/2
// connection (a gRPC client) in place of a CONNECT request.
var ErrHTTP2Preface = StatusErrorf(http.StatusBadRequest, "an HTTP/2 connection preface, not a CONNECT request")

// ReadConnect reads one HTTP/1.x request head from br and returns the dial
// address of a CONNECT request. The address is the request target, never the
// Host header (kube-apiserver sends "Host: 127.0.0.1"). Errors are
// *StatusError: 400 for a malformed request, 405 for another method, 431 for a
// head that is too large.
func ReadConnect(br *bufio.Reader) (string, error) {
	req, err := http.ReadRequest(br)
	if err != nil {
		if errors.Is(err, ErrHeadTooLarge) {
			return "", StatusErrorf(http.StatusRequestHeaderFieldsTooLarge, "request head too large")
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return "", StatusErrorf(http.StatusRequestTimeout, "request head not received in time")
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return "", StatusErrorf(http.StatusBadRequest, "connection closed before the request head ended")
		}
		return "", StatusErrorf(http.StatusBadRequest, "malformed request: %s", CleanErr(err))
	}
	if req.Method == "PRI" && req.ProtoMajor == 2 {
		return "", ErrHTTP2Preface
	}
	if req.Method != http.MethodConnect {
		return "", StatusErrorf(http.StatusMethodNotAllowed, "method %s not allowed: this is a CONNECT proxy", req.Method)
	}
	if req.ProtoMajor != 1 {
		return "", StatusErrorf(http.StatusBadRequest, "protocol %s not supported", req.Proto)
	}
	// For CONNECT, net/http takes the authority-form request target as
	// req.Host, and URL.Host stays equal to it; a Host header does not change it.
	addr := req.URL.Host
	if addr == "" {
		addr = req.RequestURI
	}
	if err := CheckDialTarget(addr); err != nil {
		return "", err
	}
	if req.ContentLength > 0 || len(req.TransferEncoding) > 0 {
		return "", StatusErrorf(http.StatusBadRequest, "CONNECT request must not have a body")
	}
	return addr, nil
}

// CheckDialTarget checks a dial address from a frontend before any agent
// sees it: 400 when it is not host:port, 403 for a zoned IPv6 address
// ("[fe80::1%eth0]:80", sent as %25 in a request target), whose zone would
// pick a network interface of the agent's host past every address rule.
func CheckDialTarget(addr string) error {
	host, err := SplitDialAddress(addr)
	if err != nil {
		return StatusErrorf(http.StatusBadRequest, "%v", err)
	}
	if strings.Contains(host, "%") {
		return StatusErrorf(http.StatusForbidden, "destination %s refused: a zoned address names a network interface of the agent's host, which no rule can check", CleanErr(errors.New(addr)))
	}
	return nil
}

// CleanErr keeps client-supplied bytes out of error text beyond a short,
// printable prefix.
func CleanErr(err error) string {
	s := err.Error()
	if len(s) > 240 {
		s = s[:240] + "..."
	}
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return '?'
		}
		return r
	}, s)
}

// WriteStatus answers a frontend request with a short text body and asks the
// client to close. The reason phrase carries the message too (its first 240
// printable bytes), because kube-apiserver's HTTP CONNECT dialer reports
// the status line and never the body.
func WriteStatus(w io.Writer, code int, msg string) error {
	reason := http.StatusText(code)
	msg = strings.TrimSpace(msg)
	if msg == "" {
		msg = reason
	} else if msg != reason {
		reason += ": " + CleanErr(errors.New(msg))
	}
	msg += "\n"
	_, err := fmt.Fprintf(w, "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		code, reason, len(msg), msg)
	return err
}

// ConnectEstablished is the exact answer kube-apiserver's dialer expects: no
// headers and no body, so nothing is buffered behind it.
const ConnectEstablished = "HTTP/1.1 200 Connection Established\r\n\r\n"

// ErrMsg is what a peer is told of err: a StatusError's message, or the
// error's text.
func ErrMsg(err error) string {
	var se *StatusError
	if errors.As(err, &se) {
		return se.Msg
	}
	return err.Error()
}
