package tunnel

import (
	"net"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// peerHungUp reports whether the peer of a Unix socket has closed it
// completely. A read of EOF only says the peer stopped sending (it may be a
// half-close and still want the answer); POLLHUP says it is gone.
func peerHungUp(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	hup := false
	rc.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if n, err := unix.Poll(fds, 0); err == nil && n > 0 {
			hup = fds[0].Revents&(unix.POLLHUP|unix.POLLERR) != 0
		}
	})
	return hup
}

// hangups ends tunnels whose client closed its Unix socket completely but
// whose tunnel cannot notice by itself: the destination is silent, or the
// upload is stuck on a destination that does not read. One goroutine
// sweeps every open tunnel; a tunnel found hung up on two sweeps in a row
// (so bytes the client sent just before closing still get their chance)
// is ended.
type hangups struct {
	mu      sync.Mutex
	tunnels map[net.Conn]*hangupEntry
}

type hangupEntry struct {
	end      func()
	hungSeen bool
}

const hangupSweep = 2 * time.Second

func (h *hangups) add(c net.Conn, end func()) {
	if _, ok := c.(*net.UnixConn); !ok {
		return // TCP peers cannot be told apart this way; mTLS frontends rely on TCP keepalive
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.tunnels[c] = &hangupEntry{end: end}
}

func (h *hangups) remove(c net.Conn) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.tunnels, c)
}

func (h *hangups) sweep() {
	h.mu.Lock()
	conns := make([]net.Conn, 0, len(h.tunnels))
	for c := range h.tunnels {
		conns = append(conns, c)
	}
	h.mu.Unlock()
	for _, c := range conns {
		hung := peerHungUp(c)
		h.mu.Lock()
		e := h.tunnels[c]
		var end func()
		if e != nil {
			if hung && e.hungSeen {
				end = e.end
				delete(h.tunnels, c)
			}
			e.hungSeen = hung
		}
		h.mu.Unlock()
		if end != nil {
			end()
		}
	}
}

// runHangups sweeps until the server closes.
func (s *Server) runHangups() {
	t := time.NewTicker(hangupSweep)
	defer t.Stop()
	for {
		select {
		case <-s.baseCtx.Done():
			return
		case <-t.C:
			s.hangups.sweep()
		}
	}
}
