package daemon

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"testing"

	"github.com/spinifex/konnectivity/internal/promtext"
	"golang.org/x/sys/unix"
)

// TestDaemonStopSignalShutsDown: a stop signal (ctx) shuts the command
// down once, not as ended on its own, and runs its exit clean-up.
func TestDaemonStopSignalShutsDown(t *testing.T) {
	checkNoLeaks(t)
	f := newFakeWork()
	f.shutdownOK = errors.New("from shutdown")
	ctx, cancel := context.WithCancel(context.Background())
	out := runDaemonFor(t, ctx, f.work())
	cancel()
	if err := waitRun(t, out); err != f.shutdownOK {
		t.Errorf("Run returned %v, want shutdown's error", err)
	}
	if f.shutdowns.Load() != 1 || f.shutdownEnded.Load() || f.exits.Load() != 1 || f.drains.Load() != 0 {
		t.Errorf("shutdowns %d (ended %v), exits %d, drains %d; want 1 (false), 1, 0",
			f.shutdowns.Load(), f.shutdownEnded.Load(), f.exits.Load(), f.drains.Load())
	}
}

// TestDaemonCommandEndedShutsDown: a command that stops serving on its own
// is shut down with the cause it reported.
func TestDaemonCommandEndedShutsDown(t *testing.T) {
	checkNoLeaks(t)
	f := newFakeWork()
	cause := errors.New("accept loop failed")
	out := runDaemonFor(t, context.Background(), f.work())
	f.done <- cause
	waitRun(t, out)
	if f.shutdowns.Load() != 1 || !f.shutdownEnded.Load() || f.shutdownCause != cause || f.exits.Load() != 1 {
		t.Errorf("shutdowns %d, ended %v, cause %v, exits %d; want 1, true, %v, 1",
			f.shutdowns.Load(), f.shutdownEnded.Load(), f.shutdownCause, f.exits.Load(), cause)
	}
}

// TestDaemonStopDuringRestartDrainExits: a SIGHUP drains the command for a
// restart; a stop signal that comes during the drain ends the process
// (exit clean-up, no exec, no second shutdown) instead of re-executing.
func TestDaemonStopDuringRestartDrainExits(t *testing.T) {
	checkNoLeaks(t)
	// While any channel is notified, SIGHUP does not kill the test binary,
	// whether or not the daemon has subscribed yet.
	hup := make(chan os.Signal, 8)
	signal.Notify(hup, unix.SIGHUP)
	defer signal.Stop(hup)

	f := newFakeWork()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	drained := make(chan struct{})
	f.onDrain = func() { cancel(); close(drained) }
	out := runDaemonFor(t, ctx, f.work())
	sendHUPUntil(t, drained)
	if err := waitRun(t, out); err != nil {
		t.Errorf("Run returned %v, want nil (stopped as asked)", err)
	}
	if f.drains.Load() != 1 || f.exits.Load() != 1 || f.shutdowns.Load() != 0 {
		t.Errorf("drains %d, exits %d, shutdowns %d; want 1, 1, 0", f.drains.Load(), f.exits.Load(), f.shutdowns.Load())
	}
}

// TestDaemonRestartExecs: a SIGHUP drains the command, stops the services
// and re-executes; neither shutdown nor the exit clean-up runs.
func TestDaemonRestartExecs(t *testing.T) {
	checkNoLeaks(t)
	hup := make(chan os.Signal, 8)
	signal.Notify(hup, unix.SIGHUP)
	defer signal.Stop(hup)

	f := newFakeWork()
	drained := make(chan struct{})
	f.onDrain = func() { close(drained) }
	out := runDaemonFor(t, context.Background(), f.work())
	sendHUPUntil(t, drained)
	if err := waitRun(t, out); err != errExecRefused {
		t.Errorf("Run returned %v, want the exec's error", err)
	}
	if f.drains.Load() != 1 || f.exits.Load() != 0 || f.shutdowns.Load() != 0 {
		t.Errorf("drains %d, exits %d, shutdowns %d; want 1, 0, 0", f.drains.Load(), f.exits.Load(), f.shutdowns.Load())
	}
}

// TestDaemonServices: the health port serves health and /metrics only, the
// admin port adds /debug/tunnels; Close stops both.
func TestDaemonServices(t *testing.T) {
	checkNoLeaks(t)
	d := New(slog.New(slog.DiscardHandler))
	defer d.Close()
	ok := func() (bool, string) { return true, "fine" }
	if err := d.StartServices(Services{
		HealthAddr: "127.0.0.1:0",
		AdminAddr:  "127.0.0.1:0",
		Ready:      []Check{{"x", ok}},
		Metrics:    promtext.NewRegistry(),
		Status:     func() any { return map[string]int{"agents": 0} },
	}); err != nil {
		t.Fatal(err)
	}
	if len(d.services) != 2 {
		t.Fatalf("%d services started, want 2", len(d.services))
	}
	health, admin := "http://"+d.services[0].ln.Addr().String(), "http://"+d.services[1].ln.Addr().String()
	for _, c := range []struct {
		url  string
		want int
	}{
		{health + "/readyz", http.StatusOK},
		{health + "/metrics", http.StatusOK},
		{health + "/debug/tunnels", http.StatusNotFound},
		{health + "/debug/pprof/", http.StatusNotFound},
		{admin + "/readyz", http.StatusOK},
		{admin + "/debug/tunnels", http.StatusOK},
		{admin + "/debug/pprof/", http.StatusNotFound}, // profiling off
	} {
		if got := httpStatus(c.url); got != c.want {
			t.Errorf("GET %s: %d, want %d", c.url, got, c.want)
		}
	}
	addr := d.services[0].ln.Addr().String()
	d.Close()
	if c, err := net.Dial("tcp", addr); err == nil {
		c.Close()
		t.Errorf("health port %s still accepts after Close", addr)
	}
}
