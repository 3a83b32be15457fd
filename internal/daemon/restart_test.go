package daemon

import (
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"os"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// socketPair returns both ends of a connected Unix socket, the first as a
// file (what a paused tunnel holds) and the second as a connection.
func socketPair(t *testing.T) (*os.File, net.Conn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	peer := os.NewFile(uintptr(fds[1]), "peer")
	defer peer.Close()
	c, err := net.FileConn(peer)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return os.NewFile(uintptr(fds[0]), "tunnel"), c
}

// entry stands for what a command hands over with a socket.
type entry struct {
	Addr  string `json:"addr"`
	Token string `json:"token"`
	Part  []byte `json:"part,omitempty"`
	conn  net.Conn
}

// conn makes f a connection, as a command holds its sockets.
func conn(t *testing.T, f *os.File) net.Conn {
	t.Helper()
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestTunnelsHandedToNextImage: the sockets written for the next image (a
// memory file and inherited descriptors, named in the environment) read
// back with their entries, each socket still talks to its peer, and no
// socket took a second descriptor: each crosses as the descriptor held,
// its close-on-exec cleared. A socket that cannot be handed over is
// closed alone; an entry without a socket is dropped with a warning.
func TestTunnelsHandedToNextImage(t *testing.T) {
	f1, peer1 := socketPair(t)
	f2, peer2 := socketPair(t)
	f3, peer3 := socketPair(t)
	c1, c2, c3 := conn(t, f1), conn(t, f2), conn(t, f3)
	c3.Close() // its descriptor is gone: only it is lost
	items := []*entry{{Addr: "10.0.0.1:443", Token: "t1", conn: c1}, {Addr: "10.0.0.3:1", conn: c3}, {Addr: "10.0.0.2:10250", Token: "t2", Part: []byte{0, 9, 1}, conn: c2}}
	var logs strings.Builder
	log := slog.New(slog.NewTextHandler(&logs, nil))
	files, err := newNextImageFiles()
	if err != nil {
		t.Fatal(err)
	}
	fds := openFDs(t)
	env := files.write(Hand("test entries", items, func(e *entry) net.Conn { return e.conn }), map[string]any{"admitted": []string{"a", "b"}}, log)
	if now := openFDs(t); now != fds {
		t.Errorf("%d descriptors open after the sockets were handed over, %d before: want no second descriptor per socket", now, fds)
	}
	if len(env) != 2 || !strings.HasPrefix(env[0], socketsEnv+"=") || !strings.HasPrefix(env[1], stateEnv+"=") {
		t.Fatalf("environment %q", env)
	}
	t.Setenv(stateEnv, strings.TrimPrefix(env[1], stateEnv+"="))
	if st := InheritedState(log); string(st["admitted"]) != `["a","b"]` {
		t.Errorf("state read back as %q", st)
	}
	for i, c := range []net.Conn{c1, c2} {
		rc, err := c.(syscall.Conn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		flags := 0
		rc.Control(func(fd uintptr) { flags, err = unix.FcntlInt(fd, unix.F_GETFD, 0) })
		if err != nil || flags&unix.FD_CLOEXEC != 0 {
			t.Errorf("socket %d: close-on-exec still set (%d, %v): the exec would close it", i, flags, err)
		}
	}
	t.Setenv(socketsEnv, strings.TrimPrefix(env[0], socketsEnv+"="))
	got := Inherit("test entries", func(e *entry, c net.Conn) { e.conn = c }, log)
	if _, set := os.LookupEnv(socketsEnv); set {
		t.Error("the entry is still in the environment: children would inherit it")
	}
	if len(got) != 2 {
		t.Fatalf("%d entries read back, want 2 (the closed socket lost alone); log:\n%s", len(got), logs.String())
	}
	_ = peer3
	for i, want := range []*entry{items[0], items[2]} {
		g := got[i]
		if g.Addr != want.Addr || g.Token != want.Token || !reflect.DeepEqual(g.Part, want.Part) {
			t.Errorf("entry %d read back as %+v, want %+v", i, g, want)
		}
		c := g.conn
		peer := []net.Conn{peer1, peer2}[i]
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		b := make([]byte, 4)
		if _, err := io.ReadFull(peer, b); err != nil || string(b) != "ping" {
			t.Errorf("entry %d's socket: %q %v", i, b, err)
		}
		c.Close()
	}
	if !strings.Contains(logs.String(), "test entries: socket not handed to the next image; closed") {
		t.Errorf("no warning for the lost socket; log:\n%s", logs.String())
	}

	// A list naming a descriptor that is not a socket drops that entry.
	f4, _ := socketPair(t)
	files, err = newNextImageFiles()
	if err != nil {
		t.Fatal(err)
	}
	env = files.write(Hand("test entries", []*entry{{Addr: "x:1", conn: conn(t, f4)}}, func(e *entry) net.Conn { return e.conn }), nil, log)
	spec := strings.TrimPrefix(env[0], socketsEnv+"=")
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	data := make([]byte, 4096)
	n, _ := unix.Pread(mustAtoi(t, spec), data, 0)
	var raw []handedEntry
	if err := json.Unmarshal(data[:n], &raw); err != nil || len(raw) != 1 {
		t.Fatalf("socket list %q: %v", data[:n], err)
	}
	unix.Dup2(int(devnull.Fd()), raw[0].FD) // the entry's descriptor now is /dev/null
	t.Setenv(socketsEnv, spec)
	if got := Inherit("test entries", func(e *entry, c net.Conn) { e.conn = c }, log); len(got) != 0 {
		t.Errorf("an entry on /dev/null was adopted: %+v", got[0])
	}
	if !strings.Contains(logs.String(), "ignoring inherited tunnel without a socket") {
		t.Errorf("no warning for it; log:\n%s", logs.String())
	}
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func mustAtoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatal(err)
	}
	return n
}
