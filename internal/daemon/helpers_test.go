package daemon

// Helpers shared by the tests of package daemon.

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/testnet"
	"golang.org/x/sys/unix"
)

// TestMain starts os/signal's watcher, which lives as long as the process,
// before any test counts its goroutines.
func TestMain(m *testing.M) {
	c := make(chan os.Signal, 1)
	signal.Notify(c, unix.SIGWINCH)
	signal.Stop(c)
	os.Exit(m.Run())
}

func checkNoLeaks(t *testing.T) { testnet.CheckNoLeaks(t) }

// httpStatus GETs url on a connection of its own, closed after the answer.
func httpStatus(url string) int {
	c := http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

//go:noinline
func growStack(depth int) byte {
	var pad [480]byte
	pad[depth%len(pad)] = byte(depth)
	if depth == 0 {
		return pad[0]
	}
	return growStack(depth-1) + pad[1]
}

// startTrimmer runs a trimmer for the rest of the test and checks at the
// end that it stops with its context. Its first sample is taken before
// startTrimmer returns.
func startTrimmer(t *testing.T, interval time.Duration) {
	ctx, cancel := context.WithCancel(context.Background())
	tr := newTrimmer(slog.New(slog.DiscardHandler))
	done := make(chan struct{})
	go func() {
		defer close(done)
		tr.run(ctx, interval)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Error("trimMemory did not end with its context")
		}
	})
}

// fakeWork records which of its parts the daemon called. Run calls them
// on its own goroutine while the test reads the counters: they are atomic,
// and shutdownCause is read only after Run has returned.
type fakeWork struct {
	done                      chan error
	shutdowns, drains, exits  atomic.Int32
	shutdownEnded             atomic.Bool
	shutdownCause, shutdownOK error
	onDrain                   func()
}

func newFakeWork() *fakeWork { return &fakeWork{done: make(chan error, 1)} }

func (f *fakeWork) work() Work {
	return Work{
		Done: f.done,
		Shutdown: func(ended bool, cause error) error {
			f.shutdowns.Add(1)
			f.shutdownEnded.Store(ended)
			f.shutdownCause = cause
			return f.shutdownOK
		},
		Drain: func(string) []Handed {
			f.drains.Add(1)
			if f.onDrain != nil {
				f.onDrain()
			}
			return nil
		},
		Exited:      func() { f.exits.Add(1) },
		MemoryReady: func() bool { return true },
	}
}

// runDaemonFor runs a daemon whose exec fails with errExecRefused, so that
// a test can never replace the test binary.
func runDaemonFor(t *testing.T, ctx context.Context, w Work) <-chan error {
	t.Helper()
	d := New(slog.New(slog.DiscardHandler))
	d.exec = func(string, []string, *slog.Logger) error { return errExecRefused }
	t.Cleanup(d.Close)
	out := make(chan error, 1)
	go func() { out <- d.Run(ctx, w) }()
	return out
}

var errExecRefused = errors.New("exec refused by the test")

func waitRun(t *testing.T, out <-chan error) error {
	t.Helper()
	select {
	case err := <-out:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("Daemon.Run did not return within 10s")
		return nil
	}
}

// sendHUPUntil sends this process SIGHUP until drained is closed: the
// daemon subscribes to SIGHUP only once Run has started. The caller keeps a
// channel notified of SIGHUP, so that none kills the test binary.
func sendHUPUntil(t *testing.T, drained <-chan struct{}) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		if err := unix.Kill(os.Getpid(), unix.SIGHUP); err != nil {
			t.Fatal(err)
		}
		select {
		case <-drained:
			return
		case <-time.After(50 * time.Millisecond):
		case <-deadline:
			t.Fatal("no drain within 10s of SIGHUP")
		}
	}
}
