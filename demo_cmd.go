package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spinifex/konnectivity/certs"
	"github.com/spinifex/konnectivity/internal/daemon"
	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/server"
)

// runDemo is the embedded default: a throwaway CA, a server, an agent and a
// small HTTP backend, all on loopback, with a few dials made the way
// kube-apiserver makes them.
func runDemo(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("konnectivity demo")
	once := fs.Bool("once", false, "run the checks and exit instead of waiting for Ctrl-C")
	requests := fs.Int("requests", 5, "how many requests to send through the tunnel")
	connectPort := fs.Int("connect-port", 8190, "loopback port of a plain CONNECT listener for curl -p -x (0 picks one)")
	verbose := fs.Bool("verbose", false, "print the server's and agent's log lines")
	if code, done := parseFlags(fs, args, stdout, stderr); done {
		return code
	}
	log := slog.New(slog.DiscardHandler)
	if *verbose {
		log = slog.New(slog.NewTextHandler(stderr, nil))
	}
	ctx, stop := daemon.SignalContext(log)
	defer stop()
	if err := demo(ctx, stdout, log, *once, *requests, *connectPort); err != nil {
		fmt.Fprintf(stderr, "demo failed: %v\n", err)
		return 1
	}
	return 0
}

func demo(ctx context.Context, out io.Writer, log *slog.Logger, once bool, requests, connectPort int) error {
	dir, err := os.MkdirTemp("", "konnectivity-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	pki, err := newDemoPKI()
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "minted a throwaway CA and server/agent certificates in %s\n", dir)
	target, stopBackend, err := startDemoBackend()
	if err != nil {
		return err
	}
	defer stopBackend()
	srv, uds, agentAddr, err := startDemoServer(dir, pki, log)
	if err != nil {
		return err
	}
	defer srv.Close()
	stopAgent, err := startDemoAgent(ctx, agentAddr, pki, log)
	if err != nil {
		return err
	}
	defer stopAgent()

	fmt.Fprintf(out, "server: frontend %s, agents on %s\n", uds, agentAddr)
	deadline := time.Now().Add(10 * time.Second)
	for srv.AgentCount() == 0 {
		if time.Now().After(deadline) {
			return fmt.Errorf("the agent did not connect within 10s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	fmt.Fprintln(out, "agent: connected")
	if err := demoRequests(out, uds, target, requests); err != nil || once {
		return err
	}
	return demoByHand(ctx, out, srv, uds, target, connectPort)
}

// demoPKI is the demo's throwaway CA and the certificates it issued.
type demoPKI struct {
	pool          *x509.CertPool
	server, agent tls.Certificate
}

func newDemoPKI() (*demoPKI, error) {
	ca, err := certs.NewCA("konnectivity demo CA", 24*time.Hour)
	if err != nil {
		return nil, err
	}
	serverPEM, serverKey, err := ca.Issue(certs.Request{CommonName: "konnectivity-server", DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, Validity: 24 * time.Hour})
	if err != nil {
		return nil, err
	}
	agentPEM, agentKey, err := ca.Issue(certs.Request{CommonName: "konnectivity-agent", Client: true, Validity: 24 * time.Hour})
	if err != nil {
		return nil, err
	}
	p := &demoPKI{pool: x509.NewCertPool()}
	p.pool.AddCert(ca.Cert)
	if p.server, err = tls.X509KeyPair(serverPEM, serverKey); err != nil {
		return nil, err
	}
	if p.agent, err = tls.X509KeyPair(agentPEM, agentKey); err != nil {
		return nil, err
	}
	return p, nil
}

// startDemoBackend serves the destination, a small HTTP backend on
// loopback, until stop, which waits for it.
func startDemoBackend() (addr string, stop func(), err error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	backend := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from the backend at %s (you asked for %s)\n", r.Host, r.URL.Path)
	})}
	done := make(chan struct{})
	go func() { defer close(done); backend.Serve(ln) }()
	return ln.Addr().String(), func() { backend.Close(); <-done }, nil
}

// startDemoServer starts a server with its HTTP CONNECT frontend on a
// socket in dir and its agent listener on loopback; srv.Close ends both.
func startDemoServer(dir string, pki *demoPKI, log *slog.Logger) (srv *server.Server, uds, agentAddr string, err error) {
	srv, err = server.New(server.Config{
		ID:       "demo-server",
		AgentTLS: &tls.Config{Certificates: []tls.Certificate{pki.server}, ClientCAs: pki.pool, ClientAuth: tls.RequireAndVerifyClientCert},
		Logger:   log,
	})
	if err != nil {
		return nil, "", "", err
	}
	uds = filepath.Join(dir, "konnectivity-server.socket")
	udsLn, err := daemon.ListenUnix(uds, 0o600, true)
	if err != nil {
		srv.Close()
		return nil, "", "", err
	}
	go srv.ServeFrontend(udsLn)
	agentLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		srv.Close()
		return nil, "", "", err
	}
	go srv.ServeAgents(agentLn)
	return srv, uds, agentLn.Addr().String(), nil
}

// startDemoAgent runs an agent connected to the server at addr until ctx
// ends or stop, which waits for it.
func startDemoAgent(ctx context.Context, addr string, pki *demoPKI, log *slog.Logger) (stop func(), err error) {
	a, err := agent.New(agent.Config{
		ServerAddrs: []string{addr},
		ID:          "demo-agent",
		TLS: func(name string) (*tls.Config, error) {
			return &tls.Config{RootCAs: pki.pool, ServerName: name, Certificates: []tls.Certificate{pki.agent}}, nil
		},
		DrainTimeout: time.Second,
		Logger:       log,
	})
	if err != nil {
		return nil, err
	}
	return goUntilStopped(ctx, func(ctx context.Context) { a.Run(ctx) }), nil
}

// demoRequests makes requests dials through the socket the way
// kube-apiserver does, and one to a closed port.
func demoRequests(out io.Writer, uds, target string, requests int) error {
	failures := 0
	for i := 1; i <= requests; i++ {
		start := time.Now()
		body, err := getThroughUDS(uds, target, fmt.Sprintf("/demo/%d", i))
		if err != nil {
			failures++
			fmt.Fprintf(out, "request %d: FAILED: %v\n", i, err)
			continue
		}
		fmt.Fprintf(out, "request %d via CONNECT %s: %s (%s)\n", i, target, strings.TrimSpace(body), time.Since(start).Round(10*time.Microsecond))
	}
	_, err := getThroughUDS(uds, "127.0.0.1:1", "/")
	fmt.Fprintf(out, "a dial to a closed port is refused as it should be: %v\n", err)
	if failures > 0 {
		return fmt.Errorf("%d of %d requests failed", failures, requests)
	}
	return nil
}

// demoByHand opens a plain CONNECT listener for curl and waits for Ctrl-C.
func demoByHand(ctx context.Context, out io.Writer, srv *server.Server, uds, target string, connectPort int) error {
	connectLn, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", connectPort))
	if err != nil {
		return fmt.Errorf("CONNECT listener: %w", err)
	}
	go srv.ServeFrontend(connectLn)
	fmt.Fprintf(out, `
Try it by hand (Ctrl-C to stop):
  curl -p -x http://%[1]s http://%[2]s/hello
  curl -p -x http://%[1]s http://127.0.0.1:1/        # a closed port: 502 from the agent
  printf 'CONNECT %[2]s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET / HTTP/1.0\r\n\r\n' | nc -U %[3]s
`, connectLn.Addr(), target, uds)
	<-ctx.Done()
	fmt.Fprintln(out, "stopping")
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	srv.Shutdown(sctx)
	return nil
}

// getThroughUDS does what kube-apiserver's HTTPConnect dialer does: a new
// connection to the socket, one CONNECT, then a request over the tunnel.
func getThroughUDS(uds, target, path string) (string, error) {
	conn, err := net.DialTimeout("unix", uds, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(15 * time.Second))
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", target)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return "", fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(msg)))
	}
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", path, target)
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return string(body), err
}
