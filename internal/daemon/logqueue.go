package daemon

import (
	"errors"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// A daemon's standard error is usually a pipe that a supervisor or a
// container runtime reads, and a reader can stop reading (hung) or go
// away. Logging must cost the process neither: a log call never waits for
// the reader, and a reader gone never ends the process. So the lines bound
// for a descriptor (stderr) go through a logQueue:
//   - a log call copies its line into a bounded queue and returns; a line
//     that finds the queue full (logQueueBytes) is dropped and counted
//     (…_log_lines_dropped_total);
//   - one goroutine writes the queue out, each write only once the
//     descriptor can take it (writeFD), so a reader that stopped stalls
//     that goroutine alone, which can still be stopped;
//   - a write the reader is gone for (EPIPE) drops its line: Go raises
//     SIGPIPE, and ends the process, only for its own writes to
//     descriptors 1 and 2 through os.File, which the queue does not use,
//     and NewLogger ignores SIGPIPE for any other;
//   - once the reader took everything queued again, one line says how many
//     were dropped since the last such line; a restart in place hands the
//     count on (logDroppedEnv) to the next image, which says it.
//
// The queue also keeps the order of lines: it has one writer.

const (
	// logQueueBytes bounds the lines waiting for the reader: room for a
	// burst such as a fleet's logins after a restart (about 3,000 login
	// lines).
	logQueueBytes = 1 << 20
	// logFlushBound is how long an exit or a restart waits for the queued
	// lines to be written before it goes on without them.
	logFlushBound = time.Second
	// logPollSlice is how often a write the descriptor cannot take looks
	// whether it should give up.
	logPollSlice = 100 * time.Millisecond
	// pipeBuf is what a pipe takes in one write once poll says it has
	// room (a page, PIPE_BUF on Linux): a longer line goes in pieces.
	pipeBuf = 4096
)

// logDroppedEnv carries the lines dropped and not yet reported across a
// restart in place.
const logDroppedEnv = "KONNECTIVITY_LOG_LINES_DROPPED"

// errLogStopped is a write given up because the queue closed.
var errLogStopped = errors.New("log writer stopped")

// logQueue is the writer of one descriptor's log lines (see above). Write
// is called by the slog handler under its lock, the queue's goroutine
// (run) owns the descriptor's writes; close ends that goroutine.
//
// Lock: mu is a leaf; the handler's lock is taken before it (Write), never
// under it.
type logQueue struct {
	fd      syscall.RawConn // the descriptor, written by run only
	reports *slog.Logger    // says how many lines were dropped; set before run starts

	mu         sync.Mutex
	lines      [][]byte      // guarded by mu: queued, oldest first
	size       int           // guarded by mu: the bytes in lines
	writing    bool          // guarded by mu: run holds lines taken from the queue
	unreported uint64        // guarded by mu: dropped since the last report
	emptied    chan struct{} // guarded by mu: closed once the queue is written out (flush)
	closed     bool          // guarded by mu

	dropped atomic.Uint64 // every line this image dropped, for the metric
	wake    chan struct{} // capacity 1: lines queued, or the queue closed
	stop    chan struct{} // closed by close: a write that cannot proceed gives up
	done    chan struct{} // closed when run returns
}

// newLogQueue makes the queue of f's log lines, with the count of lines
// a previous image of the process dropped and did not report; start runs
// its writer, close ends it.
func newLogQueue(f *os.File) (*logQueue, error) {
	fd, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	q := &logQueue{fd: fd, wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	if n, err := strconv.ParseUint(os.Getenv(logDroppedEnv), 10, 64); err == nil {
		q.unreported = n
	}
	os.Unsetenv(logDroppedEnv)
	return q, nil
}

// start runs the writer; reports is the logger the queue belongs to.
func (q *logQueue) start(reports *slog.Logger) {
	q.reports = reports
	go q.run()
}

// Write queues one line, or drops and counts it when the queue is full.
// It never waits for the descriptor.
func (q *logQueue) Write(p []byte) (int, error) {
	q.mu.Lock()
	if q.closed || q.size+len(p) > logQueueBytes {
		q.unreported++
		q.mu.Unlock()
		q.dropped.Add(1)
		return len(p), nil
	}
	q.lines = append(q.lines, append([]byte(nil), p...))
	q.size += len(p)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
	return len(p), nil
}

// run writes the queued lines out, oldest first, until the queue is
// closed and written out (or given up).
func (q *logQueue) run() {
	defer close(q.done)
	wrote := false // the last write went through
	for {
		q.mu.Lock()
		batch := q.lines
		q.lines, q.size = nil, 0
		q.writing = len(batch) > 0
		var report uint64
		if len(batch) == 0 {
			if q.emptied != nil {
				close(q.emptied)
				q.emptied = nil
			}
			if q.closed {
				q.mu.Unlock()
				return
			}
			if wrote && q.unreported > 0 {
				report, q.unreported = q.unreported, 0
			}
		}
		q.mu.Unlock()
		if report > 0 {
			// Queued like any line: the reader took all before it.
			q.reports.Warn("log lines dropped: standard error did not take them (its reader stopped reading or went away)", "dropped", report)
			continue
		}
		if len(batch) == 0 {
			<-q.wake
			continue
		}
		for _, line := range batch {
			wrote = q.writeLine(line) == nil
			if !wrote {
				q.mu.Lock()
				q.unreported++
				q.mu.Unlock()
				q.dropped.Add(1)
			}
		}
	}
}

// writeLine writes one line to the descriptor.
func (q *logQueue) writeLine(p []byte) error {
	var werr error
	if err := q.fd.Write(func(fd uintptr) bool {
		werr = writeFD(int(fd), p, q.stop)
		return true
	}); err != nil {
		return err
	}
	return werr
}

// writeFD writes p to fd a pipe's page at a time, each once poll says fd
// has room for it, so that the write never blocks in the kernel; it gives
// up when stop is closed. A descriptor whose reader is gone polls ready
// and fails the write with EPIPE.
func writeFD(fd int, p []byte, stop <-chan struct{}) error {
	pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
	for len(p) > 0 {
		wait := int(logPollSlice / time.Millisecond)
		select {
		case <-stop:
			wait = 0 // stopped: only what fd takes at once
		default:
		}
		n, err := unix.Poll(pfd, wait)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			if wait == 0 {
				return errLogStopped
			}
			continue
		}
		w, err := unix.Write(fd, p[:min(len(p), pipeBuf)])
		if err == unix.EINTR || err == unix.EAGAIN {
			continue
		}
		if err != nil {
			return err
		}
		p = p[w:]
	}
	return nil
}

// flush waits until every queued line is written, or bound passes.
func (q *logQueue) flush(bound time.Duration) {
	q.mu.Lock()
	if len(q.lines) == 0 && !q.writing || q.closed {
		q.mu.Unlock()
		return
	}
	if q.emptied == nil {
		q.emptied = make(chan struct{})
	}
	emptied := q.emptied
	q.mu.Unlock()
	t := time.NewTimer(bound)
	defer t.Stop()
	select {
	case <-emptied:
	case <-t.C:
	}
}

// close flushes within logFlushBound, then ends the writer: a write the
// descriptor still cannot take is given up, and lines logged later are
// dropped.
func (q *logQueue) close() {
	q.flush(logFlushBound)
	q.mu.Lock()
	closed := q.closed
	q.closed = true
	q.mu.Unlock()
	if closed {
		return
	}
	close(q.stop)
	select {
	case q.wake <- struct{}{}:
	default:
	}
	<-q.done
}

// handOn is the environment entry that tells the next image how many
// lines it should report dropped: those not reported, and those still
// queued, which the exec drops.
func (q *logQueue) handOn() string {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := q.unreported + uint64(len(q.lines))
	if n == 0 {
		return ""
	}
	return logDroppedEnv + "=" + strconv.FormatUint(n, 10)
}

// queuedHandler is the process's slog handler when its lines go through
// a logQueue: the handler that formats them, and the queue, which the
// daemon flushes before it exits or restarts (logQueueOf).
type queuedHandler struct {
	slog.Handler
	q *logQueue
}

func (h queuedHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return queuedHandler{h.Handler.WithAttrs(attrs), h.q}
}

func (h queuedHandler) WithGroup(name string) slog.Handler {
	return queuedHandler{h.Handler.WithGroup(name), h.q}
}

// logQueueOf is the queue log's lines go through, or nil.
func logQueueOf(log *slog.Logger) *logQueue {
	if h, ok := log.Handler().(queuedHandler); ok {
		return h.q
	}
	return nil
}

// CloseLog writes out the lines log still holds, waiting at most a
// second for a reader that does not read, and stops its writer; lines
// logged later are dropped. The command calls it as the process exits.
func CloseLog(log *slog.Logger) {
	if q := logQueueOf(log); q != nil {
		q.close()
	}
}

// flushLog waits, at most a second, for the lines log holds to be written.
func flushLog(log *slog.Logger) {
	if q := logQueueOf(log); q != nil {
		q.flush(logFlushBound)
	}
}

// countDroppedLines exposes the lines d's log dropped as
// MetricPrefix+"log_lines_dropped_total".
func (d *Daemon) countDroppedLines(w Work) {
	q := logQueueOf(d.log)
	if w.Metrics == nil || q == nil {
		return
	}
	w.Metrics.CounterFunc(w.MetricPrefix+"log_lines_dropped_total", "Log lines dropped because standard error did not take them: its reader stopped reading (the queue of lines waiting for it was full) or went away.", nil, nil,
		func() float64 { return float64(q.dropped.Load()) })
}
