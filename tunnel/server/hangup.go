package server

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

// The hang-up sweep ends tunnels whose client closed its Unix socket
// completely but whose tunnel cannot notice by itself: the destination is
// silent, or the upload is stuck on a destination that does not read. One
// goroutine sweeps every open tunnel in Server.tunnels; a tunnel found
// hung up on two sweeps in a row (so bytes the client sent just before
// closing still get their chance) is ended.
const hangupSweep = 2 * time.Second

// sweepHangups is one sweep. It owns tunnel.hungSeen.
func (s *Server) sweepHangups() {
	for _, t := range s.tunnelsIn(tunnelOpen) {
		c := t.front.hangup()
		if c == nil {
			continue
		}
		hung := peerHungUp(c)
		if hung && t.hungSeen {
			s.log.Debug("client closed its socket; ending the tunnel")
			t.endStream()
			t.front.closeSocket()
		}
		t.hungSeen = hung
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
			s.sweepHangups()
		}
	}
}
