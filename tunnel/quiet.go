package tunnel

import (
	"context"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// A draining server closes each frontend tunnel at a quiet moment rather
// than cutting it at the deadline: kube-apiserver keeps its keep-alive
// connections to webhooks and kubelets open through tunnels that never
// end by themselves, and a cut at the deadline fails whatever call is on
// such a connection then (it does not retry a POST). A tunnel is quiet
// once the last bytes it carried went toward the client (a response was
// delivered) and nothing came from the client since, for drainQuiet: the
// client then sees its idle keep-alive connection closed by the server,
// drops it, and dials again, which reaches the server's next life. A
// tunnel that never goes quiet (a log follow, an exec) is still cut at the
// deadline. So is a tunnel whose client has finished sending (half-closed
// its upload): no HTTP client half-closes a keep-alive connection, so it
// is waiting for the rest of an answer, and a pause in that answer (an
// agent or destination descheduled on a busy machine) is not the end of a
// call.
//
// drainQuiet is longer than the gaps inside one response (its writes
// follow each other within milliseconds: TLS records, chunks an agent
// passes on) and than the time this process takes to read a request the
// client has already sent, so that neither is mistaken for the end of a
// call; and short enough that the connections kube-apiserver keeps but
// is not using close within the first moments of a drain. On HTTP CONNECT
// a call that races the close finds the socket closed before it sent
// anything (EPIPE), and Go's HTTP client retries it. On the gRPC front
// door it does not: konnectivity-client accepts a write until it has
// processed the CLOSE_RSP, a few milliseconds on a loaded machine, and
// kube-apiserver then loses the call. There only a connection quiet for
// drainQuietGRPC is closed, long enough that kube-apiserver is not using
// it (measured against a real kube-apiserver: closes after 5 ms gaps
// lost 8 calls in 21, closes after 50 ms gaps some, after 250 ms none).
// The quiet is never shortened as the deadline nears, for the same reason.
const (
	drainQuiet     = 50 * time.Millisecond
	drainQuietGRPC = 250 * time.Millisecond
	drainPoll      = 2 * time.Millisecond
	// drainStall is a poll so late that the quiet seen across it is not
	// trusted: the process (or the machine) stalled, and the client's
	// next request may be just behind the stall.
	drainStall = 10 * time.Millisecond
)

// unread reports whether a socket holds bytes not read yet.
func unread(raw syscall.RawConn) bool {
	n := 0
	raw.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.SIOCINQ) })
	return n > 0
}

// closeQuietTunnels closes each open tunnel once it is quiet, until stop
// is closed. One goroutine per draining server polls them all: nothing
// runs per tunnel. A tunnel it closes moves to draining, which a
// restart's move never takes.
func (s *Server) closeQuietTunnels(ctx context.Context, stop <-chan struct{}) {
	type sample struct {
		v     uint64
		since time.Time
	}
	seen := map[*tunnel]sample{}
	var due []*tunnel
	tick := time.NewTicker(drainPoll)
	lastTick := time.Now()
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		now := time.Now()
		if now.Sub(lastTick) > drainStall {
			// This process did not run for a while: a quiet it did
			// not watch may be its own stall, not the client's silence.
			clear(seen)
		}
		lastTick = now
		due = due[:0]
		s.mu.Lock()
		for t := range s.tunnels {
			if t.state != tunnelOpen {
				continue
			}
			v := t.act.v.Load()
			prev, ok := seen[t]
			if !ok || prev.v != v {
				seen[t] = sample{v, now}
				continue
			}
			if v&1 == 1 && now.Sub(prev.since) >= t.front.quiet() && !t.up.isDone() {
				if t.front.unread() || t.act.v.Load() != v {
					// A request has come, or is being read.
					seen[t] = sample{t.act.v.Load(), now}
					continue
				}
				t.moveLocked(tunnelDraining)
				delete(seen, t)
				due = append(due, t)
			}
		}
		for t := range seen {
			if t.state != tunnelOpen {
				delete(seen, t)
			}
		}
		s.mu.Unlock()
		for _, t := range due {
			s.Stats.ClosedQuiet.Add(1)
			t.front.closeQuiet(t)
		}
	}
}
