package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Self-restart: the process re-executes itself in place (same PID, so
// supervise-daemon sees nothing) and hands its listening sockets to the new
// image as inherited file descriptors. Connections that arrive during the
// switch wait in the kernel's listen backlog; none is refused.

// inheritEnv names the listeners passed across exec: "name=fd,name=fd".
const inheritEnv = "KONNECTIVITY_INHERITED_FDS"

// listenerSet opens the process's listeners, adopting inherited ones when a
// previous image of this process handed them over. It is owned by its
// Daemon's goroutine, as the Daemon is: no lock.
type listenerSet struct {
	log       *slog.Logger
	inherited map[string]*os.File // handed over and not yet adopted; nil after closeUnused
	open      []namedListener     // every listener opened or adopted, for handOver and Close
}

type namedListener struct {
	name string
	ln   net.Listener
}

// newListenerSet reads (and clears) the inherited descriptors.
func newListenerSet(log *slog.Logger) *listenerSet {
	ls := &listenerSet{log: log, inherited: map[string]*os.File{}}
	spec := os.Getenv(inheritEnv)
	os.Unsetenv(inheritEnv) // children of this process must not see it
	for _, part := range strings.Split(spec, ",") {
		name, fdText, ok := strings.Cut(part, "=")
		if !ok {
			continue
		}
		fd, err := strconv.Atoi(fdText)
		if err != nil || fd < 3 {
			log.Warn("ignoring malformed inherited descriptor", "entry", part)
			continue
		}
		unix.CloseOnExec(fd) // until handed on again
		ls.inherited[name] = os.NewFile(uintptr(fd), name)
	}
	return ls
}

// listen returns the listener called name: the inherited one if it is
// bound to the same address, otherwise a new one from create.
func (ls *listenerSet) listen(name, network, addr string, create func() (net.Listener, error)) (net.Listener, error) {
	if f := ls.inherited[name]; f != nil {
		delete(ls.inherited, name)
		ln, err := net.FileListener(f)
		f.Close() // FileListener dups it
		switch {
		case err != nil:
			ls.log.Warn("inherited listener unusable; opening a new one", "listener", name, "err", err)
		case sameAddr(ln.Addr(), network, addr):
			ls.log.Info("adopted inherited listener", "listener", name, "addr", ln.Addr().String())
			ls.open = append(ls.open, namedListener{name, ln})
			return ln, nil
		default:
			ls.log.Info("inherited listener is on another address; opening a new one", "listener", name, "was", ln.Addr().String(), "now", addr)
			ln.Close()
		}
	}
	ln, err := create()
	if err != nil {
		return nil, err
	}
	ls.open = append(ls.open, namedListener{name, ln})
	return ln, nil
}

// closeUnused closes inherited listeners this configuration did not ask for.
func (ls *listenerSet) closeUnused() {
	for name, f := range ls.inherited {
		ls.log.Info("closing inherited listener no longer configured", "listener", name)
		f.Close()
	}
	ls.inherited = nil
}

func sameAddr(have net.Addr, network, want string) bool {
	if network == "unix" {
		return have.Network() == "unix" && have.String() == want
	}
	h, ok := have.(*net.TCPAddr)
	if !ok {
		return false
	}
	host, port, err := net.SplitHostPort(want)
	if err != nil || strconv.Itoa(h.Port) != port {
		return false
	}
	if host == "" {
		return h.IP.IsUnspecified()
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.Equal(h.IP)
}

// handOver duplicates every open listener's descriptor without
// close-on-exec and returns the environment entry that names them. It must
// run before the listeners are closed; a Unix socket's path stays.
//
// The duplicates are raw descriptors, not *os.File: File().Fd() would put
// the shared socket into blocking mode (stalling this process's own accept
// loops), and an unreferenced *os.File may be closed by its finalizer
// before the exec.
func (ls *listenerSet) handOver() (string, error) {
	var parts []string
	var dups []int
	fail := func(err error) (string, error) {
		for _, fd := range dups {
			unix.Close(fd)
		}
		return "", err
	}
	for _, nl := range ls.open {
		sc, ok := nl.ln.(syscall.Conn) // the net package's interface; x/sys/unix has none
		if !ok {
			return fail(fmt.Errorf("listener %s cannot be handed over", nl.name))
		}
		rc, err := sc.SyscallConn()
		if err != nil {
			return fail(fmt.Errorf("listener %s: %w", nl.name, err))
		}
		dup := -1
		var dupErr error
		if err := rc.Control(func(fd uintptr) {
			dup, dupErr = unix.FcntlInt(fd, unix.F_DUPFD, 3) // F_DUPFD does not set close-on-exec
		}); err != nil {
			return fail(fmt.Errorf("listener %s: %w", nl.name, err))
		}
		if dupErr != nil {
			return fail(fmt.Errorf("duplicate listener %s: %w", nl.name, dupErr))
		}
		dups = append(dups, dup)
		parts = append(parts, fmt.Sprintf("%s=%d", nl.name, dup))
	}
	for _, nl := range ls.open {
		if ul, ok := nl.ln.(*net.UnixListener); ok {
			ul.SetUnlinkOnClose(false) // the path stays for the next image
		}
	}
	return inheritEnv + "=" + strings.Join(parts, ","), nil
}

// restartTarget is the executable a restart would run, refused early when
// it is missing or not executable, so nothing is stopped for nothing.
func restartTarget() (string, error) {
	exe, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("find own executable: %w", err)
	}
	fi, err := os.Stat(exe)
	if err != nil {
		return "", fmt.Errorf("restart target %s: %w", exe, err)
	}
	if !fi.Mode().IsRegular() {
		return "", fmt.Errorf("restart target %s is not a regular file", exe)
	}
	if err := unix.Access(exe, unix.X_OK); err != nil {
		return "", fmt.Errorf("restart target %s is not executable: %w", exe, err)
	}
	return exe, nil
}

// execSelf replaces the process image, keeping the PID; handOver are the
// entries that name what the new image inherits. On success it does not
// return.
func execSelf(exe string, handOver []string, log *slog.Logger) error {
	env := handOver
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, inheritEnv+"=") && !strings.HasPrefix(kv, socketsEnv+"=") && !strings.HasPrefix(kv, stateEnv+"=") && !strings.HasPrefix(kv, logDroppedEnv+"=") {
			env = append(env, kv)
		}
	}
	log.Info("re-executing in place", "exe", exe, "pid", os.Getpid())
	// The lines still queued go with the old image: written within a
	// bound, or counted as dropped for the next image to say.
	flushLog(log)
	if q := logQueueOf(log); q != nil {
		if kv := q.handOn(); kv != "" {
			env = append(env, kv)
		}
	}
	// A handled signal is reset to its default across exec, and SIGHUP's
	// default ends the process: one that comes before the next image
	// subscribes (restartRequests) would kill it and every tunnel it
	// inherits. An ignored signal stays ignored until the next image
	// subscribes; the restart it would ask for is under way.
	signal.Ignore(unix.SIGHUP)
	err := unix.Exec(exe, os.Args, env)
	return fmt.Errorf("exec %s: %w", exe, err)
}

// binaryWatcher reports when the executable on disk is replaced, after the
// new file has stopped changing (a copy in progress is not a new binary).
// Its goroutine, counted in owner, ends with ctx.
func binaryWatcher(ctx context.Context, every time.Duration, log *slog.Logger, owner *sync.WaitGroup) <-chan struct{} {
	changed := make(chan struct{}, 1)
	exe, err := os.Executable()
	if err != nil {
		log.Warn("cannot watch own executable", "err", err)
		return changed
	}
	stamp := func() (string, error) {
		var st unix.Stat_t
		if err := unix.Stat(exe, &st); err != nil {
			return "", &os.PathError{Op: "stat", Path: exe, Err: err}
		}
		return fmt.Sprint(st.Dev, st.Ino, st.Size, st.Mtim.Nano()), nil
	}
	first, err := stamp()
	if err != nil {
		log.Warn("cannot watch own executable", "err", err)
		return changed
	}
	owner.Add(1)
	go func() {
		defer owner.Done()
		last := first
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			now, err := stamp()
			if err != nil || now == first {
				last = now
				continue
			}
			if now == last { // unchanged for one period: the new file is complete
				log.Info("executable replaced on disk", "exe", exe)
				select {
				case changed <- struct{}{}:
				default:
				}
				first = now
			}
			last = now
		}
	}()
	return changed
}

// restartRequests delivers a reason whenever the process should re-execute
// itself: SIGHUP, or (when asked) a replaced executable. Its goroutines end
// with ctx or stop, which waits for them.
func restartRequests(ctx context.Context, onBinaryChange bool, every time.Duration, log *slog.Logger) (requests <-chan string, stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	var owned sync.WaitGroup
	out := make(chan string, 1)
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, unix.SIGHUP)
	var replaced <-chan struct{}
	if onBinaryChange {
		replaced = binaryWatcher(ctx, every, log, &owned)
	}
	owned.Add(1)
	go func() {
		defer owned.Done()
		defer signal.Stop(hup)
		for {
			var why string
			select {
			case <-ctx.Done():
				return
			case <-hup:
				why = "SIGHUP"
			case <-replaced:
				why = "executable replaced"
			}
			select {
			case out <- why:
			default: // a restart is already pending
			}
		}
	}()
	return out, func() { cancel(); owned.Wait() }
}
