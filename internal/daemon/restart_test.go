package daemon

import (
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spinifex/konnectivity/tunnel/server"
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

// TestTunnelsHandedToNextImage: the paused tunnels written for the next
// image (a memory file and inherited descriptors, named in the
// environment) read back as they were, and each socket still talks to its
// peer. Entries without a socket are dropped with a warning.
func TestTunnelsHandedToNextImage(t *testing.T) {
	f1, peer1 := socketPair(t)
	f2, peer2 := socketPair(t)
	paused := []*server.PausedTunnel{
		{File: f1, Addr: "10.0.0.1:443", Agent: "node-a", Token: "t1"},
		{File: f2, Addr: "10.0.0.2:10250", Agent: "node-b", Token: "t2", GRPC: &server.PausedGRPC{ConnectID: 7, Partial: []byte{0, 0, 0, 0, 9, 1}}},
	}
	var logs strings.Builder
	log := slog.New(slog.NewTextHandler(&logs, nil))
	env := TunnelsForNextImage(paused, log)
	if len(env) != 1 || !strings.HasPrefix(env[0], tunnelsEnv+"=") {
		t.Fatalf("environment %q", env)
	}
	t.Setenv(tunnelsEnv, strings.TrimPrefix(env[0], tunnelsEnv+"="))
	got := InheritedTunnels(log)
	if _, set := os.LookupEnv(tunnelsEnv); set {
		t.Error("the entry is still in the environment: children would inherit it")
	}
	if len(got) != 2 {
		t.Fatalf("%d tunnels read back, want 2; log:\n%s", len(got), logs.String())
	}
	for i, want := range paused {
		g := got[i]
		if g.Addr != want.Addr || g.Agent != want.Agent || g.Token != want.Token || !reflect.DeepEqual(g.GRPC, want.GRPC) {
			t.Errorf("tunnel %d read back as %+v, want %+v", i, g, want)
		}
		c, err := net.FileConn(g.File)
		g.File.Close()
		if err != nil {
			t.Fatal(err)
		}
		peer := []net.Conn{peer1, peer2}[i]
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		b := make([]byte, 4)
		if _, err := io.ReadFull(peer, b); err != nil || string(b) != "ping" {
			t.Errorf("tunnel %d's socket: %q %v", i, b, err)
		}
		c.Close()
	}

	// A list naming a descriptor that is not a socket drops that entry.
	f3, _ := socketPair(t)
	env = TunnelsForNextImage([]*server.PausedTunnel{{File: f3, Addr: "x:1", Agent: "a", Token: "t"}}, log)
	spec := strings.TrimPrefix(env[0], tunnelsEnv+"=")
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	// Point the entry's descriptor at /dev/null.
	data := make([]byte, 4096)
	n, _ := unix.Pread(mustAtoi(t, spec), data, 0)
	var list []handed[*server.PausedTunnel]
	if err := json.Unmarshal(data[:n], &list); err != nil || len(list) != 1 {
		t.Fatalf("tunnel list %q: %v", data[:n], err)
	}
	unix.Dup2(int(devnull.Fd()), list[0].FD)
	t.Setenv(tunnelsEnv, spec)
	if got := InheritedTunnels(log); len(got) != 0 {
		t.Errorf("an entry on /dev/null was adopted: %+v", got[0])
	}
	if !strings.Contains(logs.String(), "ignoring inherited tunnel without a socket") {
		t.Errorf("no warning for it; log:\n%s", logs.String())
	}
}

func mustAtoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

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
	ln.SetUnlinkOnClose(false)
	ln.Close() // leaves a stale socket behind
	if _, err := ListenUnix(path, 0o600, false); err == nil {
		t.Fatal("a stale socket was replaced without being asked to")
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
