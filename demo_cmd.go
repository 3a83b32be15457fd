package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
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
	"github.com/spinifex/konnectivity/tunnel"
)

// runDemo is the embedded default: a throwaway CA, a server, an agent and a
// small HTTP backend, all on loopback, with a few dials made the way
// kube-apiserver makes them.
func runDemo(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("konnectivity demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	once := fs.Bool("once", false, "run the checks and exit instead of waiting for Ctrl-C")
	requests := fs.Int("requests", 5, "how many requests to send through the tunnel")
	connectPort := fs.Int("connect-port", 8190, "loopback port of a plain CONNECT listener for curl -p -x (0 picks one)")
	verbose := fs.Bool("verbose", false, "print the server's and agent's log lines")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
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

	ca, err := certs.NewCA("konnectivity demo CA", 24*time.Hour)
	if err != nil {
		return err
	}
	serverPEM, serverKey, err := ca.Issue(certs.Request{CommonName: "konnectivity-server", DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, Validity: 24 * time.Hour})
	if err != nil {
		return err
	}
	agentPEM, agentKey, err := ca.Issue(certs.Request{CommonName: "konnectivity-agent", Client: true, Validity: 24 * time.Hour})
	if err != nil {
		return err
	}
	serverCert, err := tls.X509KeyPair(serverPEM, serverKey)
	if err != nil {
		return err
	}
	agentCert, err := tls.X509KeyPair(agentPEM, agentKey)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca.Cert)
	fmt.Fprintf(out, "minted a throwaway CA and server/agent certificates in %s\n", dir)

	// The destination: a small HTTP backend on loopback.
	backendLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	backend := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from the backend at %s (you asked for %s)\n", r.Host, r.URL.Path)
	})}
	go backend.Serve(backendLn)
	defer backend.Close()

	srv, err := tunnel.NewServer(tunnel.ServerConfig{
		ID:       "demo-server",
		AgentTLS: &tls.Config{Certificates: []tls.Certificate{serverCert}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert},
		Logger:   log,
	})
	if err != nil {
		return err
	}
	defer srv.Close()
	uds := filepath.Join(dir, "konnectivity-server.socket")
	udsLn, err := listenUnix(uds, 0o600, true)
	if err != nil {
		return err
	}
	go srv.ServeFrontend(udsLn)
	agentLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go srv.ServeAgents(agentLn)

	agent, err := tunnel.NewAgent(tunnel.AgentConfig{
		ServerAddrs: []string{agentLn.Addr().String()},
		ID:          "demo-agent",
		TLS: func(name string) (*tls.Config, error) {
			return &tls.Config{RootCAs: pool, ServerName: name, Certificates: []tls.Certificate{agentCert}}, nil
		},
		DrainTimeout: time.Second,
		Logger:       log,
	})
	if err != nil {
		return err
	}
	agentCtx, stopAgent := context.WithCancel(ctx)
	agentDone := make(chan struct{})
	go func() { defer close(agentDone); agent.Run(agentCtx) }()
	defer func() { stopAgent(); <-agentDone }()

	fmt.Fprintf(out, "server: frontend %s, agents on %s\n", uds, agentLn.Addr())
	deadline := time.Now().Add(10 * time.Second)
	for srv.AgentCount() == 0 {
		if time.Now().After(deadline) {
			return fmt.Errorf("the agent did not connect within 10s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	fmt.Fprintln(out, "agent: connected")

	target := backendLn.Addr().String()
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
	_, err = getThroughUDS(uds, "127.0.0.1:1", "/")
	fmt.Fprintf(out, "a dial to a closed port is refused as it should be: %v\n", err)
	if failures > 0 {
		return fmt.Errorf("%d of %d requests failed", failures, requests)
	}
	if once {
		return nil
	}

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
