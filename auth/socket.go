package auth

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
)

// UIDAllowList is the set of user IDs allowed to connect to the frontend
// socket (--frontend-allowed-uids). The zero value allows nobody.
type UIDAllowList struct {
	any  bool
	uids []uint32 // sorted, unique
}

// DefaultAllowedUIDs allows root and the UID this process runs as.
func DefaultAllowedUIDs() UIDAllowList {
	l := UIDAllowList{uids: []uint32{0}}
	if uid := os.Getuid(); uid > 0 {
		l.uids = append(l.uids, uint32(uid))
	}
	return l
}

// ParseUIDList parses a comma-separated list of numeric UIDs such as
// "0,1000". "" means DefaultAllowedUIDs(); "*" allows every UID (turning the
// check off).
func ParseUIDList(s string) (UIDAllowList, error) {
	s = strings.TrimSpace(s)
	switch s {
	case "":
		return DefaultAllowedUIDs(), nil
	case "*":
		return UIDAllowList{any: true}, nil
	}
	var l UIDAllowList
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		uid, err := strconv.ParseUint(f, 10, 32)
		if err != nil || uid == 1<<32-1 { // -1 means "unset" to the kernel
			return UIDAllowList{}, fmt.Errorf("allowed UIDs %q: %q is not a numeric UID", s, f)
		}
		l.uids = append(l.uids, uint32(uid))
	}
	slices.Sort(l.uids)
	l.uids = slices.Compact(l.uids)
	return l, nil
}

// Allows reports whether uid may connect.
func (l UIDAllowList) Allows(uid uint32) bool {
	if l.any {
		return true
	}
	_, found := slices.BinarySearch(l.uids, uid)
	return found
}

// String renders the list in the form ParseUIDList accepts.
func (l UIDAllowList) String() string {
	if l.any {
		return "*"
	}
	parts := make([]string, len(l.uids))
	for i, u := range l.uids {
		parts[i] = strconv.FormatUint(uint64(u), 10)
	}
	return strings.Join(parts, ",")
}

// CheckConn returns nil if the peer of c (which must be a *net.UnixConn) runs
// as an allowed UID, and otherwise a 403 *Error naming the peer's uid and pid.
func (l UIDAllowList) CheckConn(c net.Conn) error {
	if l.any {
		return nil
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return &Error{Status: http.StatusForbidden, Reason: fmt.Sprintf("peer check needs a unix socket, got %T", c)}
	}
	uid, _, pid, err := PeerCredentials(uc)
	if err != nil {
		return &Error{Status: http.StatusForbidden, Reason: "cannot identify peer", err: err}
	}
	if !l.Allows(uid) {
		return &Error{Status: http.StatusForbidden, Reason: fmt.Sprintf("peer uid %d (pid %d) is not in the allowed UIDs [%s]", uid, pid, l)}
	}
	return nil
}

// ApplySocketOwnership sets the mode and, when owner or group are not
// empty, the owner and group of the Unix socket at path. owner and group
// are names (looked up in /etc/passwd and /etc/group) or numeric IDs.
func ApplySocketOwnership(path string, mode os.FileMode, owner, group string) error {
	return applySocketOwnership(path, mode, owner, group, "/etc/passwd", "/etc/group")
}

func applySocketOwnership(path string, mode os.FileMode, owner, group, passwdFile, groupFile string) error {
	st, err := os.Lstat(path)
	if err != nil {
		return fmt.Errorf("socket ownership: %w", err)
	}
	if st.Mode().Type() != os.ModeSocket {
		return fmt.Errorf("socket ownership: %s is not a unix socket", path)
	}
	uid, gid := -1, -1 // -1: leave unchanged
	if owner != "" {
		if uid, err = lookupID(owner, passwdFile, "user"); err != nil {
			return fmt.Errorf("socket owner: %w", err)
		}
	}
	if group != "" {
		if gid, err = lookupID(group, groupFile, "group"); err != nil {
			return fmt.Errorf("socket group: %w", err)
		}
	}
	if uid != -1 || gid != -1 {
		// Lchown: the path was just checked to be a socket, not a symlink.
		if err := os.Lchown(path, uid, gid); err != nil {
			return fmt.Errorf("socket ownership: %w", err)
		}
	}
	// Chmod after chown: some systems clear mode bits on chown.
	if err := os.Chmod(path, mode.Perm()); err != nil {
		return fmt.Errorf("socket mode: %w", err)
	}
	return nil
}

// lookupID resolves a numeric ID or a name from a passwd/group style file
// (name:password:id:...). Reading the file ourselves avoids cgo and NSS.
func lookupID(nameOrID, file, kind string) (int, error) {
	if id, err := strconv.ParseUint(nameOrID, 10, 32); err == nil {
		if id == 1<<32-1 {
			return 0, fmt.Errorf("%s ID %d is reserved", kind, id)
		}
		return int(id), nil
	}
	f, err := os.Open(file)
	if err != nil {
		return 0, fmt.Errorf("look up %s %q: %w", kind, nameOrID, err)
	}
	defer f.Close()
	id, err := findID(f, nameOrID)
	if err != nil {
		return 0, fmt.Errorf("look up %s %q in %s: %w", kind, nameOrID, file, err)
	}
	return id, nil
}

var errNotFound = errors.New("not found")

func findID(r io.Reader, name string) (int, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 1<<20) // group lines with many members are long
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		fields := strings.SplitN(line, ":", 4)
		if len(fields) < 3 || fields[0] != name {
			continue
		}
		id, err := strconv.ParseUint(fields[2], 10, 32)
		if err != nil {
			return 0, fmt.Errorf("bad ID field for %q", name)
		}
		return int(id), nil
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, errNotFound
}
