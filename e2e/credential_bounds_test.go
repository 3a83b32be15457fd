package e2e

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// rawAgentLogin logs in on s's agent port with the test PKI's agent
// certificate under id, as the agent's Upgrade handshake does, and
// returns the connection (nil unless admitted), the answer's status and
// its body.
func rawAgentLogin(s *server, tlsConf *tls.Config, id string) (net.Conn, int, string, error) {
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 10 * time.Second}, "tcp", "127.0.0.1:"+strconv.Itoa(s.agentPort), tlsConf)
	var rhe tls.RecordHeaderError
	if errors.As(err, &rhe) && string(rhe.RecordHeader[:]) == "HTTP/" {
		// Refused before TLS, in plain text, as the agent port refuses
		// when it is busy.
		return nil, http.StatusServiceUnavailable, "plain-text refusal before TLS", nil
	}
	if err != nil {
		return nil, 0, "", err
	}
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(conn, "GET /konnectivity/v1/tunnel HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: konnectivity-h2\r\nKonnectivity-Agent-Id: %s\r\n\r\n", id)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		conn.Close()
		return nil, 0, "", err
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		conn.Close()
		return nil, resp.StatusCode, strings.TrimSpace(string(body)), nil
	}
	conn.SetDeadline(time.Time{})
	go io.Copy(io.Discard, br) // what the server sends; ends when the connection does
	return conn, resp.StatusCode, "", nil
}

func agentTLSConfig(t *testing.T, p *pki) *tls.Config {
	t.Helper()
	cert, err := tls.LoadX509KeyPair(p.agentCert, p.agentKey)
	if err != nil {
		t.Fatal(err)
	}
	caPEM, err := os.ReadFile(p.caCert)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	return &tls.Config{RootCAs: pool, ServerName: "127.0.0.1", Certificates: []tls.Certificate{cert}}
}

// TestFaultOneCredentialManyLogins: one client certificate logs in 1,200
// times with a new agent ID each at a server whose descriptor limit is
// 1,024 (prlimit on the server). With the bound per credential (default
// 32 from one address) all but 31 are refused 429 naming it; with that
// bound off, the descriptors reserved for the front door and the health
// and admin ports stop the logins short of the limit (503). Either way
// /healthz answers and every front-door dial through the good agent is
// served while the logins hold their connections, and the first dial
// after they left is served too.
func TestFaultOneCredentialManyLogins(t *testing.T) {
	if _, err := os.Stat("/usr/bin/prlimit"); err != nil {
		t.Skip("prlimit not installed")
	}
	for _, tc := range []struct {
		name  string
		extra []string
	}{
		{"per-credential-bound", nil},
		{"descriptor-reserve", []string{"--max-agent-connections-per-credential=0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			wrapper := filepath.Join(dir, "konnectivity-1024")
			script := fmt.Sprintf("#!/bin/sh\nexec prlimit --nofile=1024:1024 %s \"$@\"\n", konnectivityBin)
			if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
				t.Fatal(err)
			}
			// Dials to 127.0.0.1 go to the good agent (destHost); the
			// logins serve nothing.
			s := startServerBin(t, wrapper, frontendUDS, append([]string{"--proxy-strategies=destHost"}, tc.extra...)...)
			s.startAgent(t, "good", "ipv4=127.0.0.1", "--sync-interval=100ms", "--sync-interval-cap=200ms")
			backend := startHTTPBackend(t, "127.0.0.1", "b1")
			tlsConf := agentTLSConfig(t, s.pki)

			const logins = 1200
			var (
				mu     sync.Mutex
				held   []net.Conn
				status = map[int]int{}
				bodies = map[int]string{}
				failed int
			)
			t.Cleanup(func() {
				for _, c := range held {
					c.Close()
				}
			})
			var wg sync.WaitGroup
			ids := make(chan int)
			for range 32 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range ids {
						c, code, body, err := rawAgentLogin(s, tlsConf, fmt.Sprintf("evil-%d", i))
						mu.Lock()
						switch {
						case err != nil:
							failed++
						case c != nil:
							held = append(held, c)
							status[code]++
						default:
							status[code]++
							bodies[code] = body
						}
						mu.Unlock()
					}
				}()
			}
			// /healthz is probed all through the logins.
			probing, probed := make(chan struct{}), make(chan struct{})
			var probes, probeFails int
			go func() {
				defer close(probed)
				client := &http.Client{Timeout: 2 * time.Second}
				for {
					select {
					case <-probing:
						return
					case <-time.After(100 * time.Millisecond):
					}
					probes++
					resp, err := client.Get(s.healthURL("/healthz"))
					if err != nil || resp.StatusCode != http.StatusOK {
						probeFails++
					}
					if err == nil {
						resp.Body.Close()
					}
				}
			}()
			start := time.Now()
			for i := range logins {
				ids <- i
			}
			close(ids)
			wg.Wait()
			close(probing)
			<-probed
			t.Logf("/healthz during the logins: %d of %d probes failed", probeFails, probes)
			if probeFails > 0 {
				t.Errorf("/healthz failed %d of %d times during the logins", probeFails, probes)
			}
			t.Logf("%d logins with one certificate in %v: %d admitted, answers %v, %d failed without an answer; refusals: %v",
				logins, time.Since(start).Round(time.Millisecond), len(held), status, failed, bodies)
			if failed > 0 {
				t.Errorf("%d logins got no answer", failed)
			}

			if got := getStatus(t, s.healthURL("/healthz")); got != http.StatusOK {
				t.Errorf("/healthz answered %d while the logins hold their connections", got)
			}
			served := 0
			for range 50 {
				c, err := s.egressDialer(t).bounded()(t.Context(), "tcp", backend)
				if err != nil {
					t.Errorf("front-door dial while the logins hold their connections: %v", err)
					continue
				}
				served++
				c.Close()
			}
			t.Logf("while they hold their connections: /healthz and %d of 50 front-door dials served", served)
			if tc.extra == nil {
				// What the server holds is the bound; a login that raced
				// others past the early check may see its 101 and then its
				// connection closed, refused at registration.
				if n := s.agentCount(); n > 32 {
					t.Errorf("the server holds %d agents (%d logins answered 101) with one certificate from one address, bound 32 (the good agent holds one)", n, len(held))
				}
				if !strings.Contains(bodies[http.StatusTooManyRequests], "max-agent-connections-per-credential") {
					t.Errorf("the refusal does not name the bound: %v", bodies)
				}
			}

			for _, c := range held {
				c.Close()
			}
			held = nil
			s.waitAgents(t, 1, 30*time.Second)
			c, err := s.egressDialer(t).bounded()(t.Context(), "tcp", backend)
			if err != nil {
				t.Fatalf("the first dial after the logins left: %v", err)
			}
			c.Close()
		})
	}
}
