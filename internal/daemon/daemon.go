package daemon

import (
	"context"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"runtime"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
	"golang.org/x/sys/unix"
)

// Daemon is the skeleton the long-running commands (server and agent)
// share: listeners handed across a self-restart, the health and admin
// services, memory upkeep, and the loop that ends either in a graceful stop
// or in a re-execution in place. The command owns what it serves; the
// daemon owns when it stops.
//
// A Daemon is owned by the one goroutine that runs the command: none of
// its fields is shared, so none has a lock. The goroutines it starts (the
// services' serve loops, memory upkeep, the signal and restart watchers)
// end in Close or when Run returns.
type Daemon struct {
	log       *slog.Logger
	listeners *listenerSet
	services  []*httpService
	exec      func(exe string, env []string, log *slog.Logger) error // execSelf; tests replace it
	refused   map[string]*promtext.Counter                           // restarts refused, by reason (countRefusals); nil: not counted
}

// New adopts the listeners a previous image of this process handed over,
// if any; Listen takes them by name.
func New(log *slog.Logger) *Daemon {
	return &Daemon{log: log, listeners: newListenerSet(log), exec: execSelf}
}

// Listen returns the listener called name: the inherited one when it is
// bound to addr, else a new one from create. Listeners keep their socket
// (path and inode) and port across a self-restart.
func (d *Daemon) Listen(name, network, addr string, create func() (net.Listener, error)) (net.Listener, error) {
	return d.listeners.listen(name, network, addr, create)
}

// ListenTCP is Listen with a plain TCP listener on addr.
func (d *Daemon) ListenTCP(name, addr string) (net.Listener, error) {
	return d.Listen(name, "tcp", addr, func() (net.Listener, error) { return net.Listen("tcp", addr) })
}

// Services configure the health and admin services. An empty address
// turns a service off.
type Services struct {
	HealthAddr, AdminAddr string
	Ready                 []Check
	ReadyAll              []Check // the /readyz?all view; nil serves Ready there
	Metrics               *promtext.Registry
	Status                func() any // /debug/tunnels on the admin port
	Profiling             bool       // /debug/pprof on the admin port
}

// StartServices starts the health and admin services; Close stops them.
func (d *Daemon) StartServices(o Services) error {
	health := serviceMux(o.Ready, o.ReadyAll, o.Metrics)
	if o.HealthAddr != "" {
		s, err := startHTTP("health", d.listeners, o.HealthAddr, health, d.log)
		if err != nil {
			return err
		}
		d.services = append(d.services, s)
	}
	if o.AdminAddr != "" {
		admin := adminMux(serviceMux(o.Ready, o.ReadyAll, o.Metrics), o.Status, o.Profiling)
		s, err := startHTTP("admin", d.listeners, o.AdminAddr, admin, d.log)
		if err != nil {
			return err
		}
		d.services = append(d.services, s)
	}
	return nil
}

// Close stops the health and admin services and closes every listener the
// daemon opened; closing one the command already closed is harmless.
func (d *Daemon) Close() {
	d.stopServices()
	for _, nl := range d.listeners.open {
		nl.ln.Close()
	}
}

func (d *Daemon) stopServices() {
	for _, s := range d.services {
		s.stop()
	}
	d.services = nil
}

// Work is what a command runs under the daemon. Run calls its functions
// from the goroutine that called Run, one at a time.
type Work struct {
	// Done reports that the command stopped serving on its own.
	Done <-chan error
	// Shutdown stops the command gracefully after a stop signal, or after
	// Done reported cause (ended), and returns the command's error.
	Shutdown func(ended bool, cause error) error
	// Drain stops the command before a restart, within its restart grace,
	// and releases what the next image must not find in use. It returns
	// the sockets it hands the next image (the server's paused tunnels, the
	// agent's kept destinations: Hand), if any; the next image reads them
	// with Inherit.
	Drain func(trigger string) []Handed
	// State, if set, is called after Drain: what the command hands the
	// next image besides sockets, by name, each written as JSON; the next
	// image reads it with InheritedState.
	State func() map[string]any
	// Exited, if set, removes what must not outlast an exit (not a
	// restart); it runs after Shutdown, and after a drain that a stop signal
	// interrupted.
	Exited func()
	// MemoryReady tells when the command has settled, so that the pages
	// its start-up touched can go (releaseWhenReady).
	MemoryReady func() bool

	// RestartOnBinaryChange restarts when the executable on disk is
	// replaced, looked at every RestartCheckInterval; SIGHUP always does.
	RestartOnBinaryChange bool
	RestartCheckInterval  time.Duration

	// Check is the command line (after the program name) of the command's
	// configuration check; a restart runs it with the executable the
	// restart would run, and is refused when it fails. Nil: no check.
	Check []string
	// Metrics, when set, counts refused restarts as
	// MetricPrefix+"restarts_refused_total".
	Metrics      *promtext.Registry
	MetricPrefix string
}

// Run serves until ctx ends (SIGTERM, SIGINT) or the command stops on its
// own, then shuts it down gracefully. On a restart request (SIGHUP or a
// replaced executable) it hands the listeners over, drains the command and
// re-executes the binary in place; a stop signal during that drain ends
// the process instead, since a new image would never see it. Run returns
// only when the process exits or an exec failed.
func (d *Daemon) Run(ctx context.Context, w Work) error {
	d.listeners.closeUnused()
	d.countRefusals(w)
	d.countDroppedLines(w)
	stopMemory := startMemoryUpkeep(ctx, w.MemoryReady, d.log)
	defer stopMemory()

	restart, stopWatching := restartRequests(ctx, w.RestartOnBinaryChange, w.RestartCheckInterval, d.log)
	defer stopWatching()
	for {
		var (
			ended bool
			cause error
		)
		select {
		case <-ctx.Done():
		case cause = <-w.Done:
			ended = true
		case trigger := <-restart:
			plan, ok := d.prepareRestart(trigger, w)
			if !ok {
				continue
			}
			handed := w.Drain(trigger)
			d.stopServices()
			if ctx.Err() != nil {
				d.log.Info("stop requested while draining for a restart: exiting instead of re-executing")
				plan.files.discard()
				d.exited(w)
				return nil
			}
			var state map[string]any
			if w.State != nil {
				state = w.State()
			}
			env := append([]string{plan.listeners}, plan.files.write(handed, state, d.log)...)
			// Only a failed exec returns; the supervisor's respawn takes over.
			err := d.exec(plan.exe, env, d.log)
			runtime.KeepAlive(handed) // their descriptors are what the exec keeps
			return err
		}
		err := w.Shutdown(ended, cause)
		d.exited(w)
		return err
	}
}

func (d *Daemon) exited(w Work) {
	if w.Exited != nil {
		w.Exited()
	}
	d.log.Info("stopped")
}

// startMemoryUpkeep releases the start-up pages now and again once ready
// reports true, and trims the heap while ctx lasts; stop waits for both.
func startMemoryUpkeep(ctx context.Context, ready func() bool, log *slog.Logger) (stop func()) {
	releaseStartupPages(log)
	ctx, cancel := context.WithCancel(ctx)
	pagesDone, trimDone := make(chan struct{}), make(chan struct{})
	go func() { defer close(pagesDone); releaseWhenReady(ctx, ready, log) }()
	go func() { defer close(trimDone); trimMemory(ctx, trimInterval, log) }()
	return func() { cancel(); <-pagesDone; <-trimDone }
}

// SignalContext is cancelled by the first SIGTERM or SIGINT; a second one
// exits the process at once (after at most a second for the log's queued
// lines). A signal acts before its log line: the log may be slow. The
// watching goroutine ends when stop is called.
func SignalContext(log *slog.Logger) (context.Context, func()) {
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan os.Signal, 2)
	signal.Notify(ch, unix.SIGTERM, unix.SIGINT)
	done := make(chan struct{})
	go func() {
		select {
		case sig := <-ch:
			cancel()
			log.Info("signal received: shutting down gracefully (send again to exit at once)", "signal", sig.String())
		case <-done:
			return
		}
		select {
		case sig := <-ch:
			log.Warn("second signal: exiting now", "signal", sig.String())
			flushLog(log)
			os.Exit(1)
		case <-done:
		}
	}()
	return ctx, func() {
		signal.Stop(ch)
		close(done)
		cancel()
	}
}
