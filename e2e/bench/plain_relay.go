package main

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchdial"
	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

// The plain TLS relay: the simplest program with the tunnel's shape, in two
// processes as the tunnel is: a near relay takes HTTP CONNECT on a Unix
// socket and opens a TLS connection to a far relay, which dials the
// destination; both copy with io.CopyBuffer and 128 KiB buffers, one
// goroutine per direction, nothing else (no multiplexing, no flow control,
// no authentication). It is what Go's standard pieces give for three
// socket hops and two TLS ends on this machine, a reference beside direct
// loopback for the tunnel's throughput and CPU per GiB. (Not a floor: the
// tunnel gathers TLS records into fewer system calls, and beats it.)
const (
	relayNearEnv = "KONNECTIVITY_BENCH_RELAY_NEAR" // socket path|far address
	relayFarEnv  = "KONNECTIVITY_BENCH_RELAY_FAR"
)

const relayBuf = 128 << 10

// runRelayFar serves TLS on a loopback port: each connection names its
// destination in a first line; the relay dials it, answers "OK" and copies.
func runRelayFar() int {
	cert, err := selfSigned()
	if err != nil {
		fmt.Fprintf(os.Stderr, "relay far: %v\n", err)
		return 1
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}})
	if err != nil {
		fmt.Fprintf(os.Stderr, "relay far: %v\n", err)
		return 1
	}
	fmt.Println(ln.Addr().String())
	return serveUntilStdinCloses(ln, func(c net.Conn) {
		br := bufio.NewReader(c)
		addr, err := br.ReadString('\n')
		if err != nil {
			return
		}
		dest, err := net.Dial("tcp", strings.TrimSpace(addr))
		if err != nil {
			io.WriteString(c, "ERR\n")
			return
		}
		defer dest.Close()
		if _, err := io.WriteString(c, "OK\n"); err != nil {
			return
		}
		relayBoth(bufferedConn{br, c}, bufferedConn{dest, dest})
	})
}

// runRelayNear serves HTTP CONNECT on a Unix socket through the far relay.
func runRelayNear(spec string) int {
	sock, far, ok := strings.Cut(spec, "|")
	if !ok {
		fmt.Fprintf(os.Stderr, "relay near: want socket|far address, got %q\n", spec)
		return 2
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		fmt.Fprintf(os.Stderr, "relay near: %v\n", err)
		return 1
	}
	fmt.Println(sock)
	cfg := &tls.Config{InsecureSkipVerify: true} // a reference on loopback: the cipher is what matters
	return serveUntilStdinCloses(ln, func(c net.Conn) {
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil || req.Method != http.MethodConnect {
			io.WriteString(c, "HTTP/1.1 400 Bad Request\r\n\r\n")
			return
		}
		up, err := tls.Dial("tcp", far, cfg)
		if err != nil {
			io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\n\r\n")
			return
		}
		defer up.Close()
		ur := bufio.NewReader(up)
		if _, err := fmt.Fprintf(up, "%s\n", req.Host); err != nil {
			return
		}
		if line, err := ur.ReadString('\n'); err != nil || line != "OK\n" {
			io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\n\r\n")
			return
		}
		if _, err := io.WriteString(c, benchdial.ConnectOK); err != nil {
			return
		}
		relayBoth(bufferedConn{br, c}, bufferedConn{ur, up})
	})
}

// serveUntilStdinCloses serves each connection on ln on its own goroutine
// until the bench closes the helper's stdin (however the bench ended).
func serveUntilStdinCloses(ln net.Listener, serve func(net.Conn)) int {
	go func() { _, _ = io.Copy(io.Discard, os.Stdin); ln.Close() }()
	for {
		c, err := ln.Accept()
		if err != nil {
			return 0
		}
		go func() {
			defer c.Close()
			serve(c)
		}()
	}
}

// relayBoth copies each side's reads to the other side's connection,
// passing half-closes on, until both directions ended.
func relayBoth(x, y bufferedConn) {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		io.CopyBuffer(y.Conn, x.r, make([]byte, relayBuf))
		closeWrite(y.Conn)
	}()
	io.CopyBuffer(x.Conn, y.r, make([]byte, relayBuf))
	closeWrite(x.Conn)
	wg.Wait()
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		cw.CloseWrite()
	}
}

// bufferedConn reads through the reader that read the head.
type bufferedConn struct {
	r io.Reader
	net.Conn
}

func (b bufferedConn) Read(p []byte) (int, error) { return b.r.Read(p) }

func selfSigned() (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "plain relay"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

// plainRelay is the two relay processes, started for the throughput phase.
type plainRelay struct {
	near, far *helperProc
	sock      string
}

func startPlainRelay(ctx context.Context, sock string) (*plainRelay, error) {
	far, err := startHelper(ctx, "plain TLS relay (far)", relayFarEnv+"=1")
	if err != nil {
		return nil, err
	}
	if _, err := net.ResolveTCPAddr("tcp", far.addr); err != nil || far.addr == "" {
		far.stop()
		return nil, fmt.Errorf("far relay gave no address (%q)", far.addr)
	}
	near, err := startHelper(ctx, "plain TLS relay (near)", relayNearEnv+"="+sock+"|"+far.addr)
	if err != nil {
		far.stop()
		return nil, err
	}
	if near.addr != sock {
		near.stop()
		far.stop()
		return nil, fmt.Errorf("near relay did not come up on %s (printed %q)", sock, near.addr)
	}
	return &plainRelay{near: near, far: far, sock: sock}, nil
}

func (r *plainRelay) stop() {
	r.near.stop()
	r.far.stop()
}

// cpuTicks is both relays' CPU so far.
func (r *plainRelay) cpuTicks() (int64, error) {
	n, err1 := benchproc.CPUTicks(r.near.cmd.Process.Pid)
	f, err2 := benchproc.CPUTicks(r.far.cmd.Process.Pid)
	if err1 != nil {
		return 0, err1
	}
	return n + f, err2
}
