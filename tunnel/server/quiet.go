package server

import (
	"context"
	"syscall"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/sys/unix"
)

// A draining server closes each frontend tunnel at a quiet moment rather
// than cutting it at the deadline: kube-apiserver keeps its keep-alive
// connections to webhooks and kubelets open through tunnels that never
// end by themselves, and a cut at the deadline fails whatever call is on
// such a connection then (it does not retry a POST). A tunnel is quiet
// once the last bytes it carried went toward the client (a response was
// delivered) and nothing came from the client since: the client then sees
// its idle keep-alive connection closed by the server, drops it, and
// dials again, which reaches the server's next life (or another agent).
// A tunnel whose client has finished sending (half-closed its upload) is
// never closed this way: no HTTP client half-closes a keep-alive
// connection, so it is waiting for the rest of an answer.
//
// The rule (docs/restart.md, "The quiet close"): a tunnel is closed once
// it has been quiet for quietNeeded, measured from the last write toward
// the client (so a tunnel idle since before the drain began closes on the
// drain's first look): a quarter of the time left before the drain's
// deadline, at most drainQuietLong. Early in a drain only a tunnel idle
// for half a second is taken for an idle keep-alive connection: a busy
// machine stalls a stream's writes for tens of milliseconds (a
// destination, an agent or this process descheduled), and a stream closed
// in such a stall loses the rest of a response the client thinks
// complete; kube-apiserver, which keeps a connection it is not using idle
// for far longer, loses nothing by the wait. Near the deadline the figure
// shrinks to a poll: a tunnel that is cut at the deadline anyway (failing
// the call on it, if any) is better closed in a gap between calls just
// before it.
//
// On HTTP CONNECT a call that races the close usually finds the socket
// closed before it sent anything (EPIPE), and Go's HTTP client retries
// it; a call whose connection the client picked just as it closed is lost
// (seen against a real kube-apiserver now and then: one webhook call in
// some thousands, in a close a few milliseconds before an agent's
// deadline). On the gRPC
// front door it is lost more often: konnectivity-client accepts a write
// until it has processed the CLOSE_RSP, a few milliseconds on a loaded
// machine, and kube-apiserver then loses the call (measured against a
// real kube-apiserver: closes after 5 ms gaps lost 8 calls in 21, after
// 50 ms gaps some, after 250 ms none). There a quiet close loses a call
// only in the drain's last second, where the cut it replaces would lose
// the call on the connection for certain.
//
// An agent's drain (it announced one on its control stream, or sent
// upstream's DRAIN packet) closes that agent's tunnels by the same rule,
// against the time the agent said it cuts what is left (its
// --drain-timeout, on the control stream before the drain), less a tenth
// for the line's way here; an agent that does not say (upstream's, an
// older one) is taken to cut after agentDrainAssumed, the default. A busy
// tunnel is the agent's to cut, at its --drain-timeout.
const (
	drainQuietLong    = 500 * time.Millisecond
	drainQuietShare   = 4 // quietNeeded is the time left/drainQuietShare
	agentDrainAssumed = 30 * time.Second
	drainPoll         = 2 * time.Millisecond
	// drainStall is a poll so late that the quiet seen across it is not
	// trusted: the process (or the machine) stalled, and the client's
	// next request may be just behind the stall.
	drainStall = 10 * time.Millisecond
)

// quietNeeded is how long a tunnel must have been quiet for a drain to
// close it, left before the drain's deadline (negative: none is known).
func quietNeeded(left time.Duration) time.Duration {
	if left < 0 {
		return drainQuietLong
	}
	return max(min(drainQuietLong, left/drainQuietShare), drainPoll)
}

// unread reports whether a socket holds bytes not read yet.
func unread(raw syscall.RawConn) bool {
	n := 0
	raw.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.SIOCINQ) })
	return n > 0
}

// closeQuietTunnels closes each open tunnel once it is quiet (the rule
// above), until stop is closed or ctx ends; with of set, only that
// agent's tunnels, and it returns once none is left. deadline is the
// drain's (zero: none). One goroutine per drain polls them all: nothing
// runs per tunnel. A tunnel it closes moves to draining, which a
// restart's move never takes, nor another drain.
func (s *Server) closeQuietTunnels(ctx context.Context, stop <-chan struct{}, of *agentConn, deadline time.Time) {
	seen := map[*tunnel]uint64{} // the activity each tunnel showed on the last trusted poll
	type closing struct {
		t             *tunnel
		quiet, needed time.Duration
	}
	var due []closing
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
		left := time.Duration(-1)
		if !deadline.IsZero() {
			left = max(deadline.Sub(now), 0)
		}
		due = due[:0]
		mine := 0
		s.mu.Lock()
		for t := range s.tunnels {
			if t.state == tunnelReading || t.state == tunnelDialing || t.state == tunnelPassing || t.state == tunnelHeld {
				continue // no agent carries it (t.agent is not set, and not to be read)
			}
			if of != nil && t.agent != of {
				continue
			}
			mine++
			if t.state != tunnelOpen {
				continue
			}
			v := t.act.V.Load()
			prev, ok := seen[t]
			seen[t] = v
			if !ok || prev != v || v&1 == 0 || t.up.isDone() {
				continue // quiet only once seen unchanged across a poll
			}
			quiet := time.Duration(wire.Clock() - t.act.At.Load())
			needed := quietNeeded(left)
			if quiet < needed {
				continue
			}
			if t.front.unread() || t.act.V.Load() != v {
				continue // a request has come, or is being read
			}
			t.moveLocked(tunnelDraining)
			delete(seen, t)
			due = append(due, closing{t, quiet, needed})
		}
		for t := range seen {
			if t.state != tunnelOpen {
				delete(seen, t)
			}
		}
		s.mu.Unlock()
		for _, c := range due {
			s.Stats.ClosedQuiet.Add(1)
			s.log.Debug("drain: tunnel closed at a quiet moment", "addr", c.t.addr, "agent", c.t.agent.id,
				"quiet", c.quiet, "needed", c.needed, "left", left)
			c.t.front.closeQuiet(c.t)
		}
		if of != nil && mine == 0 {
			return
		}
	}
}

// agentDraining closes the tunnels of an agent that announced its drain
// at quiet moments (the rule above), once per agent connection; the agent
// cuts what is left after cutIn.
func (s *Server) agentDraining(a *agentConn, cutIn time.Duration) {
	if a.draining.Swap(true) {
		return
	}
	deadline := time.Now().Add(cutIn - cutIn/10)
	s.goroutineIfOpen(func() { s.closeQuietTunnels(s.baseCtx, nil, a, deadline) })
}
