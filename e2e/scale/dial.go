package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	proxypb "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"

	"github.com/spinifex/konnectivity/e2e/internal/benchdial"
)

const (
	dialTimeout = 15 * time.Second // a dial answered (the agent dials within it)
	echoTimeout = 10 * time.Second // one small echo round trip
)

// dialer opens a byte stream to a destination through a front door.
type dialer func(ctx context.Context, target string) (net.Conn, error)

// connectDialer dials through the HTTP CONNECT front door on the server's
// Unix socket, one socket per tunnel, as kube-apiserver does.
func connectDialer(sock string) dialer {
	return func(ctx context.Context, target string) (net.Conn, error) {
		return benchdial.Connect(ctx, sock, target, dialTimeout)
	}
}

// grpcDialer dials through the gRPC front door as kube-apiserver does for
// proxyProtocol GRPC (benchdial.GRPC).
func grpcDialer(sock string) dialer {
	return func(ctx context.Context, target string) (net.Conn, error) {
		return benchdial.GRPC(ctx, sock, target, dialTimeout)
	}
}

// dialEcho dials, echoes one byte and closes; it returns the time from the
// dial to the echoed byte. konnectivity-client's connections have no
// deadlines, so the echo is bounded by closing the connection.
func dialEcho(ctx context.Context, dial dialer, target string, b byte) (time.Duration, error) {
	t0 := time.Now()
	c, err := dial(ctx, target)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	bound := time.AfterFunc(echoTimeout, func() { c.Close() })
	defer bound.Stop()
	if _, err := c.Write([]byte{b}); err != nil {
		return 0, fmt.Errorf("echo write: %w", err)
	}
	var got [1]byte
	if _, err := io.ReadFull(c, got[:]); err != nil {
		return 0, fmt.Errorf("echo read: %w", err)
	}
	d := time.Since(t0)
	if got[0] != b {
		return 0, fmt.Errorf("echo: sent %#x, got %#x", b, got[0])
	}
	return d, nil
}

// latency is one dial-latency figure.
type latency struct {
	p50, p99 time.Duration
	n, errs  int
	firstErr error
}

// measureLatency runs n sequential dials with a 1-byte echo each through
// dial and as many through ref, interleaved (the order swapped every other
// pair), so both figures are taken under the same load of the machine. A
// dial through ref that fails is not counted in either figure's errors:
// the reference is not under test, and its figure is left with fewer
// samples.
func measureLatency(ctx context.Context, dial, ref dialer, target string, n int) (latency, latency) {
	var l, r latency
	d := make([]time.Duration, 0, n)
	rd := make([]time.Duration, 0, n)
	for i := 0; i < n && ctx.Err() == nil; i++ {
		for k := range 2 {
			if (i+k)%2 == 1 {
				if t, err := dialEcho(ctx, ref, target, byte(i)); err == nil {
					rd = append(rd, t)
				} else if r.firstErr == nil {
					r.firstErr = err
				}
				continue
			}
			t, err := dialEcho(ctx, dial, target, byte(i))
			if err != nil {
				l.errs++
				if l.firstErr == nil {
					l.firstErr = err
				}
				continue
			}
			d = append(d, t)
		}
	}
	return summarize(l, d), summarize(r, rd)
}

// summarize fills l's percentiles from its samples.
func summarize(l latency, d []time.Duration) latency {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	l.n = len(d)
	l.p50, l.p99 = percentile(d, 50), percentile(d, 99)
	return l
}

// percentile is the nearest-rank percentile of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(p/100*float64(len(sorted))+0.999999) - 1
	return sorted[max(0, min(rank, len(sorted)-1))]
}

// holder holds idle tunnels open, each checked with a 1-byte echo.
type holder interface {
	// open opens tunnel i to target.
	open(ctx context.Context, i int, target string) error
	// close closes every held tunnel.
	close()
}

// openAll opens n tunnels, par at a time, target i spread over targets,
// and returns how many failed and the first error.
func openAll(ctx context.Context, h holder, targets []string, n, par int) (int, error) {
	var (
		wg       sync.WaitGroup
		next     atomic.Int64
		errs     atomic.Int64
		mu       sync.Mutex // guards firstErr
		firstErr error
	)
	for range par {
		wg.Add(1)
		go func() { // owned by openAll
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= n || ctx.Err() != nil {
					return
				}
				if err := h.open(ctx, i, targets[i%len(targets)]); err != nil {
					errs.Add(1)
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("tunnel %d: %w", i, err)
					}
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	return int(errs.Load()), firstErr
}

// connectHolder holds tunnels through the HTTP CONNECT door: one Unix
// socket each in this process.
type connectHolder struct {
	dial  dialer
	mu    sync.Mutex // guards conns
	conns []net.Conn
}

func (h *connectHolder) open(ctx context.Context, i int, target string) error {
	c, err := h.dial(ctx, target)
	if err != nil {
		return err
	}
	b := [1]byte{byte(i)}
	err = c.SetDeadline(time.Now().Add(echoTimeout))
	if err == nil {
		_, err = c.Write(b[:])
	}
	if err == nil {
		_, err = io.ReadFull(c, b[:])
	}
	if err == nil && b[0] != byte(i) {
		err = fmt.Errorf("echo got %#x, want %#x", b[0], byte(i))
	}
	if err == nil {
		err = c.SetDeadline(time.Time{})
	}
	if err != nil {
		c.Close()
		return err
	}
	h.mu.Lock()
	h.conns = append(h.conns, c)
	h.mu.Unlock()
	return nil
}

func (h *connectHolder) close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, c := range h.conns {
		c.Close()
	}
	h.conns = nil
}

// grpcStreamsPerConn stays below the server's bound on concurrent calls
// per gRPC front-door connection (1,000), so that no call waits for room.
const grpcStreamsPerConn = 800

// grpcHolder holds tunnels through the gRPC front door as a long-lived
// client that multiplexes its calls does: one ProxyService/Proxy call per
// tunnel (DIAL_REQ, DIAL_RSP, DATA both ways), many calls on each of a few
// gRPC connections.
type grpcHolder struct {
	ctx    context.Context // ends every held call
	cancel context.CancelFunc
	conns  []*grpc.ClientConn

	mu    sync.Mutex           // guards calls
	calls []context.CancelFunc // one per held call: ends it
}

func newGRPCHolder(sock string, tunnels int) (*grpcHolder, error) {
	n := max(1, (tunnels+grpcStreamsPerConn-1)/grpcStreamsPerConn)
	ctx, cancel := context.WithCancel(context.Background())
	h := &grpcHolder{ctx: ctx, cancel: cancel}
	for range n {
		cc, err := grpc.NewClient("passthrough:///"+sock,
			grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", sock)
			}),
			grpc.WithTransportCredentials(insecure.NewCredentials()),
		)
		if err != nil {
			h.close()
			return nil, fmt.Errorf("gRPC client for %s: %w", sock, err)
		}
		h.conns = append(h.conns, cc)
	}
	return h, nil
}

func (h *grpcHolder) open(ctx context.Context, i int, target string) error {
	// The call lives until the holder closes; only its opening is bounded
	// (by dialTimeout and ctx).
	sctx, cancel := context.WithCancel(h.ctx)
	failed := true
	bound := time.AfterFunc(dialTimeout, cancel)
	stopWatch := context.AfterFunc(ctx, cancel)
	defer func() {
		bound.Stop()
		stopWatch()
		if failed {
			cancel()
		}
	}()
	st, err := proxypb.NewProxyServiceClient(h.conns[i%len(h.conns)]).Proxy(sctx)
	if err != nil {
		return fmt.Errorf("open a ProxyService call: %w", err)
	}
	if err := st.Send(&proxypb.Packet{Type: proxypb.PacketType_DIAL_REQ, Payload: &proxypb.Packet_DialRequest{
		DialRequest: &proxypb.DialRequest{Protocol: "tcp", Address: target, Random: int64(i) + 1}}}); err != nil {
		return fmt.Errorf("send DIAL_REQ: %w", err)
	}
	pkt, err := st.Recv()
	if err != nil {
		return fmt.Errorf("receive DIAL_RSP: %w", err)
	}
	rsp := pkt.GetDialResponse()
	if pkt.Type != proxypb.PacketType_DIAL_RSP || rsp == nil {
		return fmt.Errorf("got %s, want DIAL_RSP", pkt.Type)
	}
	if rsp.Error != "" {
		return fmt.Errorf("dial %s: %s", target, rsp.Error)
	}
	b := []byte{byte(i)}
	if err := st.Send(&proxypb.Packet{Type: proxypb.PacketType_DATA, Payload: &proxypb.Packet_Data{
		Data: &proxypb.Data{ConnectID: rsp.ConnectID, Data: b}}}); err != nil {
		return fmt.Errorf("send DATA: %w", err)
	}
	pkt, err = st.Recv()
	if err != nil {
		return fmt.Errorf("receive echo: %w", err)
	}
	if got := pkt.GetData().GetData(); pkt.Type != proxypb.PacketType_DATA || len(got) != 1 || got[0] != b[0] {
		return fmt.Errorf("echo: got %s %x, want DATA %x", pkt.Type, got, b)
	}
	failed = false
	h.mu.Lock()
	h.calls = append(h.calls, cancel)
	h.mu.Unlock()
	return nil
}

func (h *grpcHolder) close() {
	h.mu.Lock()
	for _, end := range h.calls {
		end()
	}
	h.calls = nil
	h.mu.Unlock()
	h.cancel()
	for _, cc := range h.conns {
		cc.Close()
	}
}
