package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel"
	"github.com/spinifex/konnectivity/tunnel/promtext"
)

// simArgs are a simulator's settings.
type simArgs struct {
	Server    string `json:"server"` // host:port of the server's agent listener
	CACert    string `json:"ca_cert"`
	AgentCert string `json:"agent_cert"`
	AgentKey  string `json:"agent_key"`
}

// failureSeries is the agent's own count of failed connections to a
// server (each one is followed by a retry).
const failureSeries = "konnectivity_network_proxy_agent_server_connection_failure_count"

// sim runs agents in this process: the product's own agent code, one
// tunnel.Agent per simulated node, each with its own TLS connection and
// link. Requests on stdin, one answer line each on stdout:
//
//	start A B   start agents A..B-1 (IDs scale-A...), answer "ok"
//	stat        answer "stat k=v ..." (see statLine)
//
// Closing stdin stops every agent (they drain) and ends the process.
type sim struct {
	args simArgs
	tls  *tls.Config
	ctx  context.Context
	wg   sync.WaitGroup // one per running agent

	mu     sync.Mutex // guards agents
	agents []simAgent

	connects    atomic.Int64 // "connected to server" events
	lastConnect atomic.Int64 // unix nanoseconds of the latest one
	errMu       sync.Mutex   // guards errSeen
	errSeen     map[string]int
}

type simAgent struct {
	a        *tunnel.Agent
	failures *promtext.Counter
}

func runSim(in io.Reader, out io.Writer) error {
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
	s := &sim{
		args:    args,
		tls:     &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12},
		ctx:     ctx,
		errSeen: map[string]int{},
	}
	defer func() {
		cancel()
		s.wg.Wait()
	}()
	fmt.Fprintln(out, "ready")
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		var ans string
		switch f[0] {
		case "start":
			ans = s.start(f[1:])
		case "stat":
			ans = s.statLine()
		default:
			ans = "error unknown request " + strconv.Quote(f[0])
		}
		fmt.Fprintln(out, ans)
	}
	return nil
}

func (s *sim) start(f []string) string {
	if len(f) != 2 {
		return "error want: start FROM TO"
	}
	from, err1 := strconv.Atoi(f[0])
	to, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil || from < 0 || to < from {
		return "error bad range"
	}
	log := slog.New(&simLog{s: s})
	for i := from; i < to; i++ {
		reg := promtext.NewRegistry()
		a, err := newSimAgent(s, i, reg, log)
		if err != nil {
			return "error " + err.Error()
		}
		s.mu.Lock()
		s.agents = append(s.agents, simAgent{a: a, failures: reg.Counter(failureSeries, "", []string{"direction"}, "to_server")})
		s.mu.Unlock()
		s.wg.Add(1)
		go func() { // owned by s: ends when s.ctx ends and the agent drained
			defer s.wg.Done()
			_ = a.Run(s.ctx)
		}()
	}
	return "ok"
}

// newSimAgent is one agent as `konnectivity agent` configures it, with one
// server address and the default timings (retry pacing included); only
// the drain on shutdown is short, as the benchmark has closed its tunnels
// by then.
func newSimAgent(s *sim, i int, reg *promtext.Registry, log *slog.Logger) (*tunnel.Agent, error) {
	return tunnel.NewAgent(tunnel.AgentConfig{
		ServerAddrs: []string{s.args.Server},
		ID:          "scale-" + strconv.Itoa(i),
		TLS: func(serverName string) (*tls.Config, error) {
			c := s.tls.Clone()
			c.ServerName = serverName
			return c, nil
		},
		DrainTimeout: 2 * time.Second,
		Metrics:      reg,
		Logger:       log,
	})
}

// statLine reports the agents: how many hold a connection, connection
// events, failed connections (retries) in total and per agent, open
// tunnels, and this process's goroutines and RSS.
func (s *sim) statLine() string {
	s.mu.Lock()
	agents := s.agents
	s.mu.Unlock()
	var connected, open int64
	var failures, maxFail, retried2 uint64
	for _, sa := range agents {
		if held, _ := sa.a.Connected(); held > 0 {
			connected++
		}
		open += sa.a.Stats.OpenStreams.Load()
		n := sa.failures.Value()
		failures += n
		maxFail = max(maxFail, n)
		if n >= 2 {
			retried2++
		}
	}
	rss, _ := rssKiB(os.Getpid())
	return fmt.Sprintf("stat agents=%d connected=%d connects=%d last_connect=%d failures=%d max_failures=%d retried2=%d open=%d goroutines=%d rss_kib=%d errors=%s",
		len(agents), connected, s.connects.Load(), s.lastConnect.Load(), failures, maxFail, retried2, open,
		runtime.NumGoroutine(), rss, s.errSummary())
}

// errSummary names the most frequent connection error text, URL-style
// (no spaces), for the report.
func (s *sim) errSummary() string {
	s.errMu.Lock()
	defer s.errMu.Unlock()
	best, n := "", 0
	for e, c := range s.errSeen {
		if c > n {
			best, n = e, c
		}
	}
	if best == "" {
		return "-"
	}
	return strconv.Itoa(n) + "x:" + strings.ReplaceAll(best, " ", "_")
}

// simLog reads the agents' log events instead of printing them: a
// connection made, and the reason of a failed one (rate-limited by the
// agent, so a sample).
type simLog struct{ s *sim }

func (h *simLog) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelInfo }

func (h *simLog) Handle(_ context.Context, r slog.Record) error {
	switch r.Message {
	case "connected to server":
		h.s.connects.Add(1)
		h.s.lastConnect.Store(time.Now().UnixNano())
	case "server connection failed":
		r.Attrs(func(a slog.Attr) bool {
			if a.Key != "err" {
				return true
			}
			e := shortErr(a.Value.String())
			h.s.errMu.Lock()
			if len(h.s.errSeen) < 32 || h.s.errSeen[e] > 0 {
				h.s.errSeen[e]++
			}
			h.s.errMu.Unlock()
			return false
		})
	}
	return nil
}

func (h *simLog) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *simLog) WithGroup(string) slog.Handler      { return h }

// addrPattern matches an IPv4 address with its port.
var addrPattern = regexp.MustCompile(`\d+\.\d+\.\d+\.\d+:\d+`)

// shortErr replaces the addresses in an error text, so that the same
// failure on different connections counts as one kind.
func shortErr(e string) string { return addrPattern.ReplaceAllString(e, "ADDR") }
