package h2link

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/certs"
	"golang.org/x/net/http2"
)

// countingConn counts the writes that reach the socket.
type countingConn struct {
	net.Conn
	writes atomic.Int64
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// TestBatchedTLSWritesAFrameInOneSyscall checks that a whole HTTP/2 DATA
// frame (five TLS records) reaches the socket in one write, arrives intact,
// and that the connection holds no batch buffer afterwards.
func TestBatchedTLSWritesAFrameInOneSyscall(t *testing.T) {
	checkNoLeaks(t)
	cert, pool := testCert(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	frame := make([]byte, MaxFrameSize+9)
	rand.Read(frame)
	got := make(chan []byte, 1)
	go func() {
		raw, err := ln.Accept()
		if err != nil {
			got <- nil
			return
		}
		defer raw.Close()
		srv := TLSServer(raw, &tls.Config{Certificates: []tls.Certificate{cert}})
		buf := make([]byte, len(frame))
		if _, err := io.ReadFull(srv, buf); err != nil {
			got <- nil
			return
		}
		got <- buf
	}()
	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	counted := &countingConn{Conn: raw}
	cli := TLSClient(counted, &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"})
	if err := cli.Handshake(); err != nil {
		t.Fatal(err)
	}
	before := counted.writes.Load()
	if _, err := cli.Write(frame); err != nil {
		t.Fatal(err)
	}
	if n := counted.writes.Load() - before; n != 1 {
		t.Errorf("a %d-byte write took %d socket writes, want 1", len(frame), n)
	}
	if cli.raw.buf != nil {
		t.Error("the batch buffer is still held after the write")
	}
	if b := <-got; !bytes.Equal(b, frame) {
		t.Error("the frame arrived damaged or not at all")
	}
}

// testCert is a throwaway CA's certificate for 127.0.0.1, and a pool
// trusting it.
func testCert(t *testing.T) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	ca, err := certs.NewCA("test CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	certPEM, keyPEM, err := ca.Issue(certs.Request{CommonName: "server", IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, Validity: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca.Cert)
	return cert, pool
}

// recordingConn keeps each write that reaches the socket.
type recordingConn struct {
	net.Conn
	mu     sync.Mutex // guards writes
	writes [][]byte
}

func (c *recordingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.writes = append(c.writes, bytes.Clone(p))
	c.mu.Unlock()
	return c.Conn.Write(p)
}

func (c *recordingConn) written() [][]byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.writes)
}

// TestStartWritesOneBatch checks that each end's start reaches the socket
// in one write under a Batcher: the client's prelude (an upgrade answer),
// preface, SETTINGS and connection WINDOW_UPDATE, then the server's
// SETTINGS and WINDOW_UPDATE. An agent fleet reconnecting at once pays a
// system call per agent and end for it, not one per frame.
func TestStartWritesOneBatch(t *testing.T) {
	checkNoLeaks(t)
	near, far := connPair(t, "tcp", "127.0.0.1:0")
	rn, rf := &recordingConn{Conn: near}, &recordingConn{Conn: far}
	var wg sync.WaitGroup
	spawn := func(f func()) { wg.Add(1); go func() { defer wg.Done(); f() }() }
	defer wg.Wait()
	prelude := []byte("HTTP/1.1 101 Switching Protocols\r\n\r\n")
	var c *Conn
	started := make(chan error, 1)
	go func() {
		var err error
		b := NewBatcher(rn)
		c, err = NewClient(b, Config{Spawn: spawn, Prelude: prelude, Batch: b})
		started <- err
	}()
	br := bufio.NewReader(far)
	line, err := br.ReadString('\n')
	if err != nil || line != "HTTP/1.1 101 Switching Protocols\r\n" {
		t.Fatalf("first line %q, %v", line, err)
	}
	if _, err := br.Discard(2); err != nil {
		t.Fatal(err)
	}
	b := NewBatcher(rf)
	s, err := NewServer(&bufferedTestConn{Conn: b, r: br}, Config{Spawn: spawn, Batch: b}, http.NotFoundHandler())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := <-started; err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	frames := func(w []byte) (kinds []http2.FrameType) {
		fr := http2.NewFramer(nil, bytes.NewReader(w))
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return kinds
			}
			kinds = append(kinds, f.Header().Type)
		}
	}
	cw := rn.written()
	if len(cw) == 0 {
		t.Fatal("the client wrote nothing")
	}
	first, ok := bytes.CutPrefix(cw[0], append(slices.Clone(prelude), http2.ClientPreface...))
	if !ok {
		t.Fatalf("the client's first write does not start with prelude and preface: %q", cw[0])
	}
	if got := frames(first); !slices.Equal(got, []http2.FrameType{http2.FrameSettings, http2.FrameWindowUpdate}) {
		t.Errorf("the client's first write carries frames %v beside its preface, want SETTINGS and WINDOW_UPDATE (%d writes in all)", got, len(cw))
	}
	sw := rf.written()
	if len(sw) == 0 {
		t.Fatal("the server wrote nothing")
	}
	if got := frames(sw[0]); !slices.Equal(got, []http2.FrameType{http2.FrameSettings, http2.FrameWindowUpdate}) {
		t.Errorf("the server's first write carries frames %v, want SETTINGS and WINDOW_UPDATE", got)
	}
}

// bufferedTestConn reads what a bufio.Reader kept first.
type bufferedTestConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedTestConn) Read(p []byte) (int, error) { return c.r.Read(p) }
