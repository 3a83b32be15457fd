//go:build !linux

package auth

import (
	"errors"
	"net"
)

// PeerCredentials is only implemented on Linux (SO_PEERCRED); elsewhere it
// fails, so UIDAllowList.CheckConn refuses every peer unless the list is "*".
func PeerCredentials(c *net.UnixConn) (uid, gid uint32, pid int32, err error) {
	return 0, 0, 0, errors.New("peer credentials: only supported on linux")
}
