package daemon

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// releaseStartupPages asks the kernel to drop this process's resident
// pages of its own executable once start-up is over. Start-up (runtime and
// package initialisation, flag parsing, TLS set-up) touches most of the
// binary; a long-running daemon then uses a small part of it. The pages
// stay in the page cache and come back on first use, so this only lowers
// the resident set (and the memory charged to the service's cgroup) by the
// code that is not running. Best effort: errors are logged at debug level.
func releaseStartupPages(log *slog.Logger) {
	exe, err := os.Executable()
	if err != nil {
		return
	}
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return
	}
	defer f.Close()
	released := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// address perms offset dev inode path
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 || strings.TrimSuffix(strings.Join(fields[5:], " "), " (deleted)") != exe {
			continue
		}
		if strings.Contains(fields[1], "w") {
			continue // data and bss are private, written memory: not ours to drop
		}
		var start, end uintptr
		if _, err := fmt.Sscanf(fields[0], "%x-%x", &start, &end); err != nil || end <= start {
			continue
		}
		// A raw madvise: the range is a mapping of the executable, not Go
		// memory. MADV_DONTNEED, not MADV_PAGEOUT: it unmaps the pages from
		// this process even when another process (the agent beside a server,
		// on one node) maps the same file, which PAGEOUT skips. The mapping
		// is private and read-only, so nothing is lost: a page in use faults
		// back in from the page cache.
		if _, _, errno := unix.Syscall(unix.SYS_MADVISE, start, end-start, unix.MADV_DONTNEED); errno != 0 {
			log.Debug("release start-up pages", "err", errno)
			return
		}
		released += int(end - start)
	}
	log.Debug("released start-up pages of the executable", "mapped_bytes", released)
}

// releaseWhenReady releases the start-up pages a second time once ready
// first reports true: connecting (TLS handshakes, HTTP/2 set-up, the first
// agent or server) is start-up too, and until then the daemon has not
// reached the steady state it will idle in. It gives up at ctx's end or
// after a minute; the caller runs it as a goroutine owned by ctx.
func releaseWhenReady(ctx context.Context, ready func() bool, log *slog.Logger) {
	const (
		poll    = 100 * time.Millisecond
		giveUp  = time.Minute
		settled = 200 * time.Millisecond // let the first connection finish its set-up
	)
	tick := time.NewTicker(poll)
	defer tick.Stop()
	deadline := time.NewTimer(giveUp)
	defer deadline.Stop()
	for !ready() {
		select {
		case <-ctx.Done():
			return
		case <-deadline.C:
			return
		case <-tick.C:
		}
	}
	select {
	case <-ctx.Done():
		return
	case <-time.After(settled):
	}
	releaseStartupPages(log)
}

// Returning memory after a burst: the Go runtime keeps freed heap for
// reuse and gives it back to the OS only once a garbage collection has
// found it free, and an idle daemon allocates too little to start one:
// untrimmed, a thousand concurrent tunnels make a server hold 150 MiB
// for minutes after they close. Every trimInterval the daemon compares what it
// holds with what it needs and, past its slack (slackFor), collects and
// returns the rest (debug.FreeOSMemory); it does the same once a burst of new tunnels
// has gone quiet (see shouldTrim). The check reads runtime/metrics and
// stops nothing; a trim costs two collections, about a millisecond per
// 10 MiB live on an idle machine, and more with many goroutines' stacks to
// scan.
const (
	trimInterval = 5 * time.Second
	trimSlack    = 16 << 20
)

// trimMemory checks every interval until ctx ends; the caller owns it as a
// goroutine.
func trimMemory(ctx context.Context, interval time.Duration, log *slog.Logger) {
	newTrimmer(log).run(ctx, interval)
}

// trimmer is the state of one trimMemory loop, owned by its goroutine.
type trimmer struct {
	log   *slog.Logger
	last  heapSample // the previous check's sample
	since trimState
}

// newTrimmer takes the first sample: goroutines started after it count as
// new to the trimmer.
func newTrimmer(log *slog.Logger) *trimmer {
	last := readHeap()
	return &trimmer{log: log, last: last, since: newTrimState(last)}
}

func (t *trimmer) run(ctx context.Context, interval time.Duration) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		t.check()
	}
}

// check trims when shouldTrim says so.
func (t *trimmer) check() {
	now := readHeap()
	t.since.observe(now)
	if shouldTrim(now, t.last, t.since) {
		// Two collections: the first moves sync.Pool contents (copy
		// buffers) to the pools' victim caches, the second frees them.
		runtime.GC()
		debug.FreeOSMemory()
		after := readHeap()
		t.log.Debug("returned free memory to the OS", "held_before_bytes", now.heap, "held_after_bytes", after.heap)
		t.since, now = newTrimState(after), after
	}
	t.last = now
}

// trimState is what the trimmer remembers of its last trim.
type trimState struct {
	heap uint64 // the heap's bytes right after it (heapSample.heap)
	// The fewest and the most goroutines seen since: tunnels opened or
	// closed since are the difference, whatever collections ran meanwhile
	// (one in the middle of a burst does not shrink the tunnels opened
	// after it).
	fewestGoroutines, mostGoroutines uint64
}

func newTrimState(s heapSample) trimState {
	return trimState{heap: s.heap, fewestGoroutines: s.goroutines, mostGoroutines: s.goroutines}
}

func (t *trimState) observe(s heapSample) {
	t.fewestGoroutines = min(t.fewestGoroutines, s.goroutines)
	t.mostGoroutines = max(t.mostGoroutines, s.goroutines)
}

// shouldTrim decides from two samples one interval apart. When a collection
// ran in between, its live figure is fresh: trim if the heap holds much more
// than the collector's own goal (twice the live heap) would. When none ran
// (an idle process, as after a burst), the heap may be full of garbage
// nobody has looked at: trim if it grew past what the last trim left, or
// if many goroutines started or ended since the last trim and all is quiet
// now. Started ones are new tunnels, parked with the stacks their dial and
// first write grew: only a collection shrinks a parked goroutine's stack
// (to half, 4 KiB per tunnel on a 64-bit machine), and the daemon's own
// allocation may not start one for minutes. Ended ones are closed tunnels,
// whose memory is garbage that the last trim could not return.
//
// While goroutines are still rising fast (a burst under way, such as a
// fleet of agents connecting) it does not trim: the burst takes back at
// once what a trim returns (page faults on every page), the runtime's own
// collections keep its heap near their goal meanwhile, and the quiet after
// it trims.
func shouldTrim(now, last heapSample, since trimState) bool {
	if now.goroutines >= last.goroutines+trimGoroutines {
		return false
	}
	if now.gcCycles != last.gcCycles {
		return now.heap > 2*now.live+slackFor(now.live)
	}
	return now.heap > since.heap+slackFor(now.live) ||
		now.goroutines >= since.fewestGoroutines+trimGoroutines ||
		now.goroutines+trimGoroutines <= since.mostGoroutines
}

// slackFor is how much more than needed the heap may hold before a trim,
// with live bytes live at the last collection: trimSlack, or a quarter of
// live when that is more. A trim's two collections cost in proportion to
// the live heap (marking it, and every goroutine's stack), so a large one
// is trimmed only for garbage in proportion: with 50,000 gRPC tunnels open
// (400 MiB live, 160,000 goroutines) a trim takes about a second of CPU,
// and with a fixed 16 MiB slack a steady trickle of dials set one off at
// every check.
func slackFor(live uint64) uint64 { return max(trimSlack, live/4) }

// trimGoroutines is how many goroutines started or ended since the last
// trim make a trim worth its cost: at least 2 MiB of stacks to halve, or
// of tunnels' memory to return.
const trimGoroutines = 512

// heapSample is the memory the runtime holds for the heap and goroutine
// stacks (not yet returned to the OS), and what the last collection found live.
type heapSample struct {
	heap, live, gcCycles uint64
	goroutines           uint64
}

func readHeap() heapSample {
	s := []metrics.Sample{
		{Name: "/memory/classes/heap/objects:bytes"},
		{Name: "/memory/classes/heap/free:bytes"},
		{Name: "/memory/classes/heap/stacks:bytes"},
		{Name: "/memory/classes/heap/unused:bytes"},
		{Name: "/gc/heap/live:bytes"},
		{Name: "/gc/cycles/total:gc-cycles"},
		{Name: "/sched/goroutines:goroutines"},
	}
	metrics.Read(s)
	v := func(i int) uint64 {
		if s[i].Value.Kind() != metrics.KindUint64 {
			return 0
		}
		return s[i].Value.Uint64()
	}
	return heapSample{heap: v(0) + v(1) + v(2) + v(3), live: v(4), gcCycles: v(5), goroutines: v(6)}
}
