package kubeapi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// An answer's Status gives the reason and message; any other body gives
// the reason client-go assumes for the code, and a long message is cut.
func TestDecodeStatus(t *testing.T) {
	long := strings.Repeat("m", 1000)
	for _, c := range []struct {
		code               int
		body               string
		wantCode           int
		wantReason, wantIn string
	}{
		{404, `{"kind":"Status","reason":"NotFound","message":"leases \"x\" not found","code":404}`, 404, "NotFound", `leases "x" not found`},
		{500, `{"kind":"Status","reason":"Conflict","code":409}`, 409, "Conflict", ""},
		{403, `<html>nope</html>`, 403, "Forbidden", ""},
		{410, ``, 410, "Expired", ""},
		{502, `{"kind":"Other","reason":"X"}`, 502, "InternalError", ""},
		{418, `{}`, 418, "Unknown", ""},
		{400, `{"kind":"Status","message":"` + long + `"}`, 400, "BadRequest", strings.Repeat("m", maxMessage) + "..."},
	} {
		e := DecodeStatus(c.code, []byte(c.body))
		if e.Code != c.wantCode || e.Reason != c.wantReason || e.Message != c.wantIn {
			t.Errorf("DecodeStatus(%d, %.40q) = %d %q %.40q, want %d %q %.40q", c.code, c.body, e.Code, e.Reason, e.Message, c.wantCode, c.wantReason, c.wantIn)
		}
	}
	if e := EventError([]byte(`{"kind":"Status","reason":"Expired","code":410}`)); !IsCode(fmt.Errorf("watch: %w", e), http.StatusGone) {
		t.Errorf("ERROR event with code 410: %v", e)
	}
	if e := EventError([]byte(`{}`)); e.Code != http.StatusInternalServerError {
		t.Errorf("ERROR event without a code: %v", e)
	}
	if _, _, ok := Status(errors.New("dial tcp: refused")); ok {
		t.Error("a network error is taken as an API answer")
	}
}

// Each object read through a BoundedReader gets the whole limit; one
// byte more fails with a *TooLargeError until Renew.
func TestBoundedReader(t *testing.T) {
	br := NewBoundedReader(strings.NewReader(strings.Repeat("x", 25)), 10)
	buf := make([]byte, 100)
	if n, err := io.ReadFull(br, buf[:10]); n != 10 || err != nil {
		t.Fatalf("read of the limit: %d, %v", n, err)
	}
	var tl *TooLargeError
	if _, err := br.Read(buf); !errors.As(err, &tl) || tl.Limit != 10 {
		t.Fatalf("read past the limit: %v", err)
	}
	br.Renew()
	if n, err := br.Read(buf); n != 10 || err != nil {
		t.Fatalf("read after Renew: %d, %v", n, err)
	}
	if got := (&TooLargeError{Limit: 2 << 20}).Error(); got != "object larger than 2 MiB" {
		t.Errorf("message: %q", got)
	}
}

// Pace spaces calls by gap and gives up when ctx ends; Jitter stays
// within its factor.
func TestPace(t *testing.T) {
	var last time.Time
	ctx := context.Background()
	if !Pace(ctx, &last, time.Hour) || time.Since(last) > time.Minute {
		t.Fatalf("first call waited or was not recorded: %v", last)
	}
	start := time.Now()
	if !Pace(ctx, &last, 20*time.Millisecond) || time.Since(start) < 10*time.Millisecond {
		t.Fatalf("second call %v after the first, want about 20ms", time.Since(start))
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if Pace(cancelled, &last, time.Hour) {
		t.Fatal("Pace went on after ctx ended")
	}
	for range 100 {
		if d := Jitter(time.Second, 0.1); d < time.Second || d > 1100*time.Millisecond {
			t.Fatalf("Jitter(1s, 0.1) = %v", d)
		}
	}
}
