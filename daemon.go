package main

import (
	"context"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"time"

	"github.com/spinifex/konnectivity/tunnel/promtext"
	"golang.org/x/sys/unix"
)

// daemon is the skeleton the long-running commands (server and agent)
// share: listeners kept across a self-restart, the health and admin
// services, memory upkeep, and the loop that ends either in a graceful stop
// or in a re-execution in place. The command owns what it serves; the
// daemon owns when it stops.
//
// A daemon is used by the one goroutine that runs the command.
type daemon struct {
	log       *slog.Logger
	listeners *listenerSet
	services  []*httpService
	exec      func(exe string, env []string, log *slog.Logger) error // execSelf; tests replace it
}

// newDaemon adopts the listeners a previous image of this process handed
// over, if any; listen takes them by name.
func newDaemon(log *slog.Logger) *daemon {
	return &daemon{log: log, listeners: newListenerSet(log), exec: execSelf}
}

// listen returns the listener called name: the inherited one when it is
// bound to addr, else a new one from create. Listeners keep their socket
// (path and inode) and port across a self-restart.
func (d *daemon) listen(name, network, addr string, create func() (net.Listener, error)) (net.Listener, error) {
	return d.listeners.listen(name, network, addr, create)
}

// listenTCP is listen with a plain TCP listener on addr.
func (d *daemon) listenTCP(name, addr string) (net.Listener, error) {
	return d.listen(name, "tcp", addr, func() (net.Listener, error) { return net.Listen("tcp", addr) })
}

// serviceOptions configure the health and admin services. An empty
// address turns a service off.
type serviceOptions struct {
	healthAddr, adminAddr string
	ready                 []check
	readyAll              []check // the /readyz?all view; nil serves ready there
	metrics               *promtext.Registry
	status                func() any // /debug/tunnels on the admin port
	profiling             bool       // /debug/pprof on the admin port
}

// startServices starts the health and admin services; Close stops them.
func (d *daemon) startServices(o serviceOptions) error {
	health := serviceMux(o.ready, o.readyAll, o.metrics)
	if o.healthAddr != "" {
		s, err := startHTTP("health", d.listeners, o.healthAddr, health, d.log)
		if err != nil {
			return err
		}
		d.services = append(d.services, s)
	}
	if o.adminAddr != "" {
		admin := adminMux(serviceMux(o.ready, o.readyAll, o.metrics), o.status, o.profiling)
		s, err := startHTTP("admin", d.listeners, o.adminAddr, admin, d.log)
		if err != nil {
			return err
		}
		d.services = append(d.services, s)
	}
	return nil
}

// Close stops the health and admin services and closes every listener the
// daemon opened; closing one the command already closed is harmless.
func (d *daemon) Close() {
	d.stopServices()
	for _, nl := range d.listeners.open {
		nl.ln.Close()
	}
}

func (d *daemon) stopServices() {
	for _, s := range d.services {
		s.stop()
	}
	d.services = nil
}

// work is what a command runs under the daemon.
type work struct {
	// done reports that the command stopped serving on its own.
	done <-chan error
	// shutdown stops the command gracefully after a stop signal, or after
	// done reported cause (ended), and returns the command's error.
	shutdown func(ended bool, cause error) error
	// drain stops the command before a restart, within its restart grace,
	// and releases what the next image must not find held. It returns
	// environment entries that hand the next image what it keeps (the
	// server's paused tunnels), if any.
	drain func(trigger string) (env []string)
	// exited, if set, removes what an exit (not a restart) must not leave
	// behind; it runs after shutdown, and after a drain that a stop signal
	// interrupted.
	exited func()
	// memoryReady tells when the command has settled, so that the pages
	// its start-up touched can go (releaseWhenReady).
	memoryReady func() bool

	restartOnBinaryChange bool
	restartCheckInterval  time.Duration
}

// Run serves until ctx ends (SIGTERM, SIGINT) or the command stops on its
// own, then shuts it down gracefully. On a restart request (SIGHUP or a
// replaced executable) it hands the listeners over, drains the command and
// re-executes the binary in place; a stop signal during that drain ends
// the process instead, since a new image would never see it. Run returns
// only when the process exits or an exec failed.
func (d *daemon) Run(ctx context.Context, w work) error {
	d.listeners.closeUnused()
	stopMemory := startMemoryUpkeep(ctx, w.memoryReady, d.log)
	defer stopMemory()

	restart := restartRequests(ctx, w.restartOnBinaryChange, w.restartCheckInterval, d.log)
	for {
		var (
			ended bool
			cause error
		)
		select {
		case <-ctx.Done():
		case cause = <-w.done:
			ended = true
		case trigger := <-restart:
			exe, env, ok := d.listeners.prepareRestart(trigger)
			if !ok {
				continue
			}
			kept := w.drain(trigger)
			d.stopServices()
			if ctx.Err() != nil {
				d.log.Info("stop requested while draining for a restart: exiting instead of re-executing")
				d.exited(w)
				return nil
			}
			// Only a failed exec returns; the supervisor's respawn takes over.
			return d.exec(exe, append([]string{env}, kept...), d.log)
		}
		err := w.shutdown(ended, cause)
		d.exited(w)
		return err
	}
}

func (d *daemon) exited(w work) {
	if w.exited != nil {
		w.exited()
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

// signalContext is cancelled by the first SIGTERM or SIGINT; a second one
// exits the process at once.
func signalContext(log *slog.Logger) (context.Context, func()) {
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan os.Signal, 2)
	signal.Notify(ch, unix.SIGTERM, unix.SIGINT)
	done := make(chan struct{})
	go func() {
		select {
		case sig := <-ch:
			log.Info("signal received: shutting down gracefully (send again to exit at once)", "signal", sig.String())
			cancel()
		case <-done:
			return
		}
		select {
		case sig := <-ch:
			log.Warn("second signal: exiting now", "signal", sig.String())
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
