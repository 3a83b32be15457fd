package daemon

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// logPipe is a pipe of one page, blocking on the logger's side as a
// supervisor's is; the test reads its other end when it chooses.
type logPipe struct {
	w *os.File // the logger's end
	r *os.File // the test's end (pollable: a read can be stopped)

	mu  sync.Mutex
	got bytes.Buffer // guarded by mu: what the test read
}

func newLogPipe(t *testing.T) *logPipe {
	t.Helper()
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(fds[1]), unix.F_SETPIPE_SZ, 4096); err != nil {
		t.Fatal(err)
	}
	if err := unix.SetNonblock(fds[0], true); err != nil {
		t.Fatal(err)
	}
	p := &logPipe{r: os.NewFile(uintptr(fds[0]), "read end"), w: os.NewFile(uintptr(fds[1]), "write end")}
	t.Cleanup(func() { p.r.Close(); p.w.Close() })
	return p
}

// read reads the pipe until its read end is closed; stop waits for that.
func (p *logPipe) read() (stop func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 64<<10)
		for {
			n, err := p.r.Read(buf)
			p.mu.Lock()
			p.got.Write(buf[:n])
			p.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	return func() { p.r.Close(); <-done }
}

func (p *logPipe) String() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.got.String()
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not within 10 s: %s", what)
		}
	}
}

// logLines logs n lines on log from a goroutine and fails the test unless
// every call returned within 5 s: a log call never waits for the reader.
func logLines(t *testing.T, log *slog.Logger, from, n int) {
	t.Helper()
	done := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(done)
		for i := from; i < from+n; i++ {
			log.Info("a line", "n", i, "pad", strings.Repeat("x", 64))
		}
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatalf("%d log calls did not return within 5 s (after %v): a log call waits for the reader", n, time.Since(start))
	}
}

// TestLogQueueReaderStops: with nobody reading standard error (a pipe),
// log calls return at once; the lines past the queue's bound are dropped
// and counted; once the pipe is read again every line kept comes out in
// order, then one line with the count dropped. A reader that goes away
// costs the lines written after (counted), not the process, and the
// writer ends on close.
func TestLogQueueReaderStops(t *testing.T) {
	checkNoLeaks(t)
	p := newLogPipe(t)
	log, err := NewLogger(LogSettings{Format: "text", ToStderr: true, LegacyThreshold: true}, p.w, func(string, ...any) {})
	if err != nil {
		t.Fatal(err)
	}
	q := logQueueOf(log)
	if q == nil {
		t.Fatal("a logger to a descriptor has no queue")
	}
	defer CloseLog(log)

	const n = 20000 // about 2.5 MiB of lines, the queue holds 1 MiB
	logLines(t, log, 0, n)
	dropped := q.dropped.Load()
	if dropped == 0 || dropped >= n {
		t.Fatalf("%d lines logged with nobody reading: %d dropped, want some and not all", n, dropped)
	}

	stop := p.read()
	report := regexp.MustCompile(`msg="log lines dropped[^"]*" dropped=(\d+)`)
	var m []string
	waitUntil(t, "the line with the count dropped", func() bool { m = report.FindStringSubmatch(p.String()); return m != nil })
	if got, _ := strconv.ParseUint(m[1], 10, 64); got != dropped {
		t.Errorf("the report says %d dropped; %d were", got, dropped)
	}
	var seen []int
	for line := range strings.Lines(p.String()) {
		if i := strings.Index(line, " n="); i >= 0 && strings.Contains(line, `msg="a line"`) {
			v, _ := strconv.Atoi(strings.Fields(line[i+3:])[0])
			seen = append(seen, v)
		}
	}
	if len(seen) != n-int(dropped) {
		t.Errorf("%d lines came out, want the %d kept", len(seen), n-int(dropped))
	}
	for i := 1; i < len(seen); i++ {
		if seen[i] <= seen[i-1] {
			t.Fatalf("line %d came out after line %d", seen[i], seen[i-1])
		}
	}
	if !strings.HasSuffix(strings.TrimSpace(p.String()), m[0]) {
		t.Errorf("the report is not the last line out")
	}
	t.Logf("%d lines logged, nobody reading a one-page pipe: %d dropped, %d written in order once read, then %q", n, dropped, len(seen), m[0])

	stop() // the reader goes away
	before := q.dropped.Load()
	logLines(t, log, n, 10)
	waitUntil(t, "the lines the reader left dropped", func() bool { return q.dropped.Load() == before+10 })
}

// TestLogQueueCloseGivesUp: close writes out what it can within its
// bound and ends the writer even when the reader never reads again.
func TestLogQueueCloseGivesUp(t *testing.T) {
	checkNoLeaks(t)
	p := newLogPipe(t)
	log, err := NewLogger(LogSettings{Format: "json", ToStderr: true, LegacyThreshold: true}, p.w, func(string, ...any) {})
	if err != nil {
		t.Fatal(err)
	}
	logLines(t, log, 0, 1000)
	start := time.Now()
	CloseLog(log)
	took := time.Since(start)
	if took > logFlushBound+5*logPollSlice {
		t.Errorf("close took %v with nobody reading, want about %v", took, logFlushBound)
	}
	select {
	case <-logQueueOf(log).done:
	default:
		t.Fatal("the writer still runs after close")
	}
	logLines(t, log, 1000, 1) // dropped, not written
}

// TestLogQueueHandsOnDropped: what a restart in place drops (lines not
// reported, lines still queued) is said by the next image, once its
// standard error takes its lines.
func TestLogQueueHandsOnDropped(t *testing.T) {
	checkNoLeaks(t)
	p := newLogPipe(t)
	log, err := NewLogger(LogSettings{Format: "text", ToStderr: true, LegacyThreshold: true}, p.w, func(string, ...any) {})
	if err != nil {
		t.Fatal(err)
	}
	logLines(t, log, 0, 20000)
	q := logQueueOf(log)
	kv := q.handOn()
	q.mu.Lock()
	want := q.unreported + uint64(len(q.lines))
	q.mu.Unlock()
	name, value, _ := strings.Cut(kv, "=")
	if name != logDroppedEnv || value != strconv.FormatUint(want, 10) {
		t.Fatalf("hand-on %q, want %s=%d", kv, logDroppedEnv, want)
	}
	CloseLog(log)

	t.Setenv(logDroppedEnv, value)
	next := newLogPipe(t)
	stop := next.read()
	defer stop()
	log, err = NewLogger(LogSettings{Format: "text", ToStderr: true, LegacyThreshold: true}, next.w, func(string, ...any) {})
	if err != nil {
		t.Fatal(err)
	}
	defer CloseLog(log)
	if _, set := os.LookupEnv(logDroppedEnv); set {
		t.Error("the count stays in the environment, for a child to see")
	}
	log.Info("the next image starts")
	line := fmt.Sprintf(" dropped=%d\n", want)
	waitUntil(t, "the next image's line with the count", func() bool { return strings.Contains(next.String(), line) })
}

var _ io.Writer = (*logQueue)(nil)
