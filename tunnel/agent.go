//lint:file-ignore SA1019 x/net/http2's Server.ServeConn and Transport.NewClientConn are the only APIs that run HTTP/2 on a connection we already hold with the roles flipped; net/http's replacements dial or accept their own connections.

package tunnel

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
)

// AgentConfig configures an Agent. Zero durations take the defaults below.
type AgentConfig struct {
	ServerAddr  string // host:port of the server's agent listener (or a load balancer)
	ID          string
	Identifiers string // upstream --agent-identifiers syntax, sent as is

	// TLS returns the client TLS configuration for each new connection, so
	// a rotated CA or client certificate on disk is picked up. Nil means
	// plain TCP, for tests only.
	TLS func() (*tls.Config, error)
	// Token returns the bearer token to present, read again on every
	// connect (projected tokens rotate). Nil means no token.
	Token func() (string, error)

	DialTimeout  time.Duration // destination dial bound (default 5s)
	KeepAlive    time.Duration // idle time before an HTTP/2 PING (default 30s)
	PingTimeout  time.Duration // how long a PING may go unanswered (default 15s)
	DrainTimeout time.Duration // on shutdown, how long open tunnels may finish (default 30s)
	BackoffMin   time.Duration // first reconnect delay (default 1s)
	BackoffMax   time.Duration // reconnect delay cap (default 10s)
	MaxStreams   uint32        // concurrent tunnels accepted per server connection (default 100000)

	// Dialer dials destinations; nil uses a net.Dialer.
	Dialer func(ctx context.Context, network, addr string) (net.Conn, error)

	Logger *slog.Logger
}

func (c *AgentConfig) setDefaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.DialTimeout, 5*time.Second)
	def(&c.KeepAlive, 30*time.Second)
	def(&c.PingTimeout, 15*time.Second)
	def(&c.DrainTimeout, 30*time.Second)
	def(&c.BackoffMin, time.Second)
	def(&c.BackoffMax, 10*time.Second)
	if c.BackoffMax < c.BackoffMin {
		c.BackoffMax = c.BackoffMin
	}
	if c.MaxStreams == 0 {
		c.MaxStreams = 100000
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Dialer == nil {
		d := &net.Dialer{KeepAlive: 30 * time.Second}
		c.Dialer = d.DialContext
	}
}

// Agent keeps a tunnel to the server and serves the server's CONNECT
// streams by dialling their destinations.
type Agent struct {
	cfg AgentConfig
	log *slog.Logger
	h1  *http.Server // only carries graceful shutdown to the HTTP/2 connections
	h2  *http2.Server

	mu      sync.Mutex
	servers map[string]*serverLink // by server ID
	conns   map[net.Conn]struct{}  // every live server connection, for a forced close

	streams sync.WaitGroup // handlers in flight
	Stats   AgentStats
}

// AgentStats are counters an operator reads through metrics and status.
type AgentStats struct {
	DialsOK, DialsFailed, OpenStreams atomic.Int64
	BytesToDest, BytesFromDest        atomic.Int64
}

type serverLink struct {
	id    string
	addr  string
	since time.Time
	count int
}

// NewAgent checks cfg and returns an Agent that is not yet running.
func NewAgent(cfg AgentConfig) (*Agent, error) {
	cfg.setDefaults()
	if err := validID(cfg.ID); err != nil {
		return nil, fmt.Errorf("agent %w", err)
	}
	if _, err := ParseIdentifiers(cfg.Identifiers); err != nil {
		return nil, err
	}
	if _, _, err := net.SplitHostPort(cfg.ServerAddr); err != nil {
		return nil, fmt.Errorf("server address %q: %w", cfg.ServerAddr, err)
	}
	a := &Agent{
		cfg:     cfg,
		log:     cfg.Logger,
		servers: make(map[string]*serverLink),
		conns:   make(map[net.Conn]struct{}),
	}
	a.h1 = &http.Server{HTTP2: &http.HTTP2Config{
		MaxReceiveBufferPerConnection: 1 << 30,
		MaxReceiveBufferPerStream:     streamWindow,
		MaxReadFrameSize:              maxFrameSize,
	}}
	a.h2 = &http2.Server{
		MaxConcurrentStreams:         cfg.MaxStreams,
		MaxReadFrameSize:             maxFrameSize,
		MaxUploadBufferPerConnection: 1 << 30,
		MaxUploadBufferPerStream:     streamWindow,
		ReadIdleTimeout:              cfg.KeepAlive,
		PingTimeout:                  cfg.PingTimeout,
		WriteByteTimeout:             cfg.KeepAlive + cfg.PingTimeout,
	}
	if err := http2.ConfigureServer(a.h1, a.h2); err != nil {
		return nil, fmt.Errorf("configure HTTP/2 server: %w", err)
	}
	return a, nil
}

// Ready reports whether the agent holds a tunnel to at least one server.
func (a *Agent) Ready() (bool, string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	n, want := len(a.servers), 1
	for _, s := range a.servers {
		want = max(want, s.count)
	}
	msg := fmt.Sprintf("connected %d/%d servers", n, want)
	return n > 0, msg
}

// Run keeps a tunnel to the server until ctx ends, reconnecting with capped,
// jittered exponential backoff; a server that is away never ends it. When
// ctx ends, the agent stops taking new streams and lets open tunnels finish
// for up to DrainTimeout.
func (a *Agent) Run(ctx context.Context) error {
	loopDone := make(chan struct{})
	go func() {
		defer close(loopDone)
		a.connectLoop(ctx)
	}()
	<-ctx.Done()
	// GOAWAY on every server connection: no new streams, open ones finish.
	a.h1.Shutdown(context.Background())
	drained := make(chan struct{})
	go func() { a.streams.Wait(); close(drained) }()
	select {
	case <-drained:
	case <-time.After(a.cfg.DrainTimeout):
		a.log.Warn("drain timeout: closing open tunnels", "open", a.Stats.OpenStreams.Load())
	}
	a.closeConns()
	<-loopDone
	<-drained
	return nil
}

func (a *Agent) closeConns() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for c := range a.conns {
		c.Close()
	}
}

func (a *Agent) connectLoop(ctx context.Context) {
	backoff := a.cfg.BackoffMin
	for ctx.Err() == nil {
		started := time.Now()
		err := a.connectOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		if time.Since(started) > 2*a.cfg.BackoffMax {
			backoff = a.cfg.BackoffMin // it was up for a while: come back fast
		}
		var se *StatusError
		if errors.As(err, &se) && se.Code == http.StatusConflict {
			backoff = a.cfg.BackoffMin
		}
		if err != nil {
			a.log.Warn("server connection failed", "server", a.cfg.ServerAddr, "err", err, "retry_in", backoff.Round(time.Millisecond).String())
		} else {
			a.log.Info("server connection closed", "server", a.cfg.ServerAddr)
		}
		// Full jitter keeps a fleet of agents from reconnecting in step.
		delay := backoff/2 + rand.N(backoff/2+1)
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		backoff = min(backoff*2, a.cfg.BackoffMax)
	}
}

// connectOnce dials the server, performs the handshake and serves HTTP/2
// on the connection until it ends.
func (a *Agent) connectOnce(ctx context.Context) error {
	hctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	raw, err := (&net.Dialer{KeepAlive: 30 * time.Second}).DialContext(hctx, "tcp", a.cfg.ServerAddr)
	if err != nil {
		return fmt.Errorf("dial server %s: %w", a.cfg.ServerAddr, err)
	}
	conn := raw
	if a.cfg.TLS != nil {
		tcfg, err := a.cfg.TLS()
		if err != nil {
			raw.Close()
			return fmt.Errorf("TLS configuration: %w", err)
		}
		tc := tls.Client(raw, tcfg)
		if err := tc.HandshakeContext(hctx); err != nil {
			raw.Close()
			return fmt.Errorf("TLS handshake with %s: %w", a.cfg.ServerAddr, err)
		}
		conn = tc
	}
	hello := agentHello{ID: a.cfg.ID, Identifiers: a.cfg.Identifiers, Held: a.heldServers()}
	if a.cfg.Token != nil {
		if hello.Token, err = a.cfg.Token(); err != nil {
			conn.Close()
			return fmt.Errorf("service account token: %w", err)
		}
	}
	if dl, ok := hctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	host, _, _ := net.SplitHostPort(a.cfg.ServerAddr)
	if err := writeHello(conn, host, hello); err != nil {
		conn.Close()
		return fmt.Errorf("send handshake: %w", err)
	}
	br := bufio.NewReaderSize(conn, 4096)
	reply, err := readReply(br)
	if err != nil {
		conn.Close()
		return fmt.Errorf("server %s refused the tunnel: %w", a.cfg.ServerAddr, err)
	}
	conn.SetDeadline(time.Time{})

	bc := &bufferedConn{Conn: conn, r: br}
	link := &serverLink{id: reply.ServerID, addr: a.cfg.ServerAddr, since: time.Now(), count: reply.Count}
	if !a.addLink(link, bc) {
		conn.Close()
		return fmt.Errorf("agent is shutting down")
	}
	defer a.removeLink(link, bc)
	a.log.Info("connected to server", "server_id", reply.ServerID, "addr", a.cfg.ServerAddr, "server_count", reply.Count)
	a.h2.ServeConn(bc, &http2.ServeConnOpts{
		Context:    ctx,
		BaseConfig: a.h1,
		Handler:    http.HandlerFunc(a.serveStream),
	})
	return nil
}

func (a *Agent) heldServers() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	ids := make([]string, 0, len(a.servers))
	for id := range a.servers {
		ids = append(ids, id)
	}
	return ids
}

func (a *Agent) addLink(l *serverLink, c net.Conn) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.servers[l.id] = l
	a.conns[c] = struct{}{}
	return true
}

func (a *Agent) removeLink(l *serverLink, c net.Conn) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.servers[l.id] == l {
		delete(a.servers, l.id)
	}
	delete(a.conns, c)
	c.Close()
}

// serveStream answers one CONNECT stream from the server: it dials the
// destination, answers 200 only once that worked, then carries bytes both
// ways. Each tunnel has its own goroutines and its own HTTP/2 window.
func (a *Agent) serveStream(w http.ResponseWriter, r *http.Request) {
	a.streams.Add(1)
	defer a.streams.Done()
	if r.Method != http.MethodConnect {
		http.Error(w, "only CONNECT is served here", http.StatusMethodNotAllowed)
		return
	}
	addr := r.Host
	if _, err := splitDialAddress(addr); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	dctx, cancel := context.WithTimeout(r.Context(), a.cfg.DialTimeout)
	dest, err := a.cfg.Dialer(dctx, "tcp", addr)
	cancel()
	if err != nil {
		a.Stats.DialsFailed.Add(1)
		code := http.StatusBadGateway
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, context.DeadlineExceeded) {
			code = http.StatusGatewayTimeout
		}
		a.log.Debug("destination dial failed", "addr", addr, "err", err)
		http.Error(w, fmt.Sprintf("dial %s: %v", addr, err), code)
		return
	}
	a.Stats.DialsOK.Add(1)
	a.Stats.OpenStreams.Add(1)
	defer a.Stats.OpenStreams.Add(-1)
	defer dest.Close()
	w.WriteHeader(http.StatusOK)
	flush := flusherOf(w)
	flush()

	upDone := make(chan error, 1)
	go func() {
		n, err := copyStream(dest, r.Body, nil)
		a.Stats.BytesToDest.Add(n)
		if err == nil {
			err = closeWrite(dest) // the client half-closed: pass it on
		}
		if err != nil {
			dest.Close() // unblocks the download side too
		}
		upDone <- err
	}()
	n, downErr := copyStream(w, dest, flush)
	a.Stats.BytesFromDest.Add(n)

	select {
	case upErr := <-upDone:
		if downErr == nil && upErr == nil {
			return // both directions ended cleanly: END_STREAM
		}
	default:
		// The destination finished first while the client is still sending.
		// Go's HTTP/2 server cannot half-close a stream it still reads, so
		// it ends the response (END_STREAM) and resets the request side.
		r.Body.Close()
		<-upDone
		if downErr == nil {
			return
		}
	}
	r.Body.Close()
	// A destination reset or a broken stream: tell the server with
	// RST_STREAM, so the client sees an abort rather than a clean end.
	panic(http.ErrAbortHandler)
}

var _ io.Reader = (*bufferedConn)(nil)
