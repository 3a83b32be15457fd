package tunnel

import (
	"bytes"
	"crypto/rand"
	"crypto/tls"
	"io"
	"net"
	"sync/atomic"
	"testing"
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
	p := newPKI(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	frame := make([]byte, maxFrameSize+9)
	rand.Read(frame)
	got := make(chan []byte, 1)
	go func() {
		raw, err := ln.Accept()
		if err != nil {
			got <- nil
			return
		}
		defer raw.Close()
		srv := tlsServer(raw, &tls.Config{Certificates: []tls.Certificate{p.serverCert}})
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
	cli := tlsClient(counted, &tls.Config{RootCAs: p.pool, ServerName: "127.0.0.1"})
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
