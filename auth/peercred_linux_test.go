package auth

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestPeerCredentialsSelf(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s")
	ln := listenUnix(t, sock)
	client, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server, err := ln.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()
	for name, c := range map[string]*net.UnixConn{"accepted": server, "dialled": client} {
		uid, gid, pid, err := PeerCredentials(c)
		if err != nil {
			t.Fatal(err)
		}
		if uid != uint32(os.Getuid()) || gid != uint32(os.Getgid()) || pid != int32(os.Getpid()) {
			t.Errorf("%s: got uid %d gid %d pid %d, want %d %d %d", name, uid, gid, pid, os.Getuid(), os.Getgid(), os.Getpid())
		}
	}
	if err := DefaultAllowedUIDs().CheckConn(server); err != nil {
		t.Errorf("default list refuses our own uid: %v", err)
	}
	other, _ := ParseUIDList("4242")
	err = other.CheckConn(server)
	if StatusOf(err) != http.StatusForbidden || !strings.Contains(err.Error(), fmt.Sprintf("peer uid %d (pid %d)", os.Getuid(), os.Getpid())) {
		t.Errorf("disallowed uid: %v", err)
	}

	// An unnamed socket pair works the same.
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		uid, _, pid, err := PeerCredentials(c.(*net.UnixConn))
		if err != nil || uid != uint32(os.Getuid()) || pid != int32(os.Getpid()) {
			t.Errorf("socketpair: uid %d pid %d err %v", uid, pid, err)
		}
	}

	server.Close()
	if _, _, _, err := PeerCredentials(server); err == nil {
		t.Error("closed conn: no error")
	}
}

// TestPeerCredentialsOtherUID runs a client as uid 65534 and checks that the
// guard sees that uid (the kernel's word, not the client's) and refuses it
// unless listed.
func TestPeerCredentialsOtherUID(t *testing.T) {
	if os.Getuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("this test must run as root in CI: it starts a client as uid 65534")
		}
		t.Skip("needs root to start a client as another uid (fails instead when CI=true)")
	}
	// t.TempDir and the go build cache are 0700: make a place uid 65534 can
	// reach, with a copy of this test binary it can execute.
	dir, err := os.MkdirTemp("", "konnectivity-auth-peer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(dir, "auth.test")
	copyExecutable(t, exe)
	sock := filepath.Join(dir, "frontend.sock")
	ln := listenUnix(t, sock)
	if err := os.Chmod(sock, 0o777); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		allowed string
		want    string
	}{
		{"", "HTTP/1.1 403 Forbidden"}, // default: root and us (also root)
		{"0,1000", "HTTP/1.1 403 Forbidden"},
		{"0,65534", "HTTP/1.1 200 Connection Established"},
	} {
		t.Run("allowed="+tc.allowed, func(t *testing.T) {
			allow, err := ParseUIDList(tc.allowed)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, exe, "-test.run=^$")
			cmd.Env = append(os.Environ(), peerHelperEnv+"="+sock)
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer cmd.Wait() // reaps the child on early failure too (ctx kills it)

			ln.SetDeadline(time.Now().Add(30 * time.Second))
			conn, err := ln.AcceptUnix()
			if err != nil {
				t.Fatalf("accept: %v (child stderr: %s)", err, stderr.String())
			}
			uid, gid, pid, err := PeerCredentials(conn)
			if err != nil {
				t.Fatal(err)
			}
			if uid != 65534 || gid != 65534 || int(pid) != cmd.Process.Pid {
				t.Errorf("peer uid %d gid %d pid %d, want 65534 65534 %d", uid, gid, pid, cmd.Process.Pid)
			}
			// Read the CONNECT request first: closing a unix socket with unread
			// input resets it and the client might never see the answer.
			if _, err := http.ReadRequest(bufio.NewReader(conn)); err != nil {
				t.Fatalf("read request: %v", err)
			}
			if err := allow.CheckConn(conn); err != nil {
				if StatusOf(err) != http.StatusForbidden || !strings.Contains(err.Error(), "peer uid 65534") {
					t.Errorf("unexpected refusal: %v", err)
				}
				fmt.Fprintf(conn, "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\n\r\n%s\n", err)
			} else {
				fmt.Fprintf(conn, "HTTP/1.1 200 Connection Established\r\n\r\n")
			}
			conn.Close()
			if err := cmd.Wait(); err != nil {
				t.Fatalf("child: %v, stderr: %s", err, stderr.String())
			}
			if !strings.HasPrefix(stdout.String(), tc.want) {
				t.Errorf("client got %q, want %q", stdout.String(), tc.want)
			}
		})
	}
}

func copyExecutable(t *testing.T, dst string) {
	t.Helper()
	src, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}
