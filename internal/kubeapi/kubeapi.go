package kubeapi

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// MaxErrorBody bounds how much of an answer other than success is read:
// a Status is a few hundred bytes, and a broken or hostile endpoint must
// not exhaust memory with one.
const MaxErrorBody = 64 << 10

// maxMessage bounds the Status message an *Error keeps, so one answer
// cannot flood a log line.
const maxMessage = 256

// Error is an answer from the apiserver other than success: its HTTP
// status code and the Status reason (e.g. "NotFound", "Conflict") and
// message.
type Error struct {
	Code    int
	Reason  string
	Message string
	// Body is the answer as it was read (at most MaxErrorBody bytes), for
	// a caller that shows what an answer other than a Status said once it
	// took out what must not be shown; Error never prints it.
	Body []byte
}

func (e *Error) Error() string {
	if e.Message != "" {
		return fmt.Sprintf("apiserver: %d %s: %s", e.Code, e.Reason, e.Message)
	}
	return fmt.Sprintf("apiserver: %d %s", e.Code, e.Reason)
}

// Status returns the code and reason of an *Error in err's chain; ok is
// false for errors that never reached the apiserver (network, TLS,
// decoding).
func Status(err error) (code int, reason string, ok bool) {
	var e *Error
	if errors.As(err, &e) {
		return e.Code, e.Reason, true
	}
	return 0, "", false
}

// IsCode reports whether err is the apiserver's answer with status code.
func IsCode(err error, code int) bool {
	c, _, ok := Status(err)
	return ok && c == code
}

// statusJSON is a metav1.Status.
type statusJSON struct {
	Kind    string `json:"kind"`
	Message string `json:"message"`
	Reason  string `json:"reason"`
	Code    int    `json:"code"`
}

// DecodeStatus makes the *Error of an answer with HTTP status code and
// body. A body that is a Status gives the reason, message and (when set)
// code; any other body leaves the reason client-go assumes for the code.
func DecodeStatus(code int, body []byte) *Error {
	e := &Error{Code: code}
	var st statusJSON
	if json.Unmarshal(body, &st) == nil && st.Kind == "Status" {
		e.Reason, e.Message = st.Reason, st.Message
		if st.Code != 0 {
			e.Code = st.Code
		}
	}
	if e.Reason == "" {
		e.Reason = reasonFor(e.Code)
	}
	if len(e.Message) > maxMessage {
		e.Message = e.Message[:maxMessage] + "..."
	}
	return e
}

// EventError makes the *Error of a watch event of type ERROR, whose object
// is a Status; one without a code is taken as 500.
func EventError(object []byte) *Error {
	var st statusJSON
	_ = json.Unmarshal(object, &st)
	code := st.Code
	if code == 0 {
		code = http.StatusInternalServerError
	}
	return DecodeStatus(code, object)
}

// reasonFor is the Status reason client-go assumes when the body of an
// error answer is not a Status.
func reasonFor(code int) string {
	switch code {
	case http.StatusBadRequest:
		return "BadRequest"
	case http.StatusUnauthorized:
		return "Unauthorized"
	case http.StatusForbidden:
		return "Forbidden"
	case http.StatusNotFound:
		return "NotFound"
	case http.StatusMethodNotAllowed:
		return "MethodNotAllowed"
	case http.StatusConflict:
		return "Conflict"
	case http.StatusGone:
		return "Expired"
	case http.StatusUnprocessableEntity:
		return "Invalid"
	case http.StatusTooManyRequests:
		return "TooManyRequests"
	case http.StatusGatewayTimeout:
		return "Timeout"
	case http.StatusServiceUnavailable:
		return "ServiceUnavailable"
	}
	if code >= 500 {
		return "InternalError"
	}
	return "Unknown"
}

// TooLargeError is what a BoundedReader returns once an object took more
// than its limit.
type TooLargeError struct {
	Limit int64
}

func (e *TooLargeError) Error() string {
	if e.Limit%(1<<20) == 0 {
		return fmt.Sprintf("object larger than %d MiB", e.Limit>>20)
	}
	return fmt.Sprintf("object larger than %d bytes", e.Limit)
}

// BoundedReader reads a stream of objects (list items, watch events) and
// fails with a *TooLargeError once more than limit bytes were read since
// the last Renew, bounding each object alone. It belongs to the goroutine
// that reads the stream.
type BoundedReader struct {
	r     io.Reader
	limit int64
	left  int64
}

// NewBoundedReader reads r with a budget of limit bytes for the first
// object.
func NewBoundedReader(r io.Reader, limit int64) *BoundedReader {
	return &BoundedReader{r: r, limit: limit, left: limit}
}

// Renew gives the next object the whole budget again.
func (b *BoundedReader) Renew() { b.left = b.limit }

func (b *BoundedReader) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, &TooLargeError{Limit: b.limit}
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.r.Read(p)
	b.left -= int64(n)
	return n, err
}
