package tunnel

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
	// RetryAfter is when the agent port said to come back (hdrRetryAfterMs);
	// zero when it did not say.
	RetryAfter time.Duration
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("%d %s: %s", e.Code, http.StatusText(e.Code), e.Msg)
}

func statusErrorf(code int, format string, args ...any) *StatusError {
	return &StatusError{Code: code, Msg: fmt.Sprintf(format, args...)}
}

func (e *StatusError) withReason(r string) *StatusError {
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

// headLimiter caps how many bytes the request head may use. After the head is
// parsed the cap is lifted so the bufio.Reader on top keeps serving tunnel
// bytes that arrived behind the head.
type headLimiter struct {
	r         io.Reader
	remaining int64
	limited   bool
	// seen is every byte read while limited, so that a connection whose
	// head a handover interrupts goes to the next image with what was
	// read (PausedTunnel.Head); replay is how many of its last bytes are
	// still to be read again, in the next image.
	seen   []byte
	replay int
}

var errHeadTooLarge = errors.New("request head too large")

func (l *headLimiter) Read(p []byte) (int, error) {
	if l.replay > 0 {
		n := copy(p, l.seen[len(l.seen)-l.replay:])
		l.replay -= n
		l.remaining -= int64(n)
		return n, nil
	}
	if !l.limited {
		return l.r.Read(p)
	}
	if l.remaining <= 0 {
		return 0, errHeadTooLarge
	}
	if int64(len(p)) > l.remaining {
		p = p[:l.remaining]
	}
	n, err := l.r.Read(p)
	l.remaining -= int64(n)
	l.seen = append(l.seen, p[:n]...)
	return n, err
}

// readConnect reads one HTTP/1.x request head from br and returns the dial
// address of a CONNECT request. The address is the request target, never the
// Host header (kube-apiserver sends "Host: 127.0.0.1"). Errors are
// *StatusError: 400 for a malformed request, 405 for another method, 431 for a
// head that is too large.
func readConnect(br *bufio.Reader) (string, error) {
	req, err := http.ReadRequest(br)
	if err != nil {
		if errors.Is(err, errHeadTooLarge) {
			return "", statusErrorf(http.StatusRequestHeaderFieldsTooLarge, "request head too large")
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return "", statusErrorf(http.StatusRequestTimeout, "request head not received in time")
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return "", statusErrorf(http.StatusBadRequest, "connection closed before the request head ended")
		}
		return "", statusErrorf(http.StatusBadRequest, "malformed request: %s", cleanErr(err))
	}
	if req.Method != http.MethodConnect {
		return "", statusErrorf(http.StatusMethodNotAllowed, "method %s not allowed: this is a CONNECT proxy", req.Method)
	}
	if req.ProtoMajor != 1 {
		return "", statusErrorf(http.StatusBadRequest, "protocol %s not supported", req.Proto)
	}
	// For CONNECT, net/http takes the authority-form request target as
	// req.Host and leaves URL.Host equal to it; a Host header does not change it.
	addr := req.URL.Host
	if addr == "" {
		addr = req.RequestURI
	}
	if err := checkDialTarget(addr); err != nil {
		return "", err
	}
	if req.ContentLength > 0 || len(req.TransferEncoding) > 0 {
		return "", statusErrorf(http.StatusBadRequest, "CONNECT request must not have a body")
	}
	return addr, nil
}

// checkDialTarget checks a dial address from a frontend before any agent
// sees it: 400 when it is not host:port, 403 for a zoned IPv6 address
// ("[fe80::1%eth0]:80", sent as %25 in a request target), whose zone would
// pick a network interface of the agent's host past every address rule.
func checkDialTarget(addr string) error {
	host, err := splitDialAddress(addr)
	if err != nil {
		return statusErrorf(http.StatusBadRequest, "%v", err)
	}
	if strings.Contains(host, "%") {
		return statusErrorf(http.StatusForbidden, "destination %s refused: a zoned address names a network interface of the agent's host, which no rule can check", cleanErr(errors.New(addr)))
	}
	return nil
}

// cleanErr keeps client-supplied bytes out of error text beyond a short,
// printable prefix.
func cleanErr(err error) string {
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

// writeStatus answers a frontend request with a short text body and asks the
// client to close.
func writeStatus(w io.Writer, code int, msg string) error {
	if msg == "" {
		msg = http.StatusText(code)
	}
	msg = strings.TrimSpace(msg) + "\n"
	_, err := fmt.Fprintf(w, "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		code, http.StatusText(code), len(msg), msg)
	return err
}

// connectEstablished is the exact answer kube-apiserver's dialer expects: no
// headers and no body, so nothing is buffered behind it.
const connectEstablished = "HTTP/1.1 200 Connection Established\r\n\r\n"

// errMsg is what a peer is told of err: a StatusError's message, or the
// error's text.
func errMsg(err error) string {
	var se *StatusError
	if errors.As(err, &se) {
		return se.Msg
	}
	return err.Error()
}
