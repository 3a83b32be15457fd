package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchpki"
	"github.com/spinifex/konnectivity/internal/testnet"
)

type config struct {
	bin           string
	duration      time.Duration
	interval      time.Duration
	hupEvery      time.Duration
	churnEvery    time.Duration
	shortWorkers  int
	streamWorkers int
	streamMiB     int
	keepLogs      bool
	maxUnexpected int
	allowRestart  bool
}

func main() {
	cfg := config{}
	flag.StringVar(&cfg.bin, "bin", "../bin/konnectivity", "konnectivity binary")
	flag.DurationVar(&cfg.duration, "duration", 10*time.Minute, "how long the workload runs")
	flag.DurationVar(&cfg.interval, "interval", 10*time.Second, "report interval")
	flag.DurationVar(&cfg.hupEvery, "hup-every", time.Minute, "SIGHUP (self-restart) the server this often; 0 never")
	flag.DurationVar(&cfg.churnEvery, "churn-every", 20*time.Second, "stop and restart the second agent this often, SIGTERM and SIGKILL in turn; 0 never")
	flag.IntVar(&cfg.shortWorkers, "short-workers", 4, "concurrent short-dial loops")
	flag.IntVar(&cfg.streamWorkers, "stream-workers", 2, "concurrent long-stream loops")
	flag.IntVar(&cfg.streamMiB, "stream-mib", 16, "MiB each way per long stream")
	flag.BoolVar(&cfg.keepLogs, "keep-logs", false, "keep the process logs and print their directory")
	flag.IntVar(&cfg.maxUnexpected, "max-unexpected-errors", 0, "errors outside an agent-kill window that still pass")
	flag.BoolVar(&cfg.allowRestart, "allow-restart-cuts", false, "do not fail on streams cut during a server SIGHUP (for comparing builds older than the fix that lets a restart finish the last window of a download)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		fmt.Fprintf(os.Stdout, "SOAK FAILED: %v\n", err)
		os.Exit(1)
	}
	fmt.Fprintln(os.Stdout, "SOAK PASSED")
}

// ---------------------------------------------------------------------------
// Processes

type proc struct {
	name    string
	cmd     *exec.Cmd
	log     *os.File
	done    chan struct{}
	waitErr error
}

func startProc(bin, name, logPath string, args ...string) (*proc, error) {
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open %s log: %w", name, err)
	}
	p := &proc{name: name, log: f, done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() { p.waitErr = p.cmd.Wait(); f.Close(); close(p.done) }()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends sig and waits up to bound, then SIGKILL.
func (p *proc) stop(sig syscall.Signal, bound time.Duration) {
	if p.exited() {
		return
	}
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(bound):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func waitStatus(ctx context.Context, p *proc, url string, want int, bound time.Duration) error {
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(bound)
	for {
		if p.exited() {
			return fmt.Errorf("%s exited: %v", p.name, p.waitErr)
		}
		if resp, err := client.Get(url); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == want {
				return nil
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("%s: %s not %d within %s", p.name, url, want, bound)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stats are one sample of a process.
type stats struct {
	rssKiB, goroutines, fds int
}

func (s stats) String() string {
	return fmt.Sprintf("rss=%.1fMiB g=%d fd=%d", float64(s.rssKiB)/1024, s.goroutines, s.fds)
}

func sample(pid, adminPort int) stats {
	var s stats
	if b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
				s.rssKiB, _ = strconv.Atoi(f[1])
			}
		}
	}
	if ents, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd"); err == nil {
		s.fds = len(ents)
	}
	s.goroutines = goroutines(adminPort)
	return s
}

func goroutines(adminPort int) int {
	client := &http.Client{Timeout: 3 * time.Second}
	resp, err := client.Get("http://127.0.0.1:" + strconv.Itoa(adminPort) + "/debug/pprof/goroutine?debug=1")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	line, _ := bufio.NewReader(resp.Body).ReadString('\n')
	n, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "goroutine profile: total ")))
	if err != nil {
		return -1
	}
	return n
}

// ---------------------------------------------------------------------------
// Destinations

// randReader is an AES-CTR keystream under a random key.
type randReader struct{ s cipher.Stream }

func newRand() *randReader {
	key, iv := make([]byte, 16), make([]byte, 16)
	rand.Read(key)
	rand.Read(iv)
	b, _ := aes.NewCipher(key)
	return &randReader{cipher.NewCTR(b, iv)}
}

func (r *randReader) Read(p []byte) (int, error) {
	clear(p)
	r.s.XORKeyStream(p, p)
	return len(p), nil
}

// listen runs handle for each connection until ctx ends.
func listen(ctx context.Context, wg *sync.WaitGroup, handle func(net.Conn)) (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	srv := testnet.Serve(ln, handle)
	wg.Add(1)
	go func() {
		defer wg.Done()
		<-ctx.Done()
		srv.Close()
	}()
	return srv.Addr(), nil
}

// digestServe reads a 16-byte header (up, down), sends down random bytes
// while it hashes up bytes, then writes the two digests and closes.
func digestServe(c net.Conn) {
	c.SetDeadline(time.Now().Add(5 * time.Minute))
	var hdr [16]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return
	}
	up, down := int64(binary.BigEndian.Uint64(hdr[:8])), int64(binary.BigEndian.Uint64(hdr[8:]))
	sent := sha256.New()
	errc := make(chan error, 1)
	go func() {
		_, err := io.CopyBuffer(io.MultiWriter(c, sent), io.LimitReader(newRand(), down), make([]byte, 64<<10))
		errc <- err
	}()
	recv := sha256.New()
	n, err := io.CopyBuffer(recv, io.LimitReader(c, up), make([]byte, 64<<10))
	if werr := <-errc; err != nil || werr != nil || n != up {
		return // the client sees a cut stream
	}
	c.Write(append(recv.Sum(nil), sent.Sum(nil)...))
}

// ---------------------------------------------------------------------------
// Workload

func connect(sock, addr string, bound time.Duration) (net.Conn, *bufio.Reader, error) {
	c, err := net.DialTimeout("unix", sock, bound)
	if err != nil {
		return nil, nil, fmt.Errorf("dial socket: %w", err)
	}
	c.SetDeadline(time.Now().Add(bound))
	if _, err := fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", addr); err != nil {
		c.Close()
		return nil, nil, fmt.Errorf("write CONNECT: %w", err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		c.Close()
		return nil, nil, fmt.Errorf("read CONNECT answer: %w", err)
	}
	if resp.StatusCode != 200 {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 200))
		c.Close()
		return nil, nil, fmt.Errorf("CONNECT %d: %s", resp.StatusCode, strings.TrimSpace(string(body)))
	}
	return c, br, nil
}

// interval holds what happened in one report interval.
type interval struct {
	mu                        sync.Mutex
	shortOK, shortErr         int
	streamOK, streamCut, lost int
	bytes                     int64
	latencies                 []time.Duration
	errs                      []string
	unexpected                int
	expectedErrs              int
}

type workload struct {
	sock, echo, digest string
	streamBytes        int64

	mu   sync.Mutex
	cur  *interval
	kill []time.Time // agent SIGKILLs: errors near one are expected
	hup  []time.Time // server SIGHUPs

	lost, unexpected, expected, restartCuts atomic.Int64
}

func (w *workload) interval() *interval {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.cur
}

func (w *workload) swap() *interval {
	w.mu.Lock()
	defer w.mu.Unlock()
	old := w.cur
	w.cur = &interval{}
	return old
}

func (w *workload) noteKill(at time.Time) {
	w.mu.Lock()
	w.kill = append(w.kill, at)
	w.mu.Unlock()
}

func (w *workload) noteHUP(at time.Time) {
	w.mu.Lock()
	w.hup = append(w.hup, at)
	w.mu.Unlock()
}

// nearHUP reports whether an operation [start, end] overlaps a server
// restart (SIGHUP to re-exec, which takes well under restartWindow).
func (w *workload) nearHUP(start, end time.Time) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, h := range w.hup {
		if !start.After(h.Add(restartWindow)) && !end.Before(h) {
			return true
		}
	}
	return false
}

const restartWindow = 12 * time.Second // --restart-grace=10s plus the re-exec

// nearKill reports whether an operation [start, end] overlaps an agent
// SIGKILL (plus a second for the server to notice).
func (w *workload) nearKill(start, end time.Time) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, k := range w.kill {
		if !start.After(k.Add(time.Second)) && !end.Before(k) {
			return true
		}
	}
	return false
}

func (w *workload) fail(start time.Time, what string, err error) {
	iv := w.interval()
	expected := w.nearKill(start, time.Now())
	restart := !expected && w.nearHUP(start, time.Now())
	iv.mu.Lock()
	defer iv.mu.Unlock()
	switch {
	case expected:
		iv.expectedErrs++
		w.expected.Add(1)
	case restart:
		w.restartCuts.Add(1)
	default:
		iv.unexpected++
		w.unexpected.Add(1)
	}
	if len(iv.errs) < 5 {
		tag := "UNEXPECTED"
		if expected {
			tag = "during agent kill"
		} else if restart {
			tag = "DURING SERVER RESTART"
		}
		iv.errs = append(iv.errs, fmt.Sprintf("%s %s: %s: %v", start.Format("15:04:05.000"), tag, what, err))
	}
}

func (w *workload) short(ctx context.Context, id int) {
	msg := make([]byte, 32)
	got := make([]byte, 32)
	for i := 0; ctx.Err() == nil; i++ {
		start := time.Now()
		err := func() error {
			c, br, err := connect(w.sock, w.echo, 15*time.Second)
			if err != nil {
				return err
			}
			defer c.Close()
			copy(msg, fmt.Sprintf("short %d/%d %s", id, i, strings.Repeat(".", 32)))
			if _, err := c.Write(msg); err != nil {
				return err
			}
			if _, err := io.ReadFull(br, got); err != nil {
				return err
			}
			if !bytes.Equal(got, msg) {
				w.lost.Add(1)
				return fmt.Errorf("LOST BYTES: echo %q, sent %q", got, msg)
			}
			return nil
		}()
		if err != nil {
			w.fail(start, "short dial", err)
			iv := w.interval()
			iv.mu.Lock()
			iv.shortErr++
			iv.mu.Unlock()
			sleep(ctx, 50*time.Millisecond)
			continue
		}
		iv := w.interval()
		iv.mu.Lock()
		iv.shortOK++
		iv.latencies = append(iv.latencies, time.Since(start))
		iv.mu.Unlock()
		sleep(ctx, 10*time.Millisecond)
	}
}

var errLost = errors.New("LOST BYTES")

func (w *workload) stream(ctx context.Context) {
	for ctx.Err() == nil {
		start := time.Now()
		n, err := w.oneStream()
		iv := w.interval()
		iv.mu.Lock()
		iv.bytes += n
		switch {
		case err == nil:
			iv.streamOK++
		case errors.Is(err, errLost):
			iv.lost++
		default:
			iv.streamCut++
		}
		iv.mu.Unlock()
		if errors.Is(err, errLost) {
			w.lost.Add(1)
		}
		if err != nil {
			w.fail(start, "stream", err)
			sleep(ctx, 100*time.Millisecond)
		}
	}
}

// oneStream sends and receives streamBytes at once and checks both
// digests. A stream that ends early is cut (an error the client sees); a
// complete stream with a digest mismatch lost bytes.
func (w *workload) oneStream() (int64, error) {
	c, br, err := connect(w.sock, w.digest, 15*time.Second)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Minute))
	var hdr [16]byte
	binary.BigEndian.PutUint64(hdr[:8], uint64(w.streamBytes))
	binary.BigEndian.PutUint64(hdr[8:], uint64(w.streamBytes))
	sentSum := make(chan []byte, 1)
	go func() {
		h := sha256.New()
		c.Write(hdr[:])
		_, err := io.CopyBuffer(io.MultiWriter(c, h), io.LimitReader(newRand(), w.streamBytes), make([]byte, 64<<10))
		if err != nil {
			sentSum <- nil
			return
		}
		sentSum <- h.Sum(nil)
	}()
	recv := sha256.New()
	n, err := io.CopyBuffer(recv, io.LimitReader(br, w.streamBytes), make([]byte, 64<<10))
	sent := <-sentSum
	if err != nil || n != w.streamBytes {
		return n, fmt.Errorf("cut after %d of %d bytes down: %v", n, w.streamBytes, err)
	}
	if sent == nil {
		return n, fmt.Errorf("cut while sending")
	}
	trailer := make([]byte, 64)
	if _, err := io.ReadFull(br, trailer); err != nil {
		return n, fmt.Errorf("cut before the digests: %v", err)
	}
	if extra, _ := br.Read(make([]byte, 1)); extra != 0 {
		return n, fmt.Errorf("%w: bytes after the digests", errLost)
	}
	if !bytes.Equal(trailer[:32], sent) {
		return n, fmt.Errorf("%w: the destination's digest of the upload differs", errLost)
	}
	if !bytes.Equal(trailer[32:], recv.Sum(nil)) {
		return n, fmt.Errorf("%w: the download's digest differs from what the destination sent", errLost)
	}
	return 2 * n, nil
}

func sleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	i := int(float64(len(ds)-1) * p)
	return ds[i]
}

// ---------------------------------------------------------------------------
// Run

type cluster struct {
	bin, dir  string
	pki       *benchpki.PKI
	sock      string
	agentPort int
	server    *proc
	srvHealth int
	srvAdmin  int
	agents    [2]*proc
	agHealth  [2]int
	agAdmin   [2]int
	restarts  int
}

func (c *cluster) startServer() error {
	var err error
	for _, p := range []*int{&c.agentPort, &c.srvHealth, &c.srvAdmin} {
		if *p, err = freePort(); err != nil {
			return err
		}
	}
	c.server, err = startProc(c.bin, "server", filepath.Join(c.dir, "server.log"),
		"server", "--mode=http-connect", "--uds-name="+c.sock, "--server-port=0",
		"--agent-bind-address=127.0.0.1", "--agent-port="+strconv.Itoa(c.agentPort),
		"--cluster-cert="+c.pki.ServerCert, "--cluster-key="+c.pki.ServerKey, "--cluster-ca-cert="+c.pki.CACert,
		"--health-bind-address=127.0.0.1", "--health-port="+strconv.Itoa(c.srvHealth),
		"--admin-bind-address=127.0.0.1", "--admin-port="+strconv.Itoa(c.srvAdmin), "--enable-profiling",
		"--agent-wait=10s", "--backend-dial-timeout=10s", "--restart-grace=10s",
		"--keepalive-time=5s", "--ping-timeout=5s", "--graceful-shutdown-timeout=5s")
	if err != nil {
		return err
	}
	return waitStatus(context.Background(), c.server, fmt.Sprintf("http://127.0.0.1:%d/healthz", c.srvHealth), 200, 20*time.Second)
}

func (c *cluster) startAgent(i int) error {
	var err error
	if c.agHealth[i], err = freePort(); err != nil {
		return err
	}
	if c.agAdmin[i], err = freePort(); err != nil {
		return err
	}
	id := []string{"stable", "churn"}[i]
	c.agents[i], err = startProc(c.bin, "agent-"+id, filepath.Join(c.dir, "agent-"+id+".log"),
		"agent", "--proxy-server-host=127.0.0.1", "--proxy-server-port="+strconv.Itoa(c.agentPort),
		"--ca-cert="+c.pki.CACert, "--agent-cert="+c.pki.AgentCert, "--agent-key="+c.pki.AgentKey,
		"--agent-id="+id, "--health-server-host=127.0.0.1", "--health-server-port="+strconv.Itoa(c.agHealth[i]),
		"--admin-bind-address=127.0.0.1", "--admin-server-port="+strconv.Itoa(c.agAdmin[i]), "--enable-profiling",
		"--keepalive-time=5s", "--ping-timeout=5s", "--drain-timeout=10s", "--sync-interval=200ms", "--sync-interval-cap=2s")
	if err != nil {
		return err
	}
	return waitStatus(context.Background(), c.agents[i], fmt.Sprintf("http://127.0.0.1:%d/readyz", c.agHealth[i]), 200, 20*time.Second)
}

func (c *cluster) stopAll() {
	for _, a := range c.agents {
		if a != nil {
			a.stop(syscall.SIGTERM, 15*time.Second)
		}
	}
	if c.server != nil {
		c.server.stop(syscall.SIGTERM, 10*time.Second)
	}
}

func run(ctx context.Context, cfg config, out io.Writer) error {
	bin, err := filepath.Abs(cfg.bin)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "ksoak")
	if err != nil {
		return err
	}
	if cfg.keepLogs {
		fmt.Fprintf(out, "logs in %s\n", dir)
	} else {
		defer os.RemoveAll(dir)
	}
	// Valid for two days from now: a soak may run that long.
	p, err := benchpki.MintSpec(dir, benchpki.Spec{CAName: "soak-ca", AgentName: "soak-agent", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}, Lifetime: 49 * time.Hour})
	if err != nil {
		return fmt.Errorf("PKI: %w", err)
	}
	c := &cluster{bin: bin, dir: dir, pki: p, sock: filepath.Join(dir, "k.sock")}
	defer c.stopAll()
	if err := c.startServer(); err != nil {
		return err
	}
	for i := range 2 {
		if err := c.startAgent(i); err != nil {
			return err
		}
	}
	if err := waitStatus(ctx, c.server, fmt.Sprintf("http://127.0.0.1:%d/readyz", c.srvHealth), 200, 20*time.Second); err != nil {
		return err
	}

	destCtx, stopDest := context.WithCancel(context.Background())
	var destWG sync.WaitGroup
	defer func() { stopDest(); destWG.Wait() }()
	echo, err := listen(destCtx, &destWG, func(c net.Conn) { io.Copy(c, c) })
	if err != nil {
		return err
	}
	digest, err := listen(destCtx, &destWG, digestServe)
	if err != nil {
		return err
	}

	time.Sleep(time.Second)
	base := [3]stats{sample(c.server.pid(), c.srvAdmin), sample(c.agents[0].pid(), c.agAdmin[0]), sample(c.agents[1].pid(), c.agAdmin[1])}
	fmt.Fprintf(out, "soak: %s, %d short + %d stream workers (%d MiB each way), SIGHUP every %s, agent churn every %s\n",
		cfg.duration, cfg.shortWorkers, cfg.streamWorkers, cfg.streamMiB, cfg.hupEvery, cfg.churnEvery)
	fmt.Fprintf(out, "baseline idle: server %s | stable agent %s | churn agent %s\n", base[0], base[1], base[2])

	w := &workload{sock: c.sock, echo: echo, digest: digest, streamBytes: int64(cfg.streamMiB) << 20, cur: &interval{}}
	wctx, stopWork := context.WithTimeout(ctx, cfg.duration)
	defer stopWork()
	var wg sync.WaitGroup
	for i := range cfg.shortWorkers {
		wg.Add(1)
		go func() { defer wg.Done(); w.short(wctx, i) }()
	}
	for range cfg.streamWorkers {
		wg.Add(1)
		go func() { defer wg.Done(); w.stream(wctx) }()
	}

	// Faults: SIGHUP the server, churn the second agent.
	var events sync.Mutex
	var eventLog []string
	note := func(s string) {
		events.Lock()
		eventLog = append(eventLog, time.Now().Format("15:04:05")+" "+s)
		events.Unlock()
	}
	var faultErr atomic.Value
	wg.Add(1)
	go func() {
		defer wg.Done()
		hup := tick(cfg.hupEvery)
		churn := tick(cfg.churnEvery)
		kill := false
		for {
			select {
			case <-wctx.Done():
				return
			case <-hup:
				w.noteHUP(time.Now())
				c.server.cmd.Process.Signal(syscall.SIGHUP)
				c.restarts++
				note("server SIGHUP")
			case <-churn:
				a := c.agents[1]
				if kill {
					w.noteKill(time.Now())
					a.stop(syscall.SIGKILL, 5*time.Second)
					note("churn agent SIGKILL")
				} else {
					start := time.Now()
					a.stop(syscall.SIGTERM, 15*time.Second)
					note(fmt.Sprintf("churn agent SIGTERM (exit %v after %s)", a.waitErr, time.Since(start).Round(time.Millisecond)))
				}
				kill = !kill
				if err := c.startAgent(1); err != nil {
					faultErr.Store(err)
					note("churn agent restart FAILED: " + err.Error())
				}
			}
		}
	}()

	// Reports.
	var maxRSS [3]int
	var warm [3]int
	var totals struct {
		shortOK, shortErr, streamOK, streamCut int
		bytes                                  int64
		all                                    []time.Duration
	}
	report := time.NewTicker(cfg.interval)
	start := time.Now()
	fmt.Fprintf(out, "%8s %8s %6s %8s %8s %6s %6s %5s %8s | %-28s | %-28s | %s\n",
		"t", "short", "err", "p50", "p99", "strm", "cut", "lost", "MiB", "server", "stable agent", "churn agent")
	for n := 1; ; n++ {
		finished := false
		select {
		case <-report.C:
		case <-wctx.Done():
			finished = true
		}
		iv := w.swap()
		iv.mu.Lock()
		s := [3]stats{sample(c.server.pid(), c.srvAdmin), sample(c.agents[0].pid(), c.agAdmin[0]), sample(c.agents[1].pid(), c.agAdmin[1])}
		for i := range s {
			maxRSS[i] = max(maxRSS[i], s[i].rssKiB)
			if n <= 2 {
				warm[i] = max(warm[i], s[i].rssKiB)
			}
		}
		fmt.Fprintf(out, "%8s %8d %6d %8s %8s %6d %6d %5d %8.0f | %-28s | %-28s | %s\n",
			time.Since(start).Round(time.Second), iv.shortOK, iv.shortErr,
			percentile(iv.latencies, 0.5).Round(10*time.Microsecond), percentile(iv.latencies, 0.99).Round(10*time.Microsecond),
			iv.streamOK, iv.streamCut, iv.lost, float64(iv.bytes)/(1<<20), s[0], s[1], s[2])
		events.Lock()
		for _, e := range eventLog {
			fmt.Fprintf(out, "         event %s\n", e)
		}
		eventLog = nil
		events.Unlock()
		for _, e := range iv.errs {
			fmt.Fprintf(out, "         error %s\n", e)
		}
		totals.shortOK += iv.shortOK
		totals.shortErr += iv.shortErr
		totals.streamOK += iv.streamOK
		totals.streamCut += iv.streamCut
		totals.bytes += iv.bytes
		totals.all = append(totals.all, iv.latencies...)
		iv.mu.Unlock()
		if finished {
			break
		}
	}
	wg.Wait()

	// Quiesce, then compare with the baselines.
	time.Sleep(3 * time.Second)
	end := [3]stats{sample(c.server.pid(), c.srvAdmin), sample(c.agents[0].pid(), c.agAdmin[0]), sample(c.agents[1].pid(), c.agAdmin[1])}
	fmt.Fprintf(out, "end (idle, 3s after the workload): server %s | stable agent %s | churn agent %s\n", end[0], end[1], end[2])
	fmt.Fprintf(out, "totals: %d short dials ok, %d failed; p50 %s p99 %s max %s; %d streams ok, %d cut; %.0f MiB checked; server restarts %d; errors: %d during agent kills, %d during server restarts, %d other; lost: %d\n",
		totals.shortOK, totals.shortErr, percentile(totals.all, 0.5).Round(10*time.Microsecond), percentile(totals.all, 0.99).Round(10*time.Microsecond),
		percentile(totals.all, 1).Round(time.Millisecond), totals.streamOK, totals.streamCut, float64(totals.bytes)/(1<<20), c.restarts,
		w.expected.Load(), w.restartCuts.Load(), w.unexpected.Load(), w.lost.Load())
	fmt.Fprintf(out, "peak RSS: server %.1f MiB, stable agent %.1f MiB, churn agent %.1f MiB\n",
		float64(maxRSS[0])/1024, float64(maxRSS[1])/1024, float64(maxRSS[2])/1024)

	var problems []string
	if w.lost.Load() > 0 {
		problems = append(problems, fmt.Sprintf("%d operations lost bytes", w.lost.Load()))
	}
	if n := int(w.unexpected.Load()); n > cfg.maxUnexpected {
		problems = append(problems, fmt.Sprintf("%d errors outside agent kills (allowed %d)", n, cfg.maxUnexpected))
	}
	if n := w.restartCuts.Load(); n > 0 && !cfg.allowRestart {
		problems = append(problems, fmt.Sprintf("%d operations cut during server restarts (graceful: none should be)", n))
	}
	if totals.shortOK == 0 || totals.streamOK == 0 && cfg.streamWorkers > 0 {
		problems = append(problems, "no progress")
	}
	if v := faultErr.Load(); v != nil {
		problems = append(problems, fmt.Sprint(v))
	}
	// Leaks: the server (same PID across restarts) and the stable agent
	// must be back near their idle baselines. RSS may keep a warmed heap,
	// so it is compared with the warmed-up level, not the idle start.
	for i, name := range []string{"server", "stable agent"} {
		if end[i].goroutines < 0 || end[i].goroutines > base[i].goroutines+10 {
			problems = append(problems, fmt.Sprintf("%s goroutines %d at the end, %d at the start", name, end[i].goroutines, base[i].goroutines))
		}
		if end[i].fds > base[i].fds+5 {
			problems = append(problems, fmt.Sprintf("%s open files %d at the end, %d at the start", name, end[i].fds, base[i].fds))
		}
		if limit := warm[i]*3/2 + 32<<10; end[i].rssKiB > limit {
			problems = append(problems, fmt.Sprintf("%s RSS %d KiB at the end, warmed-up %d KiB", name, end[i].rssKiB, warm[i]))
		}
	}
	if len(problems) > 0 {
		for _, n := range []string{"server.log", "agent-stable.log", "agent-churn.log"} {
			b, _ := os.ReadFile(filepath.Join(dir, n))
			lines := strings.Split(strings.TrimSpace(string(b)), "\n")
			fmt.Fprintf(out, "--- last lines of %s\n%s\n", n, strings.Join(lines[max(0, len(lines)-15):], "\n"))
		}
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

func tick(d time.Duration) <-chan time.Time {
	if d <= 0 {
		return nil
	}
	return time.NewTicker(d).C
}
