package daemon

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// socketProbeTimeout bounds the connect that tells a live socket from a
// stale one.
const socketProbeTimeout = time.Second

// ListenUnix creates a Unix socket at path with its final mode from the
// start (no window in which it is more open than asked), making its
// directory if needed: what Listen's create does for a socket.
//
// A socket already at path is taken over only when nothing listens on it:
// with replace set, a connect probes it and the path is removed only when
// the kernel refuses the connect (no process holds the socket). A socket
// that accepts, or whose state the probe cannot tell, is not touched and
// refused with an error naming the process that listens on it when the
// kernel says (SO_PEERCRED). Any other file at path is never removed.
//
// The listener does not unlink the path when closed: an exit removes it
// with the SocketFile OwnSocketFile returns, only while it is still this
// socket.
func ListenUnix(path string, mode os.FileMode, replace bool) (*net.UnixListener, error) {
	if err := takeOverSocket(path, replace); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("socket directory: %w", err)
	}
	old := unix.Umask(0o777 &^ int(mode.Perm()))
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	unix.Umask(old)
	if err != nil {
		return nil, err
	}
	ln.SetUnlinkOnClose(false)
	if err := os.Chmod(path, mode.Perm()); err != nil {
		ln.Close()
		os.Remove(path)
		return nil, fmt.Errorf("socket mode: %w", err)
	}
	return ln, nil
}

// takeOverSocket clears path for a new socket: nothing there, or a stale
// socket removed (with replace).
func takeOverSocket(path string, replace bool) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("%s exists and is not a socket; not removing it", path)
	}
	switch live, err := probeSocket(path); {
	case errors.Is(err, os.ErrNotExist):
		return nil // gone since the Lstat
	case err != nil:
		return fmt.Errorf("%s: cannot tell whether a process listens on it (%v); not removing it", path, err)
	case live != "":
		return fmt.Errorf("%s: %s listens on it; not taking it over (stop it first, or give this one another socket path)", path, live)
	}
	if !replace {
		return fmt.Errorf("%s already exists (a stale socket: nothing listens on it)", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	return nil
}

// probeSocket connects to the socket at path: live names the process
// that accepted ("a process", or "process 1234" when SO_PEERCRED tells),
// "" when the kernel refused the connect (nothing listens). A full listen
// backlog is a live process too; other errors are returned.
func probeSocket(path string) (live string, err error) {
	c, err := net.DialTimeout("unix", path, socketProbeTimeout)
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return "", nil
	case errors.Is(err, syscall.EAGAIN):
		return "a process (its listen backlog is full)", nil
	case errors.Is(err, syscall.ENOENT):
		return "", os.ErrNotExist
	case err != nil:
		return "", err
	}
	defer c.Close()
	live = "a process"
	if rc, err := c.(*net.UnixConn).SyscallConn(); err == nil {
		_ = rc.Control(func(fd uintptr) {
			if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil && cred.Pid > 0 {
				live = fmt.Sprintf("process %d", cred.Pid)
			}
		})
	}
	return live, nil
}

// SocketFile is the path of a Unix socket this process listens on, as it
// was when the process bound or adopted it: device, inode and change time,
// since a file system gives a removed file's inode number to the next one.
type SocketFile struct {
	path     string
	dev, ino uint64
	ctime    unix.Timespec
}

// OwnSocketFile records the socket now at path as this process's, once its
// mode and owner are final (they change its change time).
func OwnSocketFile(path string) (SocketFile, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return SocketFile{}, fmt.Errorf("socket %s: %w", path, err)
	}
	return SocketFile{path: path, dev: uint64(st.Dev), ino: st.Ino, ctime: st.Ctim}, nil
}

// Remove unlinks the path while it is still the recorded socket; a file
// another process put there since (a server that took over a socket it
// found dead) stays.
func (s SocketFile) Remove() error {
	if s.path == "" {
		return nil
	}
	var st unix.Stat_t
	if err := unix.Lstat(s.path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return err
	}
	if uint64(st.Dev) != s.dev || st.Ino != s.ino || st.Ctim != s.ctime {
		return nil
	}
	return os.Remove(s.path)
}
