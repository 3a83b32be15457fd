package tunnel

import (
	"net"
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

// watchHangup ends the tunnel when the client, having stopped sending,
// turns out to have closed the socket altogether: otherwise a destination
// that never answers would hold the tunnel, and the agent's, open forever.
// It runs only for half-closed Unix-socket tunnels, and until done closes.
func (s *Server) watchHangup(conn net.Conn, st *stream, done <-chan struct{}) {
	if _, ok := conn.(*net.UnixConn); !ok {
		return
	}
	s.goroutine(func() {
		t := time.NewTicker(hangupCheckInterval)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-s.baseCtx.Done():
				return
			case <-t.C:
			}
			if peerHungUp(conn) {
				s.log.Debug("client closed a half-closed tunnel; ending it")
				st.close()
				conn.Close()
				return
			}
		}
	})
}

const hangupCheckInterval = time.Second
