package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// alpnRouter is a TLS passthrough that picks a backend by the ALPN
// protocols of the ClientHello, without terminating TLS, as an ingress
// SNI/ALPN router does on a port several TLS services share.
type alpnRouter struct {
	ln               net.Listener
	proto            string // routed to match; anything else to other
	match, other     string // backend addresses
	toMatch, toOther atomic.Int64
	wg               sync.WaitGroup // the accept goroutine and one per connection

	mu    sync.Mutex
	conns map[net.Conn]struct{} // guarded by mu: both ends of every connection, closed by close; nil once closed
}

func startALPNRouter(t *testing.T, proto, match, other string) *alpnRouter {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &alpnRouter{ln: ln, proto: proto, match: match, other: other, conns: map[net.Conn]struct{}{}}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if !r.track(c) {
				return
			}
			r.wg.Add(1)
			go func() { defer r.wg.Done(); r.route(c) }()
		}
	}()
	t.Cleanup(r.close)
	return r
}

func (r *alpnRouter) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.conns == nil {
		c.Close()
		return false
	}
	r.conns[c] = struct{}{}
	return true
}

func (r *alpnRouter) close() {
	r.ln.Close()
	r.mu.Lock()
	for c := range r.conns {
		c.Close()
	}
	r.conns = nil
	r.mu.Unlock()
	r.wg.Wait()
}

func (r *alpnRouter) route(c net.Conn) {
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	record, protos, err := readClientHello(c)
	c.SetReadDeadline(time.Time{})
	if err != nil {
		return
	}
	backend := r.other
	if slices.Contains(protos, r.proto) {
		backend = r.match
		r.toMatch.Add(1)
	} else {
		r.toOther.Add(1)
	}
	up, err := net.DialTimeout("tcp", backend, 5*time.Second)
	if err != nil {
		return
	}
	if !r.track(up) {
		return
	}
	defer up.Close()
	if _, err := up.Write(record); err != nil {
		return
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		io.Copy(up, c)
		up.(*net.TCPConn).CloseWrite()
	}()
	io.Copy(c, up)
	c.Close()
	<-done
}

// readClientHello reads the first TLS record, which must hold the whole
// ClientHello, and returns it with the ALPN protocols it offers.
func readClientHello(c net.Conn) (record []byte, protos []string, err error) {
	head := make([]byte, 5)
	if _, err := io.ReadFull(c, head); err != nil {
		return nil, nil, err
	}
	if head[0] != 22 { // handshake
		return nil, nil, errors.New("not a TLS handshake record")
	}
	n := int(binary.BigEndian.Uint16(head[3:]))
	record = make([]byte, 5+n)
	copy(record, head)
	if _, err := io.ReadFull(c, record[5:]); err != nil {
		return nil, nil, err
	}
	b := record[5:]
	// handshake type(1) length(3) version(2) random(32)
	if len(b) < 38 || b[0] != 1 {
		return nil, nil, errors.New("not a ClientHello")
	}
	b = b[38:]
	skip := func(lenBytes int) bool {
		if len(b) < lenBytes {
			return false
		}
		l := 0
		for i := range lenBytes {
			l = l<<8 | int(b[i])
		}
		if len(b) < lenBytes+l {
			return false
		}
		b = b[lenBytes+l:]
		return true
	}
	if !skip(1) || !skip(2) || !skip(1) || len(b) < 2 { // session ID, cipher suites, compression
		return record, nil, nil
	}
	exts := b[2:]
	for len(exts) >= 4 {
		typ, l := binary.BigEndian.Uint16(exts), int(binary.BigEndian.Uint16(exts[2:]))
		if len(exts) < 4+l {
			break
		}
		data := exts[4 : 4+l]
		exts = exts[4+l:]
		if typ != 16 || len(data) < 2 { // application_layer_protocol_negotiation
			continue
		}
		for list := data[2:]; len(list) > 0 && len(list) >= 1+int(list[0]); list = list[1+int(list[0]):] {
			protos = append(protos, string(list[1:1+int(list[0])]))
		}
	}
	return record, protos, nil
}

// TestAgentALPNRouted: a server that accepts an extra ALPN protocol
// (--alpn-proto) is reached through a TLS port an ALPN router shares with
// another service. An agent offering that protocol is routed to the server
// and carries a tunnel, and so is upstream's gRPC agent offering it; one
// without the flag is routed to the other service and never connects.
func TestAgentALPNRouted(t *testing.T) {
	const proto = "konnectivity-e2e"
	s := startServer(t, "--alpn-proto="+proto)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")

	// The other service on the shared port: a TLS HTTP server that knows
	// nothing of agents (as a kube-apiserver would answer them).
	cert, err := tls.LoadX509KeyPair(s.pki.serverCert, s.pki.serverKey)
	if err != nil {
		t.Fatal(err)
	}
	otherLn, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}})
	if err != nil {
		t.Fatal(err)
	}
	other := &http.Server{Handler: http.NotFoundHandler(), ReadHeaderTimeout: 5 * time.Second}
	go other.Serve(otherLn)
	t.Cleanup(func() { other.Close() })

	router := startALPNRouter(t, proto, "127.0.0.1:"+strconv.Itoa(s.agentPort), otherLn.Addr().String())
	_, routerPort, _ := net.SplitHostPort(router.ln.Addr().String())
	retries := []string{"--sync-interval=100ms", "--sync-interval-cap=500ms", "--proxy-server-port=" + routerPort}

	t.Run("with-alpn-proto", func(t *testing.T) {
		a := s.launchAgent(t, s.pki, "a1", "", append(retries, "--alpn-proto="+proto)...)
		waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusOK)
		if router.toMatch.Load() == 0 {
			t.Fatal("agent connected, but not through the router")
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		body, err := get(ctx, s.egressDialer(t).httpClient(false, nil), "http://"+backend+"/hello?i=7")
		if err != nil || body != "hello b1 7" {
			t.Fatalf("request through the tunnel: %q, %v", body, err)
		}
	})

	t.Run("upstream-agent", func(t *testing.T) {
		// Upstream's agent with --alpn-proto offers the protocol and h2
		// (grpc-go adds it); the server, preferring its own list,
		// settles on the protocol and tells gRPC by the first bytes.
		before := router.toMatch.Load()
		cfg := upstreamTLS(t, s.pki, true)
		cfg.NextProtos = []string{proto}
		port, _ := strconv.Atoi(routerPort)
		up, err := connectUpstreamAgent(t, port, cfg, "upstream-1", "", "")
		if err != nil {
			t.Fatalf("upstream-style agent through the router: %v", err)
		}
		if router.toMatch.Load() == before {
			t.Error("upstream-style agent connected, but not through the router")
		}
		up.stop()
	})

	t.Run("without-alpn-proto", func(t *testing.T) {
		before := router.toOther.Load()
		a := s.launchAgent(t, s.pki, "a2", "", retries...)
		waitFor(t, 20*time.Second, "the agent routed elsewhere, refused, and retrying", func() bool {
			return router.toOther.Load() >= before+2 && strings.Contains(a.proc.out.String(), "refused the connection")
		})
		if st := getStatus(t, a.healthURL("/readyz")); st == http.StatusOK {
			t.Error("agent ready though the router never sent it to the server")
		}
	})
}

// TestCipherSuites: --cipher-suites limits the TLS 1.2 suites of the agent
// port and the TCP frontend. A TLS 1.2 client offering only a suite outside
// the list is refused; one inside it is served. TLS 1.3, whose suites Go
// fixes, is served as before; an agent with the flag connects.
func TestCipherSuites(t *testing.T) {
	const (
		in     = tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 // the test PKI's keys are ECDSA
		out    = tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256
		inSSL  = "ECDHE-ECDSA-AES128-GCM-SHA256" // openssl's names for the same
		outSSL = "ECDHE-ECDSA-CHACHA20-POLY1305"
	)
	s := startServerWith(t, frontendTCP, "--cipher-suites="+tls.CipherSuiteName(in))
	s.startAgent(t, "a1", "", "--cipher-suites="+tls.CipherSuiteName(in))
	clientCert, err := tls.LoadX509KeyPair(s.pki.agentCert, s.pki.agentKey)
	if err != nil {
		t.Fatal(err)
	}
	caPEM, err := os.ReadFile(s.pki.caCert)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	ports := map[string]int{"agent port": s.agentPort, "TCP frontend": s.serverPort}
	for where, port := range ports {
		addr := "127.0.0.1:" + strconv.Itoa(port)
		handshake := func(maxVersion uint16, suite uint16) error {
			d := &net.Dialer{Timeout: 5 * time.Second}
			c, err := tls.DialWithDialer(d, "tcp", addr, &tls.Config{
				RootCAs: pool, ServerName: "127.0.0.1", Certificates: []tls.Certificate{clientCert},
				MaxVersion: maxVersion, CipherSuites: []uint16{suite},
			})
			if err == nil {
				c.Close()
			}
			return err
		}
		if err := handshake(tls.VersionTLS12, out); err == nil {
			t.Errorf("%s: TLS 1.2 with only %s (outside --cipher-suites) was served", where, tls.CipherSuiteName(out))
		}
		if err := handshake(tls.VersionTLS12, in); err != nil {
			t.Errorf("%s: TLS 1.2 with %s (inside --cipher-suites): %v", where, tls.CipherSuiteName(in), err)
		}
		if err := handshake(tls.VersionTLS13, out); err != nil {
			t.Errorf("%s: TLS 1.3 (its suites are Go's): %v", where, err)
		}
		if _, err := exec.LookPath("openssl"); err != nil {
			continue
		}
		sclient := func(cipher string) string {
			cmd := exec.Command("openssl", "s_client", "-connect", addr, "-tls1_2", "-cipher", cipher,
				"-CAfile", s.pki.caCert, "-cert", s.pki.agentCert, "-key", s.pki.agentKey)
			cmd.Stdin = strings.NewReader("")
			b, _ := cmd.CombinedOutput()
			return string(b)
		}
		if got := sclient(outSSL); strings.Contains(got, "Cipher is "+outSSL) || !strings.Contains(got, "alert") {
			t.Errorf("%s: openssl s_client -tls1_2 -cipher %s was not refused:\n%s", where, outSSL, got)
		}
		if got := sclient(inSSL); !strings.Contains(got, "Cipher is "+inSSL) {
			t.Errorf("%s: openssl s_client -tls1_2 -cipher %s was not served:\n%s", where, inSSL, got)
		}
	}
}

// TestAgentALPNRoutedServerDefaults: behind an ALPN router, with the
// server at its defaults (no --alpn-proto), as upstream's server runs: an
// agent given --alpn-proto offers that protocol for the router and its own
// after it, as upstream's agent does, so both ours and upstream's
// proxy-agent connect through the router and carry a tunnel.
func TestAgentALPNRoutedServerDefaults(t *testing.T) {
	const proto = "konnectivity-e2e"
	s := startServer(t)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	otherLn, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{loadPair(t, s.pki)}})
	if err != nil {
		t.Fatal(err)
	}
	other := &http.Server{Handler: http.NotFoundHandler(), ReadHeaderTimeout: 5 * time.Second}
	go other.Serve(otherLn)
	t.Cleanup(func() { other.Close() })
	router := startALPNRouter(t, proto, "127.0.0.1:"+strconv.Itoa(s.agentPort), otherLn.Addr().String())
	_, routerPort, _ := net.SplitHostPort(router.ln.Addr().String())
	reach := func(t *testing.T) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		body, err := get(ctx, s.egressDialer(t).httpClient(false, nil), "http://"+backend+"/hello?i=1")
		if err != nil || body != "hello b1 1" {
			t.Fatalf("request through the tunnel: %q, %v", body, err)
		}
	}

	t.Run("ours", func(t *testing.T) {
		a := s.launchAgent(t, s.pki, "a1", "", "--sync-interval=100ms", "--sync-interval-cap=500ms",
			"--proxy-server-port="+routerPort, "--alpn-proto="+proto)
		waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusOK)
		if router.toMatch.Load() == 0 {
			t.Fatal("agent connected, but not through the router")
		}
		reach(t)
		a.proc.stop(t)
		s.waitAgents(t, 0, 10*time.Second)
	})

	t.Run("upstream-proxy-agent", func(t *testing.T) {
		before := router.toMatch.Load()
		startProcEnv(t, upstreamAgentBin(t), "upstream-proxy-agent", nil,
			"--proxy-server-host=127.0.0.1", "--proxy-server-port="+routerPort,
			"--ca-cert="+s.pki.caCert, "--agent-cert="+s.pki.agentCert, "--agent-key="+s.pki.agentKey,
			"--alpn-proto="+proto,
			"--health-server-port="+strconv.Itoa(freePort(t)), "--admin-server-port="+strconv.Itoa(freePort(t)),
			"--sync-interval=100ms", "--sync-interval-cap=500ms", "--logtostderr=true")
		s.waitAgents(t, 1, startTimeout)
		if router.toMatch.Load() == before {
			t.Fatal("upstream's agent connected, but not through the router")
		}
		reach(t)
	})
}

// loadPair is the server certificate of p, for another TLS service.
func loadPair(t *testing.T, p *pki) tls.Certificate {
	t.Helper()
	cert, err := tls.LoadX509KeyPair(p.serverCert, p.serverKey)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}
