package auth

import (
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

func TestParseUIDList(t *testing.T) {
	l, err := ParseUIDList(" 1000, 0 ,1000")
	if err != nil {
		t.Fatal(err)
	}
	if l.String() != "0,1000" || !l.Allows(0) || !l.Allows(1000) || l.Allows(1) {
		t.Errorf("got %s", l)
	}
	def, err := ParseUIDList("")
	if err != nil || def.String() != DefaultAllowedUIDs().String() {
		t.Errorf("empty list: %s, %v; want default %s", def, err, DefaultAllowedUIDs())
	}
	if !def.Allows(0) || !def.Allows(uint32(os.Getuid())) {
		t.Errorf("default %s must allow root and uid %d", def, os.Getuid())
	}
	anyUID, err := ParseUIDList("*")
	if err != nil || !anyUID.Allows(12345) || anyUID.String() != "*" {
		t.Errorf("*: %s %v", anyUID, err)
	}
	if (UIDAllowList{}).Allows(0) {
		t.Error("zero value allows root")
	}
	for _, bad := range []string{"root", "1,,2", "-1", "4294967295", "99999999999", "1 2", "0x10"} {
		if _, err := ParseUIDList(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func statOwner(t *testing.T, path string) (uid, gid uint32, mode os.FileMode) {
	t.Helper()
	st, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	sys := st.Sys().(*syscall.Stat_t)
	return sys.Uid, sys.Gid, st.Mode()
}

func TestApplySocketOwnership(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "konnectivity-server.socket")
	listenUnix(t, sock)
	passwd := filepath.Join(dir, "passwd")
	group := filepath.Join(dir, "group")
	writeFile(t, passwd, []byte("root:x:0:0:root:/root:/bin/sh\n# comment\n\nbroken\nkube-apiserver:x:4242:4343::/:/sbin/nologin\n"))
	writeFile(t, group, []byte("root:x:0:\nkube:x:4343:kube-apiserver,other\n"))
	apply := func(mode os.FileMode, owner, grp string) error {
		return applySocketOwnership(sock, mode, owner, grp, passwd, group)
	}

	if err := apply(0o600, "", ""); err != nil {
		t.Fatal(err)
	}
	uid0, gid0, mode := statOwner(t, sock)
	if mode != os.ModeSocket|0o600 {
		t.Errorf("mode %v, want 0600 socket", mode)
	}
	if uid0 != uint32(os.Getuid()) || gid0 != uint32(os.Getgid()) {
		t.Errorf("owner changed without being asked: %d:%d", uid0, gid0)
	}

	if os.Getuid() == 0 {
		if err := apply(0o660, "kube-apiserver", "kube"); err != nil {
			t.Fatal(err)
		}
		if uid, gid, mode := statOwner(t, sock); uid != 4242 || gid != 4343 || mode != os.ModeSocket|0o660 {
			t.Errorf("by name: %d:%d %v, want 4242:4343 0660", uid, gid, mode)
		}
		if err := apply(0o660, "65534", "65533"); err != nil {
			t.Fatal(err)
		}
		if uid, gid, _ := statOwner(t, sock); uid != 65534 || gid != 65533 {
			t.Errorf("numeric: %d:%d", uid, gid)
		}
		if err := apply(0o640, "", "kube"); err != nil { // group only
			t.Fatal(err)
		}
		if uid, gid, mode := statOwner(t, sock); uid != 65534 || gid != 4343 || mode != os.ModeSocket|0o640 {
			t.Errorf("group only: %d:%d %v", uid, gid, mode)
		}
		// The exported function reads the real /etc files.
		if err := ApplySocketOwnership(sock, 0o600, "root", "0"); err != nil {
			t.Fatal(err)
		}
		if uid, gid, _ := statOwner(t, sock); uid != 0 || gid != 0 {
			t.Errorf("root: %d:%d", uid, gid)
		}
	} else {
		self := []string{strconv.Itoa(os.Getuid()), strconv.Itoa(os.Getgid())}
		if err := apply(0o660, self[0], self[1]); err != nil {
			t.Fatal(err)
		}
	}

	regular := filepath.Join(dir, "plain")
	writeFile(t, regular, nil)
	for _, tc := range []struct{ path, owner, group, want string }{
		{sock, "nosuch", "", `socket owner: look up user "nosuch" in ` + passwd + `: not found`},
		{sock, "", "nosuch", `socket group: look up group "nosuch" in ` + group + `: not found`},
		{sock, "broken", "", `not found`},
		{sock, "4294967295", "", `reserved`},
		{regular, "", "", "is not a unix socket"},
		{filepath.Join(dir, "absent"), "", "", "no such file"},
	} {
		err := applySocketOwnership(tc.path, 0o600, tc.owner, tc.group, passwd, group)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s %q:%q: got %v, want %q", filepath.Base(tc.path), tc.owner, tc.group, err, tc.want)
		}
	}
	if err := applySocketOwnership(sock, 0o600, "x", "", filepath.Join(dir, "nopasswd"), group); err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing passwd file: %v", err)
	}
}

func TestCheckConnNotUnix(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if err := DefaultAllowedUIDs().CheckConn(a); StatusOf(err) != http.StatusForbidden {
		t.Errorf("pipe: %v", err)
	}
	anyUID, _ := ParseUIDList("*")
	if err := anyUID.CheckConn(a); err != nil {
		t.Errorf("* must not inspect the conn: %v", err)
	}
}
