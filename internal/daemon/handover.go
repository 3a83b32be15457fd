package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// What a restart hands to the next image besides its listeners: sockets
// (the server's paused tunnels, the agent's kept destinations), each with
// an entry the command wrote, as JSON. This file is the one place the
// format that crosses execve is written and read; what an entry holds is
// the command's (docs/restart.md).
//
// A socket crosses the exec as the descriptor the command already holds,
// its close-on-exec flag cleared: no second descriptor per socket, so a
// process near its descriptor limit hands over as much as one far from it.
// A socket that cannot be handed over is closed alone; the others go on.

// socketsEnv names a memory file, inherited across exec, that lists the
// sockets handed over: [{"fd": N, "tunnel": entry}, ...].
const socketsEnv = "KONNECTIVITY_INHERITED_TUNNELS"

// maxSocketsList bounds the list the next image reads.
const maxSocketsList = 64 << 20

// Handed is one socket a restart hands to the next image, with what goes
// with it.
type Handed struct {
	// Socket is the socket itself (a plain TCP or Unix socket): its
	// descriptor crosses the exec, so it stays open until then (Run keeps
	// it referenced).
	Socket net.Conn
	// Entry is written beside the descriptor as JSON.
	Entry any
	// What names the socket in the log ("paused tunnels").
	What string
}

// Hand lists items for the next image, socket giving each one's socket;
// what names them in the log.
func Hand[T any](what string, items []T, socket func(T) net.Conn) []Handed {
	out := make([]Handed, 0, len(items))
	for _, it := range items {
		out = append(out, Handed{Socket: socket(it), Entry: it, What: what})
	}
	return out
}

// handedEntry is one entry of the list as it crosses the exec.
type handedEntry struct {
	FD     int             `json:"fd"`
	Tunnel json.RawMessage `json:"tunnel"`
}

// stateEnv names a memory file, inherited across exec, with what the
// command hands the next image besides sockets, by name: {"name": value}
// (Work.State, InheritedState).
const stateEnv = "KONNECTIVITY_INHERITED_STATE"

// memFile is a memory file the next image inherits. It is made before
// anything stops (newMemFile), so that a process out of descriptors
// refuses the restart rather than losing what it hands over.
type memFile struct {
	fd int // close-on-exec until publish names it
}

func newMemFile(name string) (*memFile, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("memfd_create", err)
	}
	return &memFile{fd: fd}, nil
}

// discard closes the file: the restart did not happen, or it is not
// needed.
func (m *memFile) discard() { unix.Close(m.fd) }

// publish writes data, lets the file cross the exec and returns the
// environment entry env=fd that names it.
func (m *memFile) publish(env string, data []byte) (string, error) {
	for off := 0; off < len(data); {
		n, err := unix.Pwrite(m.fd, data[off:], int64(off))
		if err != nil {
			return "", os.NewSyscallError("pwrite", err)
		}
		off += n
	}
	if _, err := unix.FcntlInt(uintptr(m.fd), unix.F_SETFD, 0); err != nil {
		return "", os.NewSyscallError("fcntl", err)
	}
	return fmt.Sprintf("%s=%d", env, m.fd), nil
}

// nextImageFiles are the memory files of one restart: the socket list and
// the state.
type nextImageFiles struct {
	list, state *memFile
}

func newNextImageFiles() (*nextImageFiles, error) {
	list, err := newMemFile("konnectivity-handed")
	if err != nil {
		return nil, err
	}
	state, err := newMemFile("konnectivity-state")
	if err != nil {
		list.discard()
		return nil, err
	}
	return &nextImageFiles{list: list, state: state}, nil
}

func (f *nextImageFiles) discard() {
	f.list.discard()
	f.state.discard()
}

// write hands the next image the sockets and the state, and returns the
// environment entries that name them.
func (f *nextImageFiles) write(handed []Handed, state map[string]any, log *slog.Logger) []string {
	env := f.list.writeSockets(handed, log)
	if len(state) == 0 {
		f.state.discard()
		return env
	}
	data, err := json.Marshal(state)
	var entry string
	if err == nil {
		entry, err = f.state.publish(stateEnv, data)
	}
	if err != nil {
		log.Error("state not handed to the next image", "err", err)
		f.state.discard()
		return env
	}
	return append(env, entry)
}

// writeSockets lets each handed socket's descriptor cross the exec,
// writes the list and returns the environment entries that name it. A
// socket whose descriptor cannot cross the exec is closed and counted lost
// alone; only a list that cannot be written loses all.
func (l *memFile) writeSockets(handed []Handed, log *slog.Logger) []string {
	if len(handed) == 0 {
		l.discard()
		return nil
	}
	list := make([]handedEntry, 0, len(handed))
	lost := 0
	for _, h := range handed {
		entry, err := crossExec(h)
		if err != nil {
			lost++
			log.Warn(h.What+": socket not handed to the next image; closed", "err", err)
			closeSocket(h.Socket)
			continue
		}
		list = append(list, entry)
	}
	fail := func(err error) []string {
		log.Error(handed[0].What+" not handed to the next image; closed", "tunnels", len(handed), "err", err)
		for _, h := range handed {
			closeSocket(h.Socket)
		}
		l.discard()
		return nil
	}
	data, err := json.Marshal(list)
	if err != nil {
		return fail(err)
	}
	entry, err := l.publish(socketsEnv, data)
	if err != nil {
		return fail(err)
	}
	log.Info(handed[0].What+" handed to the next image", "tunnels", len(list), "lost", lost)
	return []string{entry}
}

// crossExec clears close-on-exec on h's own descriptor and returns
// its entry.
func crossExec(h Handed) (handedEntry, error) {
	sc, ok := h.Socket.(syscall.Conn)
	if !ok {
		return handedEntry{}, errors.New("not a plain socket")
	}
	data, err := json.Marshal(h.Entry)
	if err != nil {
		return handedEntry{}, err
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return handedEntry{}, err
	}
	fd, fdErr := -1, error(nil)
	if err := rc.Control(func(s uintptr) {
		fd = int(s)
		_, fdErr = unix.FcntlInt(s, unix.F_SETFD, 0)
	}); err != nil {
		return handedEntry{}, err
	}
	if fdErr != nil {
		return handedEntry{}, os.NewSyscallError("fcntl", fdErr)
	}
	return handedEntry{FD: fd, Tunnel: data}, nil
}

func closeSocket(c net.Conn) {
	if c != nil {
		c.Close()
	}
}

// Inherit reads (and clears) the list a previous image handed over,
// decoding each entry into a new T and giving it its socket with setConn.
// The sockets become connections one after the other, so that taking them
// over needs one spare descriptor, not one per socket. An entry whose
// descriptor is not a socket, or that does not decode, is dropped with a
// warning. what names the items in the log.
func Inherit[T any](what string, setConn func(*T, net.Conn), log *slog.Logger) []*T {
	spec, ok := os.LookupEnv(socketsEnv)
	os.Unsetenv(socketsEnv) // children of this process must not see it
	if !ok {
		return nil
	}
	mfd, err := strconv.Atoi(spec)
	if err != nil || mfd < 3 {
		log.Warn("ignoring malformed inherited "+what+" list", "entry", spec)
		return nil
	}
	f := os.NewFile(uintptr(mfd), "inherited-sockets")
	data, err := io.ReadAll(io.LimitReader(f, maxSocketsList))
	f.Close()
	var list []handedEntry
	if err == nil {
		err = json.Unmarshal(data, &list)
	}
	if err != nil {
		log.Warn("inherited "+what+" list unreadable; those tunnels are lost", "err", err)
		return nil
	}
	var out []*T
	for _, h := range list {
		var st unix.Stat_t
		if h.FD < 3 || unix.Fstat(h.FD, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK {
			log.Warn("ignoring inherited tunnel without a socket", "what", what, "fd", h.FD)
			continue
		}
		unix.CloseOnExec(h.FD) // until handed on again
		sock := os.NewFile(uintptr(h.FD), "tunnel")
		it := new(T)
		if err := json.Unmarshal(h.Tunnel, it); err != nil || len(h.Tunnel) == 0 || string(h.Tunnel) == "null" {
			log.Warn("ignoring inherited tunnel whose entry does not decode", "what", what, "fd", h.FD, "err", err)
			sock.Close()
			continue
		}
		c, err := net.FileConn(sock)
		sock.Close()
		if err != nil {
			log.Warn("inherited tunnel's socket unusable; closed", "what", what, "err", err)
			continue
		}
		setConn(it, c)
		out = append(out, it)
	}
	log.Info("resuming "+what+" handed over by the previous image", "tunnels", len(out))
	return out
}

// InheritedState reads (and clears) the state a previous image handed
// over (Work.State), by name; nil when there is none. Call it once.
func InheritedState(log *slog.Logger) map[string]json.RawMessage {
	spec, ok := os.LookupEnv(stateEnv)
	os.Unsetenv(stateEnv)
	if !ok {
		return nil
	}
	fd, err := strconv.Atoi(spec)
	if err != nil || fd < 3 {
		log.Warn("ignoring malformed inherited state", "entry", spec)
		return nil
	}
	f := os.NewFile(uintptr(fd), "inherited-state")
	data, err := io.ReadAll(io.LimitReader(f, maxSocketsList))
	f.Close()
	var state map[string]json.RawMessage
	if err == nil {
		err = json.Unmarshal(data, &state)
	}
	if err != nil {
		log.Warn("inherited state unreadable; starting without it", "err", err)
		return nil
	}
	return state
}
