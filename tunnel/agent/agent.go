package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/sys/unix"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// Config configures an Agent. Zero durations take the defaults below.
type Config struct {
	// ServerAddrs are host:port addresses of the server's agent listener.
	// One address may be a load balancer in front of several servers: the
	// agent then keeps dialling it until it holds a connection to as many
	// distinct servers as they announce. Several addresses are each dialled
	// directly, one connection each.
	ServerAddrs []string
	// ExpandDNS resolves each address's host to all its A/AAAA records and
	// holds a connection to each (the TLS server name stays the host name).
	ExpandDNS bool
	// SyncForever keeps probing a load-balanced address after the count is
	// reached, so a server added behind it is found without a connection drop.
	SyncForever bool
	// CountSource says how a server count from Leases (SetLeaseCount)
	// combines with the count servers announce. Without a lease count the
	// announced count is used either way.
	CountSource CountSource

	ID          string
	Identifiers string // upstream --agent-identifiers syntax, sent as is

	// TLS returns the client TLS configuration for a new connection to a
	// server whose certificate should carry serverName; required unless
	// PlainForTest. It is called for every connection, so a rotated CA or
	// client certificate on disk is picked up.
	TLS func(serverName string) (*tls.Config, error)
	// PlainForTest speaks to servers over plain TCP, without TLS: only for
	// tests that measure what the agent itself does with a server's bytes,
	// which a TLS handshake's allocations would blur. The product never
	// sets it.
	PlainForTest bool
	// Token returns the bearer token to present, read again on every
	// connect (projected tokens rotate). Nil means no token.
	Token func() (string, error)
	// TokenRefresh is how often each connection reads the token again and, when
	// it changed, presents it to its server on the control stream, so a
	// rotated token never drops a connection (default 30s).
	TokenRefresh time.Duration

	DialTimeout  time.Duration // destination dial bound (default 5s)
	KeepAlive    time.Duration // idle time before an HTTP/2 PING (default 30s)
	PingTimeout  time.Duration // how long a PING may go unanswered (default 15s)
	DrainTimeout time.Duration // on shutdown, how long open tunnels may finish (default 30s)
	SyncInterval time.Duration // first reconnect delay (default 1s)
	SyncCap      time.Duration // reconnect delay cap, and the re-probe/re-resolve period (default 10s)
	// CreditStallAfter is how long a server link's writers may wait for
	// connection credit none of them is given, or the link owe the server
	// credit, before it counts a credit stall (h2link's stall.go; default
	// 10s).
	CreditStallAfter time.Duration
	// MaxStreams bounds the tunnels one server connection may open at
	// once, MaxStreamsTotal those of all server connections together:
	// past either a CONNECT is answered 503 naming the flag (the
	// connection's HTTP/2 stream limit has room for each tunnel's pause
	// request). Each tunnel takes a descriptor, and one more while it is
	// kept for a restarting server, so the defaults come from the
	// descriptor limit (streamCaps): a server, however hostile, cannot
	// take the agent out of descriptors.
	MaxStreams      uint32
	MaxStreamsTotal uint32

	// ServerDialer connects to a server's address (host:port): directly,
	// or through an egress proxy. ctx bounds the connection and the
	// handshake after it. Nil dials directly.
	ServerDialer func(ctx context.Context, addr string) (net.Conn, error)
	// Dialer dials destinations; nil uses a net.Dialer.
	Dialer func(ctx context.Context, network, addr string) (net.Conn, error)
	// Resolver looks up a server host for ExpandDNS; nil uses the system resolver.
	Resolver func(ctx context.Context, host string) ([]netip.Addr, error)
	// Metrics receives the agent's metrics; nil makes a private registry.
	Metrics *promtext.Registry
	// Destinations limits what the agent dials; nil denies only the
	// built-in ranges (link-local, cloud metadata) and zoned addresses.
	Destinations *DestinationPolicy

	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	wire.DefaultDuration(&c.DialTimeout, 5*time.Second)
	wire.DefaultDuration(&c.KeepAlive, 30*time.Second)
	wire.DefaultDuration(&c.PingTimeout, 15*time.Second)
	wire.DefaultDuration(&c.DrainTimeout, 30*time.Second)
	wire.DefaultDuration(&c.SyncInterval, time.Second)
	wire.DefaultDuration(&c.SyncCap, 10*time.Second)
	wire.DefaultDuration(&c.TokenRefresh, 30*time.Second)
	if c.SyncCap < c.SyncInterval {
		c.SyncCap = c.SyncInterval
	}
	if c.MaxStreams == 0 || c.MaxStreamsTotal == 0 {
		perConn, total := streamCaps(descriptorLimit())
		if c.MaxStreamsTotal == 0 {
			c.MaxStreamsTotal = total
		}
		if c.MaxStreams == 0 {
			c.MaxStreams = min(perConn, c.MaxStreamsTotal)
		}
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Dialer == nil {
		c.Dialer = dialDestination(&net.Dialer{KeepAlive: 30 * time.Second})
	}
	if c.ServerDialer == nil {
		d := &net.Dialer{KeepAlive: 30 * time.Second}
		c.ServerDialer = func(ctx context.Context, addr string) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) }
	}
	if c.Metrics == nil {
		c.Metrics = promtext.NewRegistry()
	}
	if c.Destinations == nil {
		c.Destinations, _ = NewDestinationPolicy(DestinationRules{})
	}
	if c.Resolver == nil {
		c.Resolver = func(ctx context.Context, host string) ([]netip.Addr, error) {
			return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		}
	}
}

// Agent keeps a connection to every server and serves the servers' CONNECT
// streams by dialling their destinations.
//
// Locks (tunnel/doc.go, "Locks"): mu, then a link's, then gate.mu, a
// leaf; a connToServer's fields are immutable or atomic.
type Agent struct {
	// Immutable after New.
	cfg      Config
	log      *slog.Logger
	metrics  *agentMetrics
	warnings *wire.LogLimiter // repeated warnings: one line per key per 10s; its own lock
	// idle (capacity 1) is poked when the last open stream ends or the
	// last kept destination goes (pokeIdle): the drain waits on it.
	idle chan struct{}
	// gate is where the links take tunnels, and what the drain shuts.
	gate tunnelGate

	mu       sync.Mutex
	conns    map[*connToServer]struct{} // guarded by mu
	maxCount int                        // guarded by mu: servers wanted, announced and leaseCount combined by cfg.CountSource (at least 1)
	changed  chan struct{}              // guarded by mu: closed and replaced when connections change
	draining bool                       // guarded by mu
	drainEnd time.Time                  // guarded by mu: set with draining, when the drain cuts what is left
	// restarting is guarded by mu: set before the drain by Restarting, for
	// a restart in place (agent_restart.go); the kept destinations then
	// go to the next image instead of being waited for.
	restarting bool
	// Guarded by mu: the two counts maxCount combines.
	announced  int // largest server count announced by a live server (at least 1); the last one while none is live
	leaseCount int // valid server Leases (at least 1); 0 while unknown
	// kept is what the agent keeps for restarting servers: guarded by
	// mu, but for its atomic count (agent_pause.go).
	kept keptDests
	// Guarded by mu: when a server replaced one of the agent's
	// connections with another process's login of its ID (replaced),
	// the back-off before the agent logs in again, and when it may.
	replacedWait *backoff
	loginAfter   time.Time

	connWG sync.WaitGroup // goroutines serving connections; Run waits for them
	linkWG sync.WaitGroup // goroutines the links start (Spawn: stream handlers, writers); Run waits for them
	Stats  Stats          // atomic counters
}

// Stats are counters an operator reads through metrics and status.
type Stats struct {
	// Tunnels counts the agent's open tunnels, on every server
	// connection: a CONNECT stream counts from the moment its link took
	// it (takeTunnel, under the gate's lock while it is open) until its
	// handler ends (its dial, its destination open, its pause). It is the
	// count the caps, the drain (shutIfIdle), the metric and the status
	// read.
	Tunnels                    atomic.Int64
	BytesToDest, BytesFromDest atomic.Int64
}

// Descriptors reserved apart from tunnels: server connections, listeners,
// DNS, logs and the rest of the process.
const reservedDescriptors = 256

// streamCaps derives the default stream bounds from the descriptor limit:
// two descriptors per tunnel (its destination, and the duplicate kept for
// a restarting server) beside reservedDescriptors. One server connection
// may use the whole of it: with one server the agent carries as many
// tunnels as its descriptors allow, and with several the total is what
// binds (each server bounds what it sends one agent itself,
// --max-streams-per-agent).
func streamCaps(limit uint64) (perConn, total uint32) {
	t := uint64(16)
	if limit > reservedDescriptors+2*t {
		t = (limit - reservedDescriptors) / 2
	}
	t = min(t, 1<<20)
	return uint32(t), uint32(t)
}

// A destination socket's kernel buffers each way (SO_SNDBUF and
// SO_RCVBUF; the kernel doubles what it is given, for its bookkeeping)
// are sized by its path's segment size, once it is connected:
// destinationSegments segments, and never under minDestinationBuffer.
//
// A tunnel's bytes already wait in its stream window on the way in, and
// in its client's socket and the server's on the way out; the kernel's
// buffers toward a destination only need to keep its path busy. A
// destination is on the agent's node or one hop from it, tens of
// microseconds away: on a pod network (MSS 1448) the 64 KiB the kernel
// makes of minDestinationBuffer is 45 segments, 100 µs at 5 Gbit/s. A
// destination reached through the loopback device (the kubelet at the
// node's own address, a host-network pod) has 64 KiB segments, and a
// buffer of fewer than a few of them waits a delayed ACK for each one
// (40 ms): there the buffers hold four.
//
// The node's TCP memory (tcp_mem) is one pool for every socket on it: the
// destinations' own, the agent's, and the agent's link to the server.
// Left to the kernel, the agent's buffers grow with the traffic up to
// tcp_rmem and tcp_wmem (megabytes each), and each byte they hold is one
// the pool lacks; so does each kilobyte a larger fixed buffer adds over
// thousands of tunnels (2,000 tunnels at 256 KiB hold 512 MB). Past the
// pool's pressure mark the kernel clamps every connection's window and
// drops what does not fit, the link's too, and the link can no longer
// drain what filled the pool: tunnels then go seconds without a byte.
// BENCHMARKS.md ("Under load") has the figures.
const (
	minDestinationBuffer = 32 << 10
	destinationSegments  = 2
)

// destinationBufferFor is the buffer a destination socket whose path
// carries segments of mss bytes is given.
func destinationBufferFor(mss int) int { return max(minDestinationBuffer, destinationSegments*mss) }

// dialDestination dials a destination with d and sizes the connected
// socket's buffers by its path's segment size.
func dialDestination(d *net.Dialer) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		if tc, ok := c.(*net.TCPConn); ok {
			sizeDestinationBuffers(tc)
		}
		return c, nil
	}
}

// sizeDestinationBuffers sets a connected socket's buffers to
// destinationBufferFor its segment size. A socket whose segment size
// cannot be read keeps the kernel's buffers: still a working tunnel.
func sizeDestinationBuffers(c *net.TCPConn) {
	raw, err := c.SyscallConn()
	if err != nil {
		return
	}
	raw.Control(func(fd uintptr) {
		mss, err := unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_MAXSEG)
		if err != nil || mss <= 0 {
			return
		}
		n := destinationBufferFor(mss)
		unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF, n)
		unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, n)
	})
}

// descriptorLimit is the process's limit on open descriptors (Go raises
// the soft limit to the hard one at start).
func descriptorLimit() uint64 {
	var l unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &l); err != nil {
		return 1024
	}
	return l.Cur
}

// CountSource is how the agent combines the server count from Leases with
// the count servers announce (upstream's --server-count-source).
type CountSource int

const (
	// CountMax wants the larger of the two counts ("max").
	CountMax CountSource = iota
	// CountLeases wants the lease count alone once it is known ("default"
	// upstream, with --count-server-leases).
	CountLeases
)

// SetLeaseCount gives the agent the number of valid server Leases (0: not
// known). Seekers on a load-balanced address follow the new count at once.
func (a *Agent) SetLeaseCount(n int) {
	a.mu.Lock()
	if n < 0 || n == a.leaseCount {
		a.mu.Unlock()
		return
	}
	was := a.maxCount
	a.leaseCount = n
	a.recountLocked()
	connected, want := len(a.conns), a.maxCount
	a.mu.Unlock()
	if want != was {
		a.log.Info("server count changed", "servers", fmt.Sprintf("%d/%d", connected, want), "lease_count", n, "was", was)
	}
}

// New checks cfg and returns an Agent that is not yet running.
func New(cfg Config) (*Agent, error) {
	cfg.setDefaults()
	if err := wire.ValidID(cfg.ID); err != nil {
		return nil, fmt.Errorf("agent %w", err)
	}
	if _, err := wire.ParseIdentifiers(cfg.Identifiers); err != nil {
		return nil, err
	}
	if len(cfg.ServerAddrs) == 0 {
		return nil, fmt.Errorf("no server address")
	}
	if cfg.TLS == nil && !cfg.PlainForTest {
		return nil, errors.New("agent.Config.TLS is required: servers are reached over TLS")
	}
	for _, addr := range cfg.ServerAddrs {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return nil, fmt.Errorf("server address %q: %w", addr, err)
		}
	}
	a := &Agent{
		cfg:      cfg,
		log:      cfg.Logger,
		conns:    make(map[*connToServer]struct{}),
		maxCount: 1,
		changed:  make(chan struct{}),
		warnings: wire.NewLogLimiter(10 * time.Second),
		idle:     make(chan struct{}, 1),
	}
	a.announced = 1
	a.replacedWait = newBackoff(cfg.SyncInterval, cfg.SyncCap)
	a.metrics = newAgentMetrics(cfg.Metrics, a)
	return a, nil
}

// Ready reports whether the agent holds a connection to at least one server;
// the message says how many of the announced servers it holds.
func (a *Agent) Ready() (bool, string) {
	n, want := a.connected()
	return n > 0, fmt.Sprintf("connected %d/%d servers", n, want)
}

// ReadyAll reports whether the agent holds a connection to every server.
func (a *Agent) ReadyAll() (bool, string) {
	n, want := a.connected()
	return n >= want, fmt.Sprintf("connected %d/%d servers", n, want)
}

// connected returns how many servers the agent holds a connection to, and how
// many it wants (the largest count a live server announced, combined with
// the lease count by CountSource).
func (a *Agent) connected() (n, want int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.conns), a.maxCount
}

// Run holds connections to the servers until ctx ends. A server that is away
// never ends it: it is redialled with capped, jittered exponential backoff.
// When ctx ends the agent drains: it tells every server (so new dials go to
// other agents while any fit), lets open tunnels finish for up to
// DrainTimeout, then closes its connections. After Restarting, the drain
// is for a restart in place: servers pause what they can first, and the
// destinations kept for them stay for KeptForNextImage.
func (a *Agent) Run(ctx context.Context) error {
	connectCtx, stopConnecting := context.WithCancel(context.Background())
	defer stopConnecting()
	managers := a.startManagers(connectCtx)
	<-ctx.Done()

	deadline := a.beginDrain()
	restart := a.isRestarting()
	a.waitIdle(deadline, restart)
	// On a restart the kept destinations go to the next image: only
	// open streams are cut then.
	if n, kept := a.Stats.Tunnels.Load(), a.keptCount(); n > 0 || !restart && kept > 0 {
		a.log.Warn("drain timeout: closing open tunnels", "open", n, "kept", kept)
	}
	stopConnecting()
	managers.Wait()
	// GOAWAY on every server connection, then close what is left once
	// the servers have what was sent.
	a.goAwayLinks()
	a.waitSent()
	a.closeConns()
	a.connWG.Wait()
	a.linkWG.Wait()
	if !restart {
		a.releaseKept()
	}
	return nil
}

// tunnelGate is where the agent's links take tunnels (takeTunnel, their
// Config.Take) and what ends its drain. A tunnel counts in Stats.Tunnels
// from the moment its link took the stream, before its handler runs, so
// the drain sees every stream the agent has taken on; and the drain ends
// only by shutting the gate in the same step as it finds nothing counted
// (shutIfIdle), so no stream is taken after the agent was found idle.
// The link refuses a stream the gate does not take with REFUSED_STREAM:
// not processed, which the server dials again through another agent or
// this agent's next image. Were either step apart, a stream taken just as
// the drain ended would be answered and then cut by the agent's close,
// or, on a restart, found by the server after GOAWAY, when it can no
// longer pause it.
//
//	state | take (a link)          | shutIfIdle (the drain)    | the drain's deadline
//	open  | count the tunnel; open | none counted: shut        | shut
//	shut  | refuse the stream      | (the drain has ended)     | (the drain has ended)
//
// Once shut, the count only goes down.
type tunnelGate struct {
	mu   sync.Mutex // a leaf: taken under a link's mu (takeTunnel) and under Agent.mu (shutIfIdle)
	shut bool       // guarded by mu
}

// waitIdle waits until no tunnel is open and, but for a restart, no
// destination is kept, or until deadline, and shuts the gate: no stream
// is taken after the drain. A destination kept for a restarting server
// is still a tunnel: the server's next image resumes it through the
// connection the agent keeps redialling meanwhile. On the agent's own
// restart it goes to the agent's next image instead (KeptForNextImage).
func (a *Agent) waitIdle(deadline time.Time, restart bool) {
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	for !a.shutIfIdle(restart) {
		select {
		case <-a.idle:
		case <-t.C:
			a.gate.mu.Lock()
			a.gate.shut = true // what is still open is cut
			a.gate.mu.Unlock()
			return
		}
	}
}

// shutIfIdle shuts the gate if no tunnel is open and, but for a restart,
// no destination is kept, and reports whether it did. Kept destinations
// change under mu, where a resume moves one from kept to open
// (takePaused) after its stream was counted; the count goes up only under
// the gate's lock: holding both, neither can appear while it looks.
func (a *Agent) shutIfIdle(restart bool) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.gate.mu.Lock()
	defer a.gate.mu.Unlock()
	if a.Stats.Tunnels.Load() > 0 || !restart && a.kept.count > 0 {
		return false
	}
	a.gate.shut = true
	return true
}

// pokeIdle wakes waitIdle; it never blocks, so it may be called under mu.
// It is poked when the last open tunnel ends (releaseTunnel) or the last
// kept destination goes (dropKeptLocked).
func (a *Agent) pokeIdle() {
	select {
	case a.idle <- struct{}{}:
	default:
	}
}

// beginDrain tells every server the agent drains, and returns when it
// cuts what is left.
func (a *Agent) beginDrain() time.Time {
	a.mu.Lock()
	a.draining = true
	a.drainEnd = time.Now().Add(a.cfg.DrainTimeout)
	end := a.drainEnd
	conns := make([]*connToServer, 0, len(a.conns))
	for l := range a.conns {
		conns = append(conns, l)
	}
	a.mu.Unlock()
	for _, l := range conns {
		l.sendDrain()
	}
	a.log.Info("draining: servers told to prefer other agents", "servers", len(conns), "open_tunnels", a.Stats.Tunnels.Load())
	return end
}

// links returns the links of the agent's server connections that run
// HTTP/2.
func (a *Agent) links() []*h2link.Conn {
	a.mu.Lock()
	defer a.mu.Unlock()
	links := make([]*h2link.Conn, 0, len(a.conns))
	for l := range a.conns {
		if lk := l.link.Load(); lk != nil {
			links = append(links, lk)
		}
	}
	return links
}

func (a *Agent) goAwayLinks() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for l := range a.conns {
		if lk := l.link.Load(); lk != nil {
			lk.GoAwayNow()
		}
	}
}

// lingerAfterGoAway bounds how long a stopping agent waits for its
// servers to acknowledge what it sent: the ends of the last tunnels.
const lingerAfterGoAway = 2 * time.Second

// waitSent waits, for up to lingerAfterGoAway, until every server
// connection's peer has acknowledged what the agent wrote: closing a
// socket that has unread bytes resets it, and the reset throws away the
// last bytes of the tunnels that ended just before (h2link.Conn.Sent).
func (a *Agent) waitSent() {
	ctx, cancel := context.WithTimeout(context.Background(), lingerAfterGoAway)
	defer cancel()
	for _, lk := range a.links() {
		lk.Sent(ctx) // one deadline for all: the waits overlap
	}
}

func (a *Agent) closeConns() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for l := range a.conns {
		l.conn.Close()
	}
}

// deniedError is a dial the destination policy refused.
type deniedError struct{ err error }

func (e *deniedError) Error() string { return e.err.Error() }

// dialDestination checks addr against the destination policy and dials
// it. A host name is resolved here and the allowed address itself is
// dialled, so a name cannot be checked as one address and dialled as another.
func (a *Agent) dialDestination(ctx context.Context, addr string) (net.Conn, error) {
	host, portText, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	port, _ := strconv.Atoi(portText)
	var ips []netip.Addr
	if ip, err := netip.ParseAddr(host); err == nil {
		ips = []netip.Addr{ip}
	} else if ips, err = a.cfg.Resolver(ctx, host); err != nil {
		return nil, fmt.Errorf("resolve %s: %w", host, err)
	}
	var firstDenial, lastErr error
	for _, ip := range ips {
		if err := a.cfg.Destinations.Check(ip, port); err != nil {
			if firstDenial == nil {
				firstDenial = err
			}
			continue
		}
		// Allowed addresses are tried in the resolver's order, as a
		// plain dial of the name would.
		// The checked address, as Check saw it, is the one dialled.
		conn, err := a.cfg.Dialer(ctx, "tcp", netip.AddrPortFrom(dialAddr(ip), uint16(port)).String())
		if err == nil {
			return conn, nil
		}
		lastErr = err
		if ctx.Err() != nil {
			break
		}
	}
	if lastErr != nil {
		return nil, lastErr
	}
	if firstDenial == nil {
		firstDenial = fmt.Errorf("%s resolved to no address", host)
	}
	return nil, &deniedError{firstDenial}
}

// serveStream answers one CONNECT stream from the server: it dials the
// destination, answers 200 only once that worked, then carries bytes both
// ways. A tunnel has one goroutine here (this one, reading the
// destination) and its own HTTP/2 window.
func (a *Agent) serveStream(w http.ResponseWriter, r *http.Request) {
	defer wire.RecoverTunnelPanic(a.log, a.metrics.panics, "agent stream", true)
	a.metrics.packets.Inc(wire.SegToAgent, grpcwire.DialReq)
	dest := a.openDestination(w, r)
	a.metrics.packets.Inc(wire.SegFromAgent, grpcwire.DialRsp) // answered: 200 below, or an error
	if dest == nil {
		return
	}
	// When the stream ends from the server's side (reset, connection lost,
	// drain timeout) the destination is closed, so a silent destination
	// cannot hold this handler, and with it a shutdown, forever.
	stopWatch := context.AfterFunc(r.Context(), func() { dest.Close() })
	defer func() { // one deferred closure: see "Parked stacks" in doc.go
		stopWatch()
		dest.Close()
	}()
	w.WriteHeader(http.StatusOK)
	a.carry(w, r, dest)
}

// openDestination checks the request and dials its destination, or
// takes the one kept for it; on failure it answers the error itself and
// returns nil.
func (a *Agent) openDestination(w http.ResponseWriter, r *http.Request) net.Conn {
	if r.Method != http.MethodConnect {
		http.Error(w, "only CONNECT is served here", http.StatusMethodNotAllowed)
		return nil
	}
	addr := r.Host
	if _, err := wire.SplitDialAddress(addr); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return nil
	}
	if dest, handled := a.takeKeptFor(w, r); handled {
		return dest // a tunnel a restarting server's next image resumes
	}
	dialStart := time.Now()
	dctx, cancel := context.WithTimeout(r.Context(), a.cfg.DialTimeout)
	dest, err := a.dialDestination(dctx, addr)
	cancel()
	if err != nil {
		if r.Context().Err() != nil {
			a.metrics.packets.Inc(wire.SegToAgent, grpcwire.DialCls) // the server gave the dial up (RST_STREAM)
		}
		code := http.StatusBadGateway
		var ne net.Error
		var denied *deniedError
		if errors.As(err, &denied) {
			code = http.StatusForbidden
			a.metrics.dialDenied.Inc()
			a.warnings.Log(a.log, slog.LevelWarn, "denied "+addr, "dial refused by destination policy", "addr", addr, "reason", denied.Error())
		} else if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, context.DeadlineExceeded) {
			code = http.StatusGatewayTimeout
			a.metrics.dialTimeout.Inc()
		} else {
			a.metrics.dialUnknown.Inc()
		}
		a.log.Debug("destination dial failed", "addr", addr, "err", err)
		http.Error(w, fmt.Sprintf("dial %s: %v", addr, err), code)
		return nil
	}
	a.metrics.dialDuration.ObserveDuration(time.Since(dialStart))
	return dest
}

// carry moves the tunnel's bytes once the destination answered: the link
// delivers the upload to the destination (see deliverUpload) while this
// goroutine sends what the destination says. An idle tunnel parks here:
// see "Parked stacks" in doc.go.
func (a *Agent) carry(w http.ResponseWriter, r *http.Request, dest net.Conn) {
	flush := wire.FlusherOf(w)
	up := a.deliverUpload(r.Body.(*h2link.Body), dest) // before the 200: a server's stop request finds it (Conn.Sink)
	flush()
	var n int64
	var downErr error
	// Each read from the destination is sent as one DATA Packet.
	to := a.countingWriter(w)
	if rc := wire.RawSocket(dest); rc != nil {
		n, downErr = wire.CopyFromSocket(to, rc, flush) // not through wire.CopyStream: one frame less parked
	} else {
		n, downErr = wire.CopyStream(to, dest, flush)
	}
	wire.PutPacketWriter(to)
	a.Stats.BytesFromDest.Add(n)
	if a.downloadStopped(dest, n, downErr) {
		a.keptEnd(r, up) // the destination is kept for the server's next image
	}
	if downErr == nil {
		a.metrics.packets.Inc(wire.SegFromAgent, grpcwire.CloseRsp) // the destination's end, as END_STREAM
	}
	select {
	case <-up.Done():
		if _, upErr := up.Result(); downErr == nil && upErr == nil {
			a.countUpload(up)
			return // both directions ended cleanly: END_STREAM
		}
	default:
		if downErr == nil {
			if closed, upErr := halfClose(w, up); closed {
				if upErr == nil {
					a.countUpload(up)
					return // the client finished too
				}
				break // the upload broke after the half-close: reset
			}
		}
		// No half-close (or a broken download): the rest of the upload is
		// lost. Close the destination with a reset, so it sees an error and
		// not a clean end of the upload.
		if tc, ok := dest.(*net.TCPConn); ok {
			tc.SetLinger(0)
		}
		dest.Close() // also ends a delivery stuck writing to it
		r.Body.Close()
		<-up.Done()
		if downErr == nil {
			a.countUpload(up)
			return
		}
	}
	a.countUpload(up)
	r.Body.Close()
	a.metrics.resets.Inc()
	if downErr != nil {
		a.metrics.streamErrs.Inc(wire.SegFromAgent, wire.StreamErrorCode(downErr), grpcwire.Data)
	} else {
		a.metrics.streamErrs.Inc(wire.SegToAgent, wire.CodeCanceled, grpcwire.Data)
	}
	// A destination reset or a broken stream: tell the server with
	// RST_STREAM, so the client sees an abort rather than a clean end.
	panic(http.ErrAbortHandler)
}

// countingWriter counts each write to w as a DATA Packet from the agent.
func (a *Agent) countingWriter(w io.Writer) *wire.PacketWriter {
	pw := wire.PacketWriters.Get().(*wire.PacketWriter)
	pw.W, pw.C = w, wire.PacketCounter{&a.metrics.packets.N[wire.SegFromAgent][grpcwire.Data]}
	return pw
}

// halfClose handles a destination that finished first while the client is
// still sending: the response ends (END_STREAM, the client reads EOF) and
// the upload goes on until the client ends it too, so a destination that
// still reads loses nothing. closed is false when no half-close was
// possible (the upload still runs); otherwise upErr is how the upload ended.
func halfClose(w http.ResponseWriter, up *h2link.Delivery) (closed bool, upErr error) {
	hc, ok := w.(wire.CloseWriter)
	if !ok || hc.CloseWrite() != nil {
		return false, nil
	}
	<-up.Done()
	_, upErr = up.Result()
	return true, upErr
}

func (a *Agent) countUpload(up *h2link.Delivery) {
	n, _ := up.Result()
	a.Stats.BytesToDest.Add(n)
}

// deliverUpload carries what the server sends on a stream to the
// destination and passes the client's half-close on. A failed delivery
// closes the destination, which ends the download side too.
func (a *Agent) deliverUpload(body *h2link.Body, dest net.Conn) *h2link.Delivery {
	// Each write to the destination is a DATA Packet received from the server.
	toAgent := &a.metrics.packets.N[wire.SegToAgent][grpcwire.Data]
	body.OnWrite(func(int) { toAgent.Add(1) })
	return body.DeliverTo(dest, func(err error) error {
		if err == nil {
			a.metrics.packets.Inc(wire.SegToAgent, grpcwire.CloseReq) // END_STREAM from the server
			err = wire.CloseWrite(dest)                               // the client half-closed: pass it on
		}
		if err != nil {
			dest.Close()
		}
		return err
	})
}
