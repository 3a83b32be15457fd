package e2e

import (
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/testnet"
	"github.com/summerwind/h2spec/config"
	"github.com/summerwind/h2spec/generic"
	"github.com/summerwind/h2spec/hpack"
	h2spechttp2 "github.com/summerwind/h2spec/http2"
	"github.com/summerwind/h2spec/spec"
)

// h2specExceptions are the h2spec cases the link fails on purpose, by
// h2spec's own ID (what `h2spec ID` runs). Each one is in the table in
// RELIABILITY.md, HTTP/2 conformance with its RFC section and why; keep the two in step. A
// failure not listed here fails TestH2Spec.
var h2specExceptions = map[string]string{
	"http2/4.2/3": "the link advertises SETTINGS_MAX_FRAME_SIZE 65536; h2spec's 20 KB HEADERS frame is within it",
}

// TestH2Spec runs h2spec v2.2.1 (generic, RFC 7540 and HPACK sections)
// against the serving end of the HTTP/2 link: the gRPC front door, its
// Unix socket bridged to a loopback TCP port. Go's own HTTP/2 server runs
// through the same bridge as a reference, logged only.
func TestH2Spec(t *testing.T) {
	s := startServer(t, "--mode=grpc")
	addr := bridgeToUnix(t, s.sock)
	failed, total := runH2Spec(t, addr)
	t.Logf("konnectivity gRPC front door: %d of %d h2spec cases failed", len(failed), total)

	var unexpected []string
	for _, id := range failed {
		if _, ok := h2specExceptions[id.id]; ok {
			t.Logf("  expected failure %s: %s", id.id, id.desc)
			continue
		}
		unexpected = append(unexpected, fmt.Sprintf("%s %s: %s", id.id, id.desc, id.err))
	}
	for id := range h2specExceptions {
		if !containsID(failed, id) {
			t.Logf("  exception %s passed this time: check RELIABILITY.md, HTTP/2 conformance", id)
		}
	}
	if len(unexpected) > 0 {
		t.Errorf("h2spec cases failed that are not in h2specExceptions (RELIABILITY.md, HTTP/2 conformance):\n  %s", strings.Join(unexpected, "\n  "))
	}

	// The reference: Go's net/http HTTP/2 server (prior knowledge) behind
	// the same bridge.
	ref := serveNetHTTPUnix(t)
	refFailed, refTotal := runH2Spec(t, bridgeToUnix(t, ref))
	ids := make([]string, 0, len(refFailed))
	for _, f := range refFailed {
		ids = append(ids, f.id)
	}
	t.Logf("Go net/http HTTP/2 server: %d of %d h2spec cases failed: %s", len(refFailed), refTotal, strings.Join(ids, " "))
}

type h2specFailure struct{ id, desc, err string }

func containsID(fs []h2specFailure, id string) bool {
	for _, f := range fs {
		if f.id == id {
			return true
		}
	}
	return false
}

var h2specMu sync.Mutex // h2spec's output and counters are package state

// runH2Spec runs the three sections against addr and returns the failed
// cases by ID and how many ran.
func runH2Spec(t *testing.T, addr string) (failed []h2specFailure, total int) {
	t.Helper()
	h2specMu.Lock()
	defer h2specMu.Unlock()
	host, port, _ := net.SplitHostPort(addr)
	var p int
	fmt.Sscan(port, &p)
	c := &config.Config{Host: host, Port: p, Path: "/", Timeout: 2 * time.Second, MaxHeaderLen: 4000}

	// h2spec prints every case; keep it out of the test's output.
	stdout := os.Stdout
	if devnull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0); err == nil {
		os.Stdout = devnull
		defer func() { os.Stdout = stdout; devnull.Close() }()
	}
	for _, g := range []*spec.TestGroup{generic.Spec(), h2spechttp2.Spec(), hpack.Spec()} {
		g.Test(c)
		walkH2Spec(g, func(id string, tc *spec.TestCase) {
			if tc.Result == nil || tc.Result.Skipped {
				return
			}
			total++
			if tc.Result.Failed {
				msg := ""
				if tc.Result.Error != nil {
					msg = strings.Join(strings.Fields(tc.Result.Error.Error()), " ")
				}
				failed = append(failed, h2specFailure{id: id, desc: tc.Desc, err: msg})
			}
		})
	}
	sort.Slice(failed, func(i, j int) bool { return failed[i].id < failed[j].id })
	return failed, total
}

// walkH2Spec calls f for every case under g with its h2spec ID
// ("http2/6.9.1/2": group, then the case's place in it from 1).
func walkH2Spec(g *spec.TestGroup, f func(id string, tc *spec.TestCase)) {
	for i, tc := range g.Tests {
		f(fmt.Sprintf("%s/%d", g.ID(), i+1), tc)
	}
	for _, sub := range g.Groups {
		walkH2Spec(sub, f)
	}
}

// bridgeToUnix forwards a loopback TCP port to the Unix socket sock, one
// connection each way, until the test ends.
func bridgeToUnix(t *testing.T, sock string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := testnet.Serve(ln, func(c net.Conn) {
		u, err := net.Dial("unix", sock)
		if err != nil {
			return
		}
		defer u.Close()
		done := make(chan struct{})
		go func() { io.Copy(c, u); c.(*net.TCPConn).CloseWrite(); close(done) }()
		if _, err := io.Copy(u, c); err != nil {
			u.Close() // c was closed, not half-closed: end the other way too
		} else {
			u.(*net.UnixConn).CloseWrite()
		}
		<-done
	})
	t.Cleanup(srv.Close)
	return ln.Addr().String()
}

// serveNetHTTPUnix serves Go's net/http HTTP/2 (prior knowledge, no TLS)
// on a Unix socket, answering each request with a short body as the gRPC
// front door answers a non-gRPC one.
func serveNetHTTPUnix(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "h2ref")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "s")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{
		Protocols: &protocols,
		ErrorLog:  log.New(io.Discard, "", 0),
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			w.WriteHeader(http.StatusUnsupportedMediaType)
			io.WriteString(w, "not gRPC\n")
		}),
	}
	done := make(chan struct{})
	go func() { srv.Serve(ln); close(done) }()
	t.Cleanup(func() { srv.Close(); <-done })
	return sock
}
