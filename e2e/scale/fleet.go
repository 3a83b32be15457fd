package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

// simArgs are an agent simulator's settings.
type simArgs struct {
	Server    string `json:"server"` // host:port of the server's agent listener
	CACert    string `json:"ca_cert"`
	AgentCert string `json:"agent_cert"`
	AgentKey  string `json:"agent_key"`
}

// simAgent is one simulated agent, whatever protocol it speaks.
type simAgent interface {
	// run keeps the agent connected until ctx ends, then stops it.
	run(ctx context.Context)
	// connected reports whether it holds a connection the server accepted.
	connected() bool
	// open is the number of tunnels it carries.
	open() int64
	// failures is the number of its connection attempts that failed
	// (each one is followed by a retry).
	failures() uint64
}

// newSimAgentFunc makes agent i of a fleet.
type newSimAgentFunc func(f *fleet, i int) (simAgent, error)

// fleet is an agent-simulator process: agents of one kind, each with its
// own TLS connection to the server. Requests on stdin, one answer line
// each on stdout:
//
//	start A B   start agents A..B-1 (IDs scale-A...), answer "ok"
//	stat        answer "stat k=v ..." (see statLine)
//	gc          collect garbage now, answer "ok" (before a latency figure)
//	curve T0 MS N  connections made in each of N steps of MS milliseconds
//	            from T0 (unix nanoseconds): "curve a,b,..."
//
// Closing stdin stops every agent and ends the process.
type fleet struct {
	args  simArgs
	tls   *tls.Config // each agent's connection uses a clone
	newAg newSimAgentFunc
	ctx   context.Context
	wg    sync.WaitGroup // one per running agent

	mu     sync.Mutex // guards agents
	agents []simAgent

	connects    atomic.Int64 // connections the server accepted
	lastConnect atomic.Int64 // unix nanoseconds of the latest one
	events      eventTimes   // when connections were made and failed
	errs        errKinds
}

// runFleet serves requests on in until it closes.
func runFleet(in io.Reader, out io.Writer, newAg newSimAgentFunc) error {
	var args simArgs
	if err := json.Unmarshal([]byte(os.Getenv(helperArgsEnv)), &args); err != nil {
		return fmt.Errorf("settings: %w", err)
	}
	caPEM, err := os.ReadFile(args.CACert)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return fmt.Errorf("%s: no certificate", args.CACert)
	}
	cert, err := tls.LoadX509KeyPair(args.AgentCert, args.AgentKey)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &fleet{
		args:  args,
		tls:   &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12},
		newAg: newAg,
		ctx:   ctx,
	}
	defer func() {
		cancel()
		f.wg.Wait()
	}()
	fmt.Fprintln(out, "ready")
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		w := strings.Fields(sc.Text())
		if len(w) == 0 {
			continue
		}
		var ans string
		switch w[0] {
		case "start":
			ans = f.start(w[1:])
		case "stat":
			ans = f.statLine()
		case "gc":
			runtime.GC()
			ans = "ok"
		case "curve":
			ans = f.events.curve(w[1:])
		default:
			ans = "error unknown request " + strconv.Quote(w[0])
		}
		fmt.Fprintln(out, ans)
	}
	return nil
}

func (f *fleet) start(w []string) string {
	if len(w) != 2 {
		return "error want: start FROM TO"
	}
	from, err1 := strconv.Atoi(w[0])
	to, err2 := strconv.Atoi(w[1])
	if err1 != nil || err2 != nil || from < 0 || to < from {
		return "error bad range"
	}
	for i := from; i < to; i++ {
		a, err := f.newAg(f, i)
		if err != nil {
			return "error " + err.Error()
		}
		f.mu.Lock()
		f.agents = append(f.agents, a)
		f.mu.Unlock()
		f.wg.Add(1)
		go func() { // owned by f: ends when f.ctx ends and the agent stopped
			defer f.wg.Done()
			a.run(f.ctx)
		}()
	}
	return "ok"
}

// connectedNow records a connection the server accepted.
func (f *fleet) connectedNow() {
	now := time.Now().UnixNano()
	f.connects.Add(1)
	f.lastConnect.Store(now)
	f.events.add(now)
}

// eventTimes keeps the moments connections were made, up to maxEvents,
// for the curve of a fleet connecting.
type eventTimes struct {
	mu   sync.Mutex // guards made
	made []int64    // unix nanoseconds
}

const maxEvents = 100_000

func (e *eventTimes) add(now int64) {
	e.mu.Lock()
	if len(e.made) < maxEvents {
		e.made = append(e.made, now)
	}
	e.mu.Unlock()
}

// curve answers a "curve T0 MS N" request.
func (e *eventTimes) curve(w []string) string {
	if len(w) != 3 {
		return "error want: curve T0 MS N"
	}
	t0, err1 := strconv.ParseInt(w[0], 10, 64)
	ms, err2 := strconv.Atoi(w[1])
	n, err3 := strconv.Atoi(w[2])
	if err1 != nil || err2 != nil || err3 != nil || ms <= 0 || n <= 0 || n > 10_000 {
		return "error bad curve request"
	}
	b := make([]int, n)
	e.mu.Lock()
	for _, t := range e.made {
		if i := (t - t0) / (int64(ms) * 1e6); t >= t0 && i < int64(n) {
			b[i]++
		}
	}
	e.mu.Unlock()
	c := make([]string, n)
	for i, v := range b {
		c[i] = strconv.Itoa(v)
	}
	return "curve " + strings.Join(c, ",")
}

// statLine reports the agents: how many hold a connection, connection
// events, failed connections (retries) in total and per agent, open
// tunnels, and this process's goroutines and RSS.
func (f *fleet) statLine() string {
	f.mu.Lock()
	agents := f.agents
	f.mu.Unlock()
	var connected, open int64
	var failures, maxFail, retried2 uint64
	for _, a := range agents {
		if a.connected() {
			connected++
		}
		open += a.open()
		n := a.failures()
		failures += n
		maxFail = max(maxFail, n)
		if n >= 2 {
			retried2++
		}
	}
	rss, _ := benchproc.RSSKiB(os.Getpid())
	return fmt.Sprintf("stat agents=%d connected=%d connects=%d last_connect=%d failures=%d max_failures=%d retried2=%d open=%d goroutines=%d rss_kib=%d errors=%s",
		len(agents), connected, f.connects.Load(), f.lastConnect.Load(), failures, maxFail, retried2, open,
		runtime.NumGoroutine(), rss, f.errs.top())
}

// errKinds counts connection errors by kind (the text without addresses),
// up to maxErrKinds kinds.
type errKinds struct {
	mu   sync.Mutex // guards seen
	seen map[string]int
}

const maxErrKinds = 32

func (k *errKinds) note(err string) {
	e := shortErr(err)
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.seen == nil {
		k.seen = map[string]int{}
	}
	if len(k.seen) < maxErrKinds || k.seen[e] > 0 {
		k.seen[e]++
	}
}

// top is the most frequent kind as "COUNTx:kind_with_underscores", or "-".
func (k *errKinds) top() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	best, n := "", 0
	for e, c := range k.seen {
		if c > n {
			best, n = e, c
		}
	}
	if best == "" {
		return "-"
	}
	return strconv.Itoa(n) + "x:" + strings.ReplaceAll(best, " ", "_")
}

// addrPattern matches an IPv4 address with its port.
var addrPattern = regexp.MustCompile(`\d+\.\d+\.\d+\.\d+:\d+`)

// shortErr replaces the addresses in an error text, so that the same
// failure on different connections counts as one kind.
func shortErr(e string) string { return addrPattern.ReplaceAllString(e, "ADDR") }
