package h2link

import (
	"bytes"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/certs"
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
