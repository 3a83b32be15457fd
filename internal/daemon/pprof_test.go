package daemon

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
)

// The pprof endpoints answer as net/http/pprof's do, less delta profiles.
func TestProfilingEndpoints(t *testing.T) {
	checkNoLeaks(t)
	mux := http.NewServeMux()
	addProfiling(mux)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	get := func(method, path, body string) (int, string, string) {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header.Get("Content-Type"), string(b)
	}
	for _, c := range []struct {
		method, path, body string
		code               int
		ctype, has         string
	}{
		{"GET", "/debug/pprof/", "", 200, "text/html", `href="goroutine?debug=1"`},
		{"GET", "/debug/pprof/goroutine?debug=1", "", 200, "text/plain", "goroutine profile: total "},
		{"GET", "/debug/pprof/heap?gc=1", "", 200, "application/octet-stream", ""},
		{"GET", "/debug/pprof/heap?seconds=5", "", 400, "text/plain", "go tool pprof -base"},
		{"GET", "/debug/pprof/nosuch", "", 404, "text/plain", "unknown profile"},
		{"GET", "/debug/pprof/cmdline", "", 200, "text/plain", ""},
		{"GET", "/debug/pprof/profile?seconds=0.05", "", 200, "application/octet-stream", ""},
		{"GET", "/debug/pprof/trace?seconds=0.05", "", 200, "application/octet-stream", ""},
		{"GET", "/debug/pprof/symbol", "", 200, "text/plain", "num_symbols: 1"},
		{"POST", "/debug/pprof/symbol", fmt.Sprintf("%#x", reflect.ValueOf(TestProfilingEndpoints).Pointer()), 200, "text/plain", "TestProfilingEndpoints"},
	} {
		code, ctype, body := get(c.method, c.path, c.body)
		if code != c.code || !strings.HasPrefix(ctype, c.ctype) || !strings.Contains(body, c.has) || (c.code == 200 && body == "" && c.path != "/debug/pprof/cmdline") {
			t.Errorf("%s %s: %d %s %q; want %d %s containing %q", c.method, c.path, code, ctype, truncateBody(body), c.code, c.ctype, c.has)
		}
	}
}

func truncateBody(s string) string {
	if len(s) > 200 {
		return s[:200] + "..."
	}
	return s
}
