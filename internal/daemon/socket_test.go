package daemon

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestListenUnix: the socket has the mode asked for, in a directory made
// for it; a stale socket is replaced only when asked, another file never.
func TestListenUnix(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run", "s.sock")
	ln, err := ListenUnix(path, 0o660, false)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o660 {
		t.Fatalf("socket: %v, mode %v; want 0660", err, fi.Mode().Perm())
	}
	ln.Close() // leaves a stale socket behind: the listener never unlinks
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("closing the listener removed the socket: %v", err)
	}
	if _, err := ListenUnix(path, 0o600, false); err == nil || !strings.Contains(err.Error(), "stale") {
		t.Fatalf("a stale socket was replaced without being asked to (err %v)", err)
	}
	ln, err = ListenUnix(path, 0o600, true)
	if err != nil {
		t.Fatalf("replacing a stale socket: %v", err)
	}
	ln.Close()
	file := filepath.Join(t.TempDir(), "not-a-socket")
	if err := os.WriteFile(file, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ListenUnix(file, 0o600, true); err == nil {
		t.Fatal("a regular file was replaced by a socket")
	}
	if _, err := os.Stat(file); err != nil {
		t.Fatalf("the regular file is gone: %v", err)
	}
}

// TestListenUnixLeavesLiveSocket: a socket something listens on is never
// removed, even with replace; the error names the process listening, and
// the listener keeps accepting on its path.
func TestListenUnixLeavesLiveSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	live, err := ListenUnix(path, 0o600, true)
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	accepted := make(chan error, 4)
	go func() {
		for {
			c, err := live.Accept()
			if err != nil {
				return
			}
			c.Close()
			accepted <- nil
		}
	}()
	for _, replace := range []bool{true, false} {
		_, err := ListenUnix(path, 0o600, replace)
		want := fmt.Sprintf("process %d listens on it", os.Getpid())
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("replace=%t: err %v, want one saying %q", replace, err, want)
		}
		<-accepted // the probe
	}
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("the live socket no longer answers: %v", err)
	}
	c.Close()
}

// TestSocketFileRemove: an exit removes its own socket, never one another
// process bound at the same path since.
func TestSocketFileRemove(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	ln, err := ListenUnix(path, 0o600, true)
	if err != nil {
		t.Fatal(err)
	}
	mine, err := OwnSocketFile(path)
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
	// Another process finds it stale and takes it over.
	other, err := ListenUnix(path, 0o600, true)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := mine.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("removed the socket another listener took over: %v", err)
	}
	theirs, err := OwnSocketFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := theirs.Remove(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Fatalf("own socket not removed: %v", err)
	}
}
