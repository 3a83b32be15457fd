package auth

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// PeerCredentials returns the uid, gid and pid of the process on the other
// end of c, as recorded by the kernel when the connection was made
// (SO_PEERCRED), so the peer cannot lie about them.
func PeerCredentials(c *net.UnixConn) (uid, gid uint32, pid int32, err error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0, 0, 0, fmt.Errorf("peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, 0, 0, fmt.Errorf("peer credentials: %w", err)
	}
	if credErr != nil {
		return 0, 0, 0, fmt.Errorf("peer credentials: SO_PEERCRED: %w", credErr)
	}
	return cred.Uid, cred.Gid, cred.Pid, nil
}
