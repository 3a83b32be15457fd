package server

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Hostile input: slow clients, bad credentials, and an "agent" that passes
// the handshake and then abuses HTTP/2. In every case the server must keep
// serving a well-behaved client and agent, cut or isolate the abuser, and
// hold bounded memory.

// Many frontend connections that send their CONNECT head one byte every
// 100 ms: a well-behaved client and agent are served meanwhile, and every
// slow connection is answered 408 (or closed) at the header timeout.
func TestSlowlorisFrontend(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const headerTimeout = time.Second
	e := newEnv(t, func(c *Config) { c.HeaderTimeout = headerTimeout })
	echo := tunneltest.EchoServer(t)
	const slow = 200
	type outcome struct {
		status int
		took   time.Duration
		err    error
	}
	outcomes := make(chan outcome, slow)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for n := range slow {
		c, err := net.Dial("unix", e.UDS)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(2)
		start := time.Now()
		go func() { // one byte per 100 ms, forever
			defer wg.Done()
			head := "CONNECT " + echo + " HTTP/1.1\r\nX-Slow: " + strings.Repeat("a", 1000)
			i := 0
			if n%2 == 1 { // the request line at once, then the headers slowly
				i = strings.Index(head, "X-Slow")
				c.Write([]byte(head[:i]))
			}
			for ; ; i++ {
				if _, err := c.Write([]byte{head[i%len(head)]}); err != nil {
					return
				}
				select {
				case <-stop:
					return
				case <-time.After(100 * time.Millisecond):
				}
			}
		}()
		go func() {
			defer wg.Done()
			defer c.Close()
			c.SetReadDeadline(time.Now().Add(headerTimeout + 5*time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			o := outcome{took: time.Since(start), err: err}
			if err == nil {
				o.status = resp.StatusCode
			}
			outcomes <- o
		}()
	}
	// Meanwhile an agent connects and a client is served, well inside the
	// header timeout.
	tunneltest.WaitUntil(t, func() bool { return frontOpen(e.srv) == slow }, "every slow connection being read")
	start := time.Now()
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	if err := e.EchoOnce(echo); err != nil {
		t.Fatalf("well-behaved client during slowloris: %v", err)
	}
	served := time.Since(start)
	if served >= headerTimeout {
		t.Errorf("agent + client took %s, not served before the slow connections were cut", served)
	}
	var maxTook time.Duration
	statuses := map[int]int{}
	for range slow {
		o := <-outcomes
		if tunneltest.IsTimeout(o.err) {
			t.Fatalf("a slow connection was never cut (%v)", o.err)
		}
		statuses[o.status]++
		maxTook = max(maxTook, o.took)
	}
	close(stop)
	wg.Wait()
	// A head cut by the timeout inside the request line is answered 400
	// (the partial line is parsed as malformed), later in the head 408.
	if statuses[http.StatusRequestTimeout]+statuses[http.StatusBadRequest] != slow {
		t.Errorf("slow connections' answers %v, want %d × 400 or 408", statuses, slow)
	}
	if maxTook > headerTimeout+2*time.Second {
		t.Errorf("a slow connection was cut only after %s", maxTook)
	}
	t.Logf("%d slowloris connections: answers %v, last cut after %s (header timeout %s); agent + good client served in %s",
		slow, statuses, maxTook.Round(time.Millisecond), headerTimeout, served.Round(time.Millisecond))
}

// Connections to the agent port that start a TLS handshake and never finish
// it (or never start) are cut at the header timeout; a good agent connects
// and is used meanwhile. The unadmitted limit is above the attack so that
// every slow connection waits for the timeout (the limit has its own test,
// TestHostileUnadmittedLimit).
func TestSlowlorisAgentPort(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const headerTimeout = time.Second
	const slow = 200
	e := newEnv(t, func(c *Config) {
		c.HeaderTimeout = headerTimeout
		c.MaxUnadmitted = 2 * slow
	})
	echo := tunneltest.EchoServer(t)
	// The first bytes of a TLS ClientHello record header, then nothing.
	partial := []byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01}
	cut := make(chan time.Duration, slow)
	var wg sync.WaitGroup
	for i := range slow {
		c, err := net.Dial("tcp", e.AgentAddr)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			if i%2 == 0 {
				c.Write(partial)
			}
			c.SetReadDeadline(time.Now().Add(headerTimeout + 5*time.Second))
			_, err := io.Copy(io.Discard, c)
			if tunneltest.IsTimeout(err) {
				cut <- -1
				return
			}
			cut <- time.Since(start)
		}()
	}
	tunneltest.WaitUntil(t, func() bool { return e.srv.gate.open.Load() == slow }, "every slow connection waiting to be admitted")
	start := time.Now()
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	if err := e.EchoOnce(echo); err != nil {
		t.Fatalf("client during agent-port slowloris: %v", err)
	}
	served := time.Since(start)
	wg.Wait()
	var maxTook time.Duration
	for range slow {
		d := <-cut
		if d < 0 {
			t.Fatal("a stalled TLS handshake was never cut")
		}
		maxTook = max(maxTook, d)
	}
	if served >= headerTimeout {
		t.Errorf("good agent + client took %s", served)
	}
	t.Logf("%d stalled handshakes cut, last after %s (header timeout %s); good agent + client served in %s",
		slow, maxTook.Round(time.Millisecond), headerTimeout, served.Round(time.Millisecond))
}

// A flood of handshakes with certificates from another CA, and of
// handshakes with bad tokens: good agents still get in, and are used.
func TestBadCredentialFlood(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const goodToken = "good-token-0123456789"
	e := newEnv(t, func(c *Config) {
		c.AgentTLS.ClientAuth = tls.VerifyClientCertIfGiven
		c.AuthenticateAgent = func(ctx context.Context, cr AgentCredentials) error {
			if len(cr.TLS.VerifiedChains) > 0 || cr.Token == goodToken {
				return nil
			}
			return &wire.StatusError{Code: http.StatusUnauthorized, Msg: "bad token"}
		}
	})
	echo := tunneltest.EchoServer(t)
	other := tunneltest.NewPKI(t)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var badCert, badToken, admitted atomic.Int64
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				cfg := &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1"}
				if w%2 == 0 {
					cfg.Certificates = []tls.Certificate{other.AgentCert}
				}
				c, err := tls.Dial("tcp", e.AgentAddr, cfg)
				if err != nil {
					continue
				}
				c.SetDeadline(time.Now().Add(5 * time.Second))
				wire.WriteHello(c, "127.0.0.1", wire.AgentHello{ID: fmt.Sprintf("bad%d", w), Token: "wrong-token"})
				_, err = wire.ReadReply(bufio.NewReader(c))
				c.Close()
				switch {
				case err == nil:
					admitted.Add(1)
				case w%2 == 0:
					badCert.Add(1)
				default:
					badToken.Add(1)
				}
			}
		}()
	}
	tunneltest.WaitUntil(t, func() bool { return badCert.Load() > 0 && badToken.Load() > 0 }, "both floods refused at least once")
	start := time.Now()
	e.startAgent("good-cert", "", nil)
	e.startAgent("good-token", "", func(c *agent.Config) {
		c.TLS = func(name string) (*tls.Config, error) {
			return &tls.Config{RootCAs: e.PKI.Pool, ServerName: name}, nil
		}
		c.Token = func() (string, error) { return goodToken, nil }
	})
	e.WaitAgents(2)
	for range 20 {
		if err := e.EchoOnce(echo); err != nil {
			t.Fatalf("dial during the flood: %v", err)
		}
	}
	joined := time.Since(start)
	cancel()
	wg.Wait()
	if admitted.Load() != 0 {
		t.Fatalf("%d bad handshakes admitted", admitted.Load())
	}
	if badCert.Load() == 0 || badToken.Load() == 0 {
		t.Fatalf("flood did not run: %d bad-cert, %d bad-token refusals", badCert.Load(), badToken.Load())
	}
	t.Logf("flood: %d bad-certificate and %d bad-token handshakes refused; 2 good agents joined and 20 dials served in %s; refusals counted %d",
		badCert.Load(), badToken.Load(), joined.Round(time.Millisecond), e.srv.Stats.AgentsRefused.Load())
}

// No token in logs, at Debug, whatever the handshake looks like. Refusals
// from one address are rate-limited in the log, so each hostile handshake
// goes to a fresh server (otherwise a suppressed line would prove nothing).
func TestTokenNeverLogged(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const secret = "SECRET-tok-7f3a9c"
	var logBuf lockedBuf
	log := slog.New(slog.NewTextHandler(&logBuf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	newTokenEnv := func() *env {
		return newEnv(t, func(c *Config) {
			c.Logger = log
			c.AgentTLS.ClientAuth = tls.NoClientCert
			c.AuthenticateAgent = func(ctx context.Context, cr AgentCredentials) error {
				if cr.Token != secret+"-good" {
					return &wire.StatusError{Code: http.StatusUnauthorized, Msg: "token rejected"}
				}
				return nil
			}
		})
	}
	head := "GET " + wire.HandshakePath + " HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: " + wire.UpgradeToken + "\r\n"
	cases := []string{
		head + wire.HdrAgentID + ": a\r\nAuthorization: Bearer " + secret + "\r\n\r\n",                                         // wrong token
		head + wire.HdrAgentID + ": a\r\nAuthorization: Basic " + secret + "\r\n\r\n",                                          // not bearer
		head + wire.HdrAgentID + ": a\r\nAuthorization: Bearer " + secret + " trailing\r\n\r\n",                                // odd token
		head + wire.HdrAgentID + ": bad id\r\nAuthorization: Bearer " + secret + "\r\n\r\n",                                    // bad ID
		head + "Authorization: Bearer " + secret + "\r\n\r\n",                                                                  // no ID
		head + wire.HdrAgentID + ": a\r\nAuthorization: Bearer " + secret + "\r\nbroken line\r\n\r\n",                          // malformed
		head + wire.HdrAgentID + ": a\r\nAuthorization: Bearer " + secret + "\r\n" + wire.HdrConnectedServers + ": s1\r\n\r\n", // duplicate
		"GET / HTTP/1.1\r\nAuthorization: Bearer " + secret + "\r\n\r\n",                                                       // not a handshake
		head + wire.HdrAgentID + ": a\r\nAuthorization: Bearer " + secret,                                                      // cut short
	}
	for _, req := range cases {
		e := newTokenEnv()
		c, err := tls.Dial("tcp", e.AgentAddr, &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1"})
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(15 * time.Second))
		io.WriteString(c, req)
		if !strings.HasSuffix(req, "\r\n\r\n") {
			c.CloseWrite()
		}
		io.Copy(io.Discard, c)
		c.Close()
		e.Stop()
	}
	// A real agent with a bad token, then one with the good one, both
	// logging to the same buffer.
	e := newTokenEnv()
	bad := e.startAgent("bad", "", func(c *agent.Config) {
		c.Logger = log
		c.TLS = func(name string) (*tls.Config, error) { return &tls.Config{RootCAs: e.PKI.Pool, ServerName: name}, nil }
		c.Token = func() (string, error) { return secret, nil }
	})
	tunneltest.WaitUntil(t, func() bool { return e.srv.Stats.AgentsRefused.Load() > 0 }, "the bad-token agent refused")
	bad.Stop()
	e.startAgent("good", "", func(c *agent.Config) {
		c.Logger = log
		c.TLS = func(name string) (*tls.Config, error) { return &tls.Config{RootCAs: e.PKI.Pool, ServerName: name}, nil }
		c.Token = func() (string, error) { return secret + "-good", nil }
	})
	e.WaitAgents(1)
	if err := e.EchoOnce(tunneltest.EchoServer(t)); err != nil {
		t.Fatal(err)
	}
	text := logBuf.String()
	if strings.Contains(text, secret) || strings.Contains(text, "7f3a9c") {
		t.Fatalf("token in the log:\n%s", text)
	}
	lines := strings.Count(text, "\n")
	if !strings.Contains(text, "agent refused") || !strings.Contains(text, "agent connected") || lines < len(cases) {
		t.Fatalf("log does not show every refusal and the connection, so the test proves nothing:\n%s", text)
	}
	t.Logf("%d log lines at Debug for %d hostile handshakes, a refused and an admitted agent; none has the token", lines, len(cases))
}

type lockedBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// ---------------------------------------------------------------------------
// A malicious agent: real TLS and Upgrade handshake, then raw HTTP/2 frames
// as the server side of the flipped connection.

type evilAgent struct {
	t    *testing.T
	conn net.Conn
	fr   *http2.Framer
	wmu  sync.Mutex
	done chan struct{} // the connection ended (read error)
	err  error         // why, valid after done
	// onHeaders answers a stream the real server opened.
	onHeaders func(ev *evilAgent, f *http2.MetaHeadersFrame)
	headers   atomic.Int64
}

// dialEvil connects as agent id with the test PKI's client certificate and
// sends SETTINGS, which settings may replace.
func dialEvil(t *testing.T, e *env, id, identifiers string, settings []http2.Setting, onHeaders func(*evilAgent, *http2.MetaHeadersFrame)) *evilAgent {
	t.Helper()
	c, err := tls.Dial("tcp", e.AgentAddr, &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1", Certificates: []tls.Certificate{e.PKI.AgentCert}})
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := wire.WriteHello(c, "127.0.0.1", wire.AgentHello{ID: id, Identifiers: identifiers}); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	if _, err := wire.ReadReply(br); err != nil {
		t.Fatalf("evil agent handshake: %v", err)
	}
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(br, preface); err != nil || string(preface) != http2.ClientPreface {
		t.Fatalf("client preface %q: %v", preface, err)
	}
	c.SetDeadline(time.Time{})
	ev := &evilAgent{t: t, conn: c, done: make(chan struct{}), onHeaders: onHeaders}
	ev.fr = http2.NewFramer(c, br)
	ev.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	ev.fr.MaxHeaderListSize = 1 << 20
	ev.write(func(fr *http2.Framer) error { return fr.WriteSettings(settings...) })
	go ev.readLoop()
	t.Cleanup(func() { c.Close(); <-ev.done })
	return ev
}

func (ev *evilAgent) write(f func(*http2.Framer) error) error {
	ev.wmu.Lock()
	defer ev.wmu.Unlock()
	return f(ev.fr)
}

func (ev *evilAgent) readLoop() {
	defer close(ev.done)
	for {
		f, err := ev.fr.ReadFrame()
		if err != nil {
			ev.err = err
			return
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				ev.write(func(fr *http2.Framer) error { return fr.WriteSettingsAck() })
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				ev.write(func(fr *http2.Framer) error { return fr.WritePing(true, f.Data) })
			}
		case *http2.MetaHeadersFrame:
			ev.headers.Add(1)
			if ev.onHeaders != nil {
				ev.onHeaders(ev, f)
			}
		case *http2.GoAwayFrame:
			// keep reading until the server closes
		}
	}
}

// closed reports whether the server dropped the evil agent within d.
func (ev *evilAgent) closed(d time.Duration) bool {
	select {
	case <-ev.done:
		return true
	case <-time.After(d):
		return false
	}
}

func isControl(f *http2.MetaHeadersFrame) bool {
	return f.PseudoValue("method") == http.MethodGet
}

// answer200 answers a CONNECT with 200 and keeps the stream open.
func answer200(ev *evilAgent, f *http2.MetaHeadersFrame) {
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	enc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
	ev.write(func(fr *http2.Framer) error {
		return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: f.StreamID, BlockFragment: hb.Bytes(), EndHeaders: true})
	})
}

// hostileEnv is a server that routes dials by destination host, a good
// agent for 127.0.0.1 and an echo destination; evil agents name
// evil.invalid so the test decides which dials reach them.
func hostileEnv(t *testing.T) (*env, string) {
	e := newEnv(t, func(c *Config) {
		c.Strategies = []Strategy{StrategyDestHost}
		c.AgentWait = 300 * time.Millisecond
		c.DialTimeout = 2 * time.Second
	})
	e.startAgent("good", "ipv4=127.0.0.1", nil)
	e.WaitAgents(1)
	return e, tunneltest.EchoServer(t)
}

// Rapid reset: the agent resets every stream the server opens. Dials that
// reach it fail fast (they are retried elsewhere, then answered), and a
// well-behaved agent keeps serving; thousands of resets hold no memory.
func TestEvilAgentRapidReset(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) {
		c.AgentWait = 300 * time.Millisecond
		c.DialTimeout = 2 * time.Second
	})
	echo := tunneltest.EchoServer(t)
	ev := dialEvil(t, e, "evil", "", nil, func(ev *evilAgent, f *http2.MetaHeadersFrame) {
		ev.write(func(fr *http2.Framer) error { return fr.WriteRSTStream(f.StreamID, http2.ErrCodeInternal) })
	})
	e.WaitAgents(1)
	// Alone, the evil agent makes a dial fail: after the reset the dial is
	// retried, finds no other agent and is answered 503 after AgentWait,
	// well before the 2 s dial timeout.
	code, took, err := e.DialStatus(echo)
	if err != nil || code != http.StatusServiceUnavailable || took >= 2*time.Second {
		t.Fatalf("dial through a resetting agent: %d after %s (%v), want a fast 503", code, took, err)
	}
	t.Logf("alone: dial through the resetting agent answered %d after %s", code, took.Round(time.Millisecond))
	e.startAgent("good", "", nil)
	e.WaitAgents(2)
	before := tunneltest.HeapInuse()
	start := time.Now()
	const dials = 300
	for i := range dials {
		if err := e.EchoOnce(echo); err != nil {
			t.Fatalf("dial %d with a resetting agent present: %v", i, err)
		}
	}
	growth := int64(tunneltest.HeapInuse()) - int64(before)
	t.Logf("%d dials all served in %s with the resetting agent present (it reset %d streams); heap growth %d KiB; evil agent still connected: %v",
		dials, time.Since(start).Round(time.Millisecond), ev.headers.Load(), growth>>10, !ev.closed(0))
	if ev.headers.Load() < dials/4 {
		t.Errorf("only %d streams reached the resetting agent: the test did not exercise it", ev.headers.Load())
	}
	if growth > 16<<20 {
		t.Errorf("heap grew %d MiB over %d reset streams", growth>>20, dials)
	}
}

// A SETTINGS flood (answered by ACKs) and a ping flood do not stop the
// server from serving a good agent, and hold no memory.
func TestEvilAgentSettingsFlood(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e, echo := hostileEnv(t)
	ev := dialEvil(t, e, "evil", "host=evil.invalid", nil, nil)
	e.WaitAgents(2)
	before := tunneltest.HeapInuse()
	const frames = 50000
	floodDone := make(chan error, 1)
	go func() {
		for i := range frames {
			err := ev.write(func(fr *http2.Framer) error {
				if i%2 == 0 {
					return fr.WritePing(false, [8]byte{byte(i)})
				}
				return fr.WriteSettings(http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: uint32(100 + i%100)})
			})
			if err != nil {
				floodDone <- err
				return
			}
		}
		floodDone <- nil
	}()
	served := 0
	for {
		if err := e.EchoOnce(echo); err != nil {
			t.Fatalf("good agent during the flood: %v", err)
		}
		served++
		select {
		case err := <-floodDone:
			growth := int64(tunneltest.HeapInuse()) - int64(before)
			dropped := ev.closed(2 * time.Second)
			t.Logf("%d SETTINGS+PING frames sent (write err %v); %d dials served meanwhile; heap growth %d KiB; evil agent dropped: %v (%v)",
				frames, err, served, growth>>10, dropped, ev.err)
			if growth > 16<<20 {
				t.Errorf("heap grew %d MiB during the flood", growth>>20)
			}
			if err := e.EchoOnce(echo); err != nil {
				t.Fatalf("after the flood: %v", err)
			}
			return
		default:
		}
	}
}

// A response header block far over the limit (64 MiB in CONTINUATION
// frames): the dial fails, the server does not buffer it, and the good
// agent keeps serving.
func TestEvilAgentHugeHeaders(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e, echo := hostileEnv(t)
	const size = 64 << 20
	sent := make(chan error, 1)
	ev := dialEvil(t, e, "evil", "host=evil.invalid", nil, func(ev *evilAgent, f *http2.MetaHeadersFrame) {
		if isControl(f) {
			return
		}
		go func() { sent <- ev.writeHugeHeaders(f.StreamID, size) }()
	})
	e.WaitAgents(2)
	before := tunneltest.HeapInuse()
	code, took, err := e.DialStatus("evil.invalid:80")
	werr := <-sent
	growth := int64(tunneltest.HeapInuse()) - int64(before)
	dropped := ev.closed(3 * time.Second)
	t.Logf("%d MiB response header: dial answered %d after %s (%v); evil agent's write: %v; heap growth %d KiB; evil agent dropped: %v (%v)",
		size>>20, code, took.Round(time.Millisecond), err, werr, growth>>10, dropped, ev.err)
	if err != nil || code != http.StatusBadGateway && code != http.StatusServiceUnavailable {
		t.Errorf("dial through the huge-header agent: %d %v, want 502 or 503", code, err)
	}
	if werr == nil {
		t.Errorf("the server read all %d MiB of a header block", size>>20)
	}
	if growth > 32<<20 {
		t.Errorf("heap grew %d MiB", growth>>20)
	}
	if err := e.EchoOnce(echo); err != nil {
		t.Fatalf("good agent after the huge headers: %v", err)
	}
}

// writeHugeHeaders sends a :status 200 HEADERS frame whose block goes on in
// CONTINUATION frames with one header value of n bytes, never ending.
func (ev *evilAgent) writeHugeHeaders(stream uint32, n int) error {
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	enc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
	// A literal field without indexing, new name "x", value length n
	// (7-bit prefix integer), then the value bytes in later frames.
	hb.Write([]byte{0x00, 0x01, 'x'})
	hb.Write(hpackInt(uint64(n), 7, 0x00))
	err := ev.write(func(fr *http2.Framer) error {
		return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: stream, BlockFragment: hb.Bytes()})
	})
	chunk := bytes.Repeat([]byte("a"), 16<<10)
	for sent := 0; err == nil && sent < n; sent += len(chunk) {
		err = ev.write(func(fr *http2.Framer) error { return fr.WriteContinuation(stream, false, chunk) })
	}
	return err
}

func hpackInt(v uint64, prefix uint, first byte) []byte {
	prefixMax := uint64(1)<<prefix - 1
	if v < prefixMax {
		return []byte{first | byte(v)}
	}
	out := []byte{first | byte(prefixMax)}
	v -= prefixMax
	for v >= 128 {
		out = append(out, byte(v%128+128))
		v /= 128
	}
	return append(out, byte(v))
}

// WINDOW_UPDATE overflow on the connection: a flow-control error that must
// drop the agent, while the good agent keeps serving.
func TestEvilAgentWindowOverflow(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e, echo := hostileEnv(t)
	ev := dialEvil(t, e, "evil", "host=evil.invalid", nil, nil)
	e.WaitAgents(2)
	ev.write(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(0, 1<<31-1) })
	ev.write(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(0, 1<<31-1) })
	if !ev.closed(5 * time.Second) {
		t.Fatal("the server kept an agent whose connection window overflowed")
	}
	e.WaitAgents(1)
	t.Logf("window overflow: agent dropped (%v)", ev.err)
	if err := e.EchoOnce(echo); err != nil {
		t.Fatalf("good agent after the overflow: %v", err)
	}
}

// An agent that answers 200 but never grants flow-control window: the
// client's bytes back up to the client (its writes block), the server does
// not buffer them, and the good agent keeps serving.
func TestEvilAgentNeverGrantsWindow(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e, echo := hostileEnv(t)
	ev := dialEvil(t, e, "evil", "host=evil.invalid",
		[]http2.Setting{{ID: http2.SettingInitialWindowSize, Val: 0}}, func(ev *evilAgent, f *http2.MetaHeadersFrame) {
			if !isControl(f) {
				answer200(ev, f)
			}
		})
	e.WaitAgents(2)
	before := tunneltest.HeapInuse()
	const tunnels = 10
	var accepted atomic.Int64
	var wg sync.WaitGroup
	conns := make([]net.Conn, tunnels)
	for i := range tunnels {
		conn, _, resp := e.Connect("evil.invalid:80")
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		conns[i] = conn
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn.SetWriteDeadline(time.Now().Add(2 * time.Second))
			buf := make([]byte, 64<<10)
			for {
				n, err := conn.Write(buf)
				accepted.Add(int64(n))
				if err != nil {
					return
				}
			}
		}()
	}
	if err := e.EchoOnce(echo); err != nil {
		t.Fatalf("good agent while tunnels are stuck: %v", err)
	}
	wg.Wait()
	growth := int64(tunneltest.HeapInuse()) - int64(before)
	perTunnel := accepted.Load() / tunnels
	t.Logf("%d tunnels with no window: clients could write %d KiB each before blocking; heap growth %d KiB", tunnels, perTunnel>>10, growth>>10)
	// What a client can push is the Unix socket buffers plus one copy
	// buffer and one frame in the server, not an unbounded amount.
	if perTunnel > 8<<20 {
		t.Errorf("each client pushed %d MiB into a tunnel with no window", perTunnel>>20)
	}
	if growth > 16<<20 {
		t.Errorf("heap grew %d MiB", growth>>20)
	}
	for _, c := range conns {
		c.Close()
	}
	ev.conn.Close() // the stuck tunnels end with their agent
	e.WaitAgents(1)
	tunneltest.WaitUntil(t, func() bool { return frontOpen(e.srv) == 0 }, "stuck tunnels closed with their agent")
}

// A destination that never reads, and a client that gives up and closes
// after filling the tunnel's window: the tunnel must not stay open at the
// server and the agent for as long as the destination lives.
func TestClientGoneWhileDestinationStalled(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	a := e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	stop := make(chan struct{})
	dest := tunneltest.ServeTCP(t, func(c net.Conn) { <-stop }) // never reads
	t.Cleanup(func() { close(stop) })
	conn, _, resp := e.Connect(dest)
	if resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
	conn.SetWriteDeadline(time.Now().Add(time.Second))
	var pushed int64
	buf := make([]byte, 64<<10)
	for {
		n, err := conn.Write(buf)
		pushed += int64(n)
		if err != nil {
			break
		}
	}
	conn.Close()
	t.Logf("client pushed %d KiB, then closed", pushed>>10)
	deadline := time.Now().Add(5 * time.Second)
	for a.Stats.Tunnels.Load() != 0 || frontOpen(e.srv) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("5 s after the client closed: agent open streams %d, server frontends %d",
				a.Stats.Tunnels.Load(), frontOpen(e.srv))
		}
		time.Sleep(10 * time.Millisecond)
	}
}
