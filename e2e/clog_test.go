package e2e

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// stuckAgent is a raw agent with the test PKI's valid client certificate:
// it logs in, gives the server huge flow-control windows, answers every
// stream 200, and stops reading its link once it answered its first
// CONNECT (the server's writes to it then block in the socket).
type stuckAgent struct {
	conn    *tls.Conn
	clogged chan struct{} // closed once it answered a CONNECT and stopped reading
}

func loginStuckAgent(t *testing.T, s *server, id string) *stuckAgent {
	t.Helper()
	cert, err := tls.LoadX509KeyPair(s.pki.agentCert, s.pki.agentKey)
	if err != nil {
		t.Fatal(err)
	}
	caPEM, err := os.ReadFile(s.pki.caCert)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", "127.0.0.1:"+strconv.Itoa(s.agentPort),
		&tls.Config{RootCAs: pool, ServerName: "127.0.0.1", Certificates: []tls.Certificate{cert}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "GET /konnectivity/v1/tunnel HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: konnectivity-h2\r\nKonnectivity-Agent-Id: %s\r\n\r\n", id)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("stuck agent login: %v %v", resp, err)
	}
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(br, preface); err != nil || string(preface) != http2.ClientPreface {
		t.Fatalf("stuck agent: preface %q, %v", preface, err)
	}
	conn.SetDeadline(time.Time{})
	fr := http2.NewFramer(conn, br)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30})
	fr.WriteWindowUpdate(0, 1<<30)
	a := &stuckAgent{conn: conn, clogged: make(chan struct{})}
	go func() {
		var hbuf bytes.Buffer
		enc := hpack.NewEncoder(&hbuf)
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.SettingsFrame:
				if !f.IsAck() {
					fr.WriteSettingsAck()
				}
			case *http2.MetaHeadersFrame:
				hbuf.Reset()
				enc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
				fr.WriteHeaders(http2.HeadersFrameParam{StreamID: f.StreamID, BlockFragment: hbuf.Bytes(), EndHeaders: true})
				if f.PseudoValue("method") == http.MethodConnect {
					close(a.clogged)
					return // reads no more
				}
			}
		}
	}()
	return a
}

// TestFaultAgentStopsReading: an agent with a valid certificate answers a
// tunnel and then stops reading its link while the tunnel's client
// uploads, so the server's write to that link blocks. Every dial is
// answered within --backend-dial-timeout (3 s) plus slack, those after the
// stall bound (5 s) all through the good agent, and a SIGHUP meanwhile
// does not wait for the stuck link.
func TestFaultAgentStopsReading(t *testing.T) {
	s := startServerBin(t, copyExecutable(t, t.TempDir()), frontendUDS, "--restart-grace=10s")
	s.startAgent(t, "good", "", "--sync-interval=100ms", "--sync-interval-cap=200ms")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	evil := loginStuckAgent(t, s, "stuck")
	s.waitAgents(t, 2, 10*time.Second)

	// Dial until one lands on the stuck agent (the default strategy
	// takes the agents in turn).
	var clog net.Conn
	for i := 0; clog == nil; i++ {
		if i == 6 {
			t.Fatal("no dial of 6 landed on the stuck agent")
		}
		c := dialThrough(t, s, backend)
		select {
		case <-evil.clogged:
			clog = c
		case <-time.After(200 * time.Millisecond):
			c.Close()
		}
	}
	uploading := make(chan struct{})
	go func() {
		defer close(uploading)
		chunk := make([]byte, 1<<20)
		clog.SetWriteDeadline(time.Now().Add(40 * time.Second))
		for range 256 {
			if _, err := clog.Write(chunk); err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() { clog.Close(); <-uploading })
	clogged := time.Now()
	time.Sleep(500 * time.Millisecond) // the server's write to the stuck link blocks

	const bound = 3*time.Second + time.Second // --backend-dial-timeout plus slack
	var slowest time.Duration
	ok, failed := 0, 0
	for i := range 24 {
		time.Sleep(400 * time.Millisecond)
		el, err := dialErr(t, s.egressDialer(t), backend, 15*time.Second)
		slowest = max(slowest, el)
		since := time.Since(clogged)
		if el > bound {
			t.Fatalf("dial %d (%.1f s after the clog): answered after %v (%v), bound %v", i, since.Seconds(), el.Round(time.Millisecond), err, bound)
		}
		if err != nil {
			failed++
			if since > 5*time.Second+bound {
				t.Fatalf("dial %d, %.1f s after the clog (past the stall bound): %v", i, since.Seconds(), err)
			}
			continue
		}
		ok++
	}
	t.Logf("24 dials over 10 s while an agent does not read its link: %d served, %d refused, slowest answer %v", ok, failed, slowest.Round(time.Millisecond))

	took := restartOnce(t, s)
	t.Logf("SIGHUP with the stuck link: the next image served %v after the signal (--restart-grace=10s)", took.Round(time.Millisecond))
	if took > 5*time.Second {
		t.Fatalf("the restart took %v: it waited for the stuck link", took)
	}
	checkReachable(t, s.egressDialer(t), backend, "b1", 5)
}
