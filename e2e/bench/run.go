package main

import (
	"context"
	"debug/buildinfo"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchpki"
	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

const (
	kib = 1 << 10
	mib = 1 << 20
	gib = 1 << 30
)

type result struct{ passed, failed int }

// row is one line of the final table; status is "met", "missed" or "" (info).
type row struct{ figure, kon, direct, ratio, target, status string }

type bench struct {
	cfg      config
	out      io.Writer // table and summary
	progress io.Writer // one line per phase
	res      result
	failures []string
	rows     []row
	mu       sync.Mutex // guards notes
	notes    []string

	dir           string
	pat           *pattern
	dest          *destination
	server, agent *proc
	sock          string
	tun           dialer
	serverAdmin   int
	agentAdmin    int
	idleG         [2]int // goroutines of server and agent with no tunnel

	// --frontend grpc: a null gRPC proxy (helper process) that dials the
	// destination itself, the floor of the protocol without a tunnel.
	null    *helperProc
	nullTun dialer
}

func (b *bench) logf(format string, a ...any) {
	fmt.Fprintf(b.progress, "bench: "+format+"\n", a...)
}

// check records one correctness check.
func (b *bench) check(name string, ok bool, detail string) {
	if ok {
		b.res.passed++
		b.logf("ok   %s", name)
		return
	}
	b.res.failed++
	msg := name
	if detail != "" {
		msg += ": " + detail
	}
	b.failures = append(b.failures, msg)
	b.logf("FAIL %s", msg)
}

// note adds a line below the table; profile fetchers call it concurrently.
func (b *bench) note(format string, a ...any) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.notes = append(b.notes, fmt.Sprintf(format, a...))
}

func (b *bench) addRow(figure, kon, direct, ratio, target string, met *bool) {
	st := ""
	if met != nil {
		st = "missed"
		if *met {
			st = "met"
		}
	}
	b.rows = append(b.rows, row{figure, kon, direct, ratio, target, st})
}

func ptr(v bool) *bool { return &v }

func errStr(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func ms(d time.Duration) string { return fmt.Sprintf("%.3f ms", float64(d)/float64(time.Millisecond)) }

// run is the whole benchmark; it stops every process it started before
// returning.
func run(ctx context.Context, cfg config, out, progress io.Writer) (result, error) {
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	b := &bench{cfg: cfg, out: out, progress: progress}
	bin, err := filepath.Abs(cfg.bin)
	if err != nil {
		return b.res, fmt.Errorf("--bin %s: %w", cfg.bin, err)
	}
	if _, err := os.Stat(bin); err != nil {
		return b.res, fmt.Errorf("--bin: %w", err)
	}
	b.cfg.bin = bin

	b.dir, err = os.MkdirTemp("", "kbench")
	if err != nil {
		return b.res, fmt.Errorf("work dir: %w", err)
	}
	defer func() {
		if cfg.keep || b.res.failed > 0 {
			fmt.Fprintf(out, "work dir kept (certificates, logs): %s\n", b.dir)
			return
		}
		os.RemoveAll(b.dir)
	}()

	b.printMachine()
	if cfg.tunnels10k {
		b.raiseNofile(65536)
	}
	b.pat = newPattern()
	b.dest, err = startDestination(b.pat)
	if err != nil {
		return b.res, err
	}
	defer b.dest.close()

	if err := b.start(ctx); err != nil {
		b.stopProcs()
		return b.res, err
	}
	// ctrl-c, SIGTERM or the timeout: stop the children at once, which also
	// fails every blocked tunnel operation.
	stopWatch := context.AfterFunc(ctx, b.stopProcs)
	defer stopWatch()
	defer b.stopProcs()

	type phase struct {
		name, key string
		f         func(context.Context) error
	}
	all := []phase{
		{"idle memory", "idle", b.phaseIdle},
		{"CONNECT latency", "latency", b.phaseLatency},
		{"throughput and CPU", "throughput", b.phaseThroughput},
		{"concurrent echo", "concurrent", b.phaseConcurrent},
		{"head-of-line", "hol", b.phaseHOL},
		{"10,000 tunnels", "10k", b.phase10k},
	}
	settle(ctx, time.Second)
	g0s, g0a, err := b.goroutines(ctx)
	if err != nil {
		return b.res, err
	}
	b.logf("idle goroutines: server %d, agent %d", g0s, g0a)
	b.idleG = [2]int{g0s, g0a}
	for _, p := range all {
		if ctx.Err() != nil {
			break
		}
		if !cfg.wants(p.key) {
			continue
		}
		b.logf("== %s (load %s)", p.name, benchproc.LoadAvg())
		b.resetPeak()
		t0 := time.Now()
		if err := p.f(ctx); err != nil {
			b.check(p.name+" phase", false, err.Error())
		}
		b.logf("   %s took %v", p.name, time.Since(t0).Round(time.Millisecond))
		if s, a, err := b.peak(); err == nil {
			b.note("peak RSS during %s: server %s, agent %s", p.name, kibStr(s), kibStr(a))
		}
		// Every tunnel of the phase is closed now: the processes must return
		// to their idle goroutine count (a few may be mid-exit).
		var gs, ga int
		ok := waitFor(ctx, 15*time.Second, func() bool {
			gs, ga, err = b.goroutines(ctx)
			return err == nil && gs <= g0s+goroutineSlack && ga <= g0a+goroutineSlack
		})
		b.check(fmt.Sprintf("after %s: no tunnel left open in server or agent (goroutines back to idle)", p.name), ok,
			fmt.Sprintf("goroutines server %d (idle %d), agent %d (idle %d) 15s after the last close; err %v", gs, g0s, ga, g0a, err))
	}
	if ctx.Err() != nil {
		b.check("run completed", false, context.Cause(ctx).Error())
	}
	b.finish()
	return b.res, nil
}

func (b *bench) printMachine() {
	fmt.Fprintf(b.out, "machine: %d CPUs (nproc), %s; load average %s\n", runtime.NumCPU(), cpuModel(), benchproc.LoadAvg())
	binGo := "unknown"
	if bi, err := buildinfo.ReadFile(b.cfg.bin); err == nil {
		binGo = bi.GoVersion
	}
	fmt.Fprintf(b.out, "go: bench built with %s, %s built with %s\n", runtime.Version(), b.cfg.bin, binGo)
	fmt.Fprintf(b.out, "sizes: %d MiB per throughput run, %d dials, %d concurrent x %d KiB, %d idle tunnels, %d HOL echoes\n",
		b.cfg.bytes/mib, b.cfg.dials, b.cfg.concurrent, b.cfg.echoSize/kib, b.cfg.idleTunnels, b.cfg.holEchoes)
}

// raiseNofile lifts RLIMIT_NOFILE for the bench (children inherit it); the
// 10,000-tunnel figure needs two descriptors per tunnel here.
func (b *bench) raiseNofile(want uint64) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		b.note("getrlimit NOFILE: %v", err)
		return
	}
	nl := syscall.Rlimit{Cur: max(want, lim.Cur), Max: max(want, lim.Max)}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &nl); err != nil {
		// Not allowed to raise the hard limit: use all of it.
		nl = syscall.Rlimit{Cur: lim.Max, Max: lim.Max}
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &nl); err != nil {
			b.note("setrlimit NOFILE: %v", err)
			return
		}
	}
	b.logf("RLIMIT_NOFILE %d/%d", nl.Cur, nl.Max)
}

func (b *bench) start(ctx context.Context) error {
	p, err := benchpki.Mint(b.dir, "bench")
	if err != nil {
		return err
	}
	ports := make([]int, 5)
	for i := range ports {
		if ports[i], err = benchproc.FreePort(); err != nil {
			return err
		}
	}
	agentPort, serverHealth, agentHealth := ports[0], ports[1], ports[2]
	b.sock = filepath.Join(b.dir, "konnectivity.sock")
	serverArgs := []string{
		"--mode=" + b.cfg.mode(),
		"--uds-name=" + b.sock,
		"--server-port=0",
		"--agent-bind-address=127.0.0.1",
		"--agent-port=" + strconv.Itoa(agentPort),
		"--cluster-cert=" + p.ServerCert,
		"--cluster-key=" + p.ServerKey,
		"--cluster-ca-cert=" + p.CACert,
		"--health-bind-address=127.0.0.1",
		"--health-port=" + strconv.Itoa(serverHealth),
	}
	if b.cfg.serverBin == "" {
		serverArgs = append([]string{"server", "--agent-wait=5s"}, serverArgs...)
	}
	agentArgs := []string{
		"--proxy-server-host=127.0.0.1",
		"--proxy-server-port=" + strconv.Itoa(agentPort),
		"--ca-cert=" + p.CACert,
		"--agent-cert=" + p.AgentCert,
		"--agent-key=" + p.AgentKey,
		"--agent-id=bench",
		"--health-server-host=127.0.0.1",
		"--health-server-port=" + strconv.Itoa(agentHealth),
	}
	if b.cfg.agentBin == "" {
		agentArgs = append([]string{"agent"}, agentArgs...)
		agentArgs = append(agentArgs, agentStreamFlags(b.cfg.bin)...)
	}
	serverBin, agentBin := b.cfg.bin, b.cfg.bin
	if b.cfg.serverBin != "" {
		serverBin, agentBin = b.cfg.serverBin, b.cfg.agentBin
	}
	// pprof on loopback admin ports is always on: goroutine counts are the
	// bench's leak check, and CPU profiles are fetched with --pprof.
	b.serverAdmin, b.agentAdmin = ports[3], ports[4]
	serverArgs = append(serverArgs, "--enable-profiling", "--admin-bind-address=127.0.0.1", "--admin-port="+strconv.Itoa(b.serverAdmin))
	agentArgs = append(agentArgs, "--enable-profiling", "--admin-bind-address=127.0.0.1", "--admin-server-port="+strconv.Itoa(b.agentAdmin))
	b.server, err = benchproc.Start("server", serverBin, serverArgs, filepath.Join(b.dir, "server.log"))
	if err != nil {
		return err
	}
	// The agent would retry, but starting it only once the server is up
	// keeps a connection-refused warning out of its log.
	if err := benchproc.WaitHTTP(ctx, b.server, serverHealth, "/healthz", readyTimeout); err != nil {
		return err
	}
	b.agent, err = benchproc.Start("agent", agentBin, agentArgs, filepath.Join(b.dir, "agent.log"))
	if err != nil {
		return err
	}
	if err := benchproc.WaitHTTP(ctx, b.server, serverHealth, "/readyz", readyTimeout); err != nil {
		return err
	}
	if err := benchproc.WaitHTTP(ctx, b.agent, agentHealth, "/readyz", readyTimeout); err != nil {
		return err
	}
	b.tun = tunnelDialer(b.sock)
	if b.cfg.frontend == "grpc" {
		b.tun = grpcDialer(b.sock)
		if b.cfg.wants("latency") || b.cfg.wants("throughput") {
			nullSock := filepath.Join(b.dir, "grpc-null.sock")
			h, err := startGRPCNullHelper(ctx, nullSock)
			b.check("gRPC null proxy (protocol floor) started", err == nil, errStr(err))
			if err == nil {
				b.null, b.nullTun = h, grpcDialer(nullSock)
				b.logf("gRPC null proxy pid %d, socket %s", h.cmd.Process.Pid, nullSock)
			}
		}
	}
	b.logf("server pid %d (pprof 127.0.0.1:%d), agent pid %d (pprof 127.0.0.1:%d), socket %s",
		b.server.PID(), b.serverAdmin, b.agent.PID(), b.agentAdmin, b.sock)
	return nil
}

func (b *bench) stopProcs() {
	if b.null != nil {
		b.null.stop()
	}
	// Agent first: it then has no server to drain toward.
	for _, p := range []*proc{b.agent, b.server} {
		if p != nil {
			p.Stop()
		}
	}
}

// goroutineSlack allows for short-lived goroutines (health probes, timers)
// when comparing against the idle count.
const goroutineSlack = 2

// goroutines reads the goroutine totals of server and agent from pprof.
func (b *bench) goroutines(ctx context.Context) (srv, agt int, err error) {
	s, err1 := goroutineCount(ctx, b.serverAdmin)
	a, err2 := goroutineCount(ctx, b.agentAdmin)
	return s, a, errors.Join(err1, err2)
}

// resetPeak resets VmHWM of both processes (clear_refs 5); failure only
// means the peak covers the whole run so far.
func (b *bench) resetPeak() {
	for _, p := range []*proc{b.server, b.agent} {
		_ = os.WriteFile("/proc/"+strconv.Itoa(p.PID())+"/clear_refs", []byte("5"), 0)
	}
}

// peak reads VmHWM of server and agent.
func (b *bench) peak() (srv, agt int64, err error) {
	s, err1 := benchproc.StatusKiB(b.server.PID(), "VmHWM:")
	a, err2 := benchproc.StatusKiB(b.agent.PID(), "VmHWM:")
	return s, a, errors.Join(err1, err2)
}

// rss reads VmRSS of server and agent.
func (b *bench) rss() (srv, agt int64, err error) {
	s, err1 := benchproc.RSSKiB(b.server.PID())
	a, err2 := benchproc.RSSKiB(b.agent.PID())
	return s, a, errors.Join(err1, err2)
}

// settle gives freshly opened or closed tunnels a moment to finish their
// bookkeeping before memory is read.
func settle(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

func kibStr(k int64) string { return fmt.Sprintf("%.1f MiB", float64(k)/1024) }

// phaseIdle: figure 5, idle RSS and RSS per idle tunnel.
func (b *bench) phaseIdle(ctx context.Context) error {
	settle(ctx, time.Second)
	s0, a0, err := b.rss()
	if err != nil {
		return err
	}
	b.addRow("idle RSS, server", kibStr(s0), "", "", "<= 10 MiB", ptr(s0 <= 10*1024))
	b.addRow("idle RSS, agent", kibStr(a0), "", "", "<= 8 MiB", ptr(a0 <= 8*1024))

	n := b.cfg.idleTunnels
	conns, errs, firstErr := openIdle(ctx, b.tun, b.dest.echo.Addr().String(), n, 32)
	defer closeAll(conns)
	b.check(fmt.Sprintf("%d idle tunnels open, each echoed 1 byte", n), errs == 0,
		fmt.Sprintf("%d errors, first: %v", errs, firstErr))
	settle(ctx, time.Second)
	s1, a1, err := b.rss()
	if err != nil {
		return err
	}
	b.note("RSS with %d idle tunnels: server %s, agent %s", len(conns), kibStr(s1), kibStr(a1))
	b.perTunnelRows(ctx, "RSS per idle tunnel", len(conns), s0, a0, s1, a1)
	if gs, ga, err := b.goroutines(ctx); err == nil {
		b.note("goroutines with %d idle tunnels: server %d, agent %d (%.1f and %.1f per tunnel)", len(conns), gs, ga,
			float64(gs-b.idleG[0])/float64(max(len(conns), 1)), float64(ga-b.idleG[1])/float64(max(len(conns), 1)))
	}
	b.saveHeapProfiles(ctx, fmt.Sprintf("%d-idle-tunnels", len(conns)))
	closeAll(conns)
	// Every close must reach the destination: an echo connection that stays
	// open after its tunnel closed is a leak.
	ok := waitFor(ctx, 10*time.Second, func() bool { return b.dest.openConns() == 0 })
	b.check("closing the idle tunnels closes their destination connections", ok,
		fmt.Sprintf("%d destination connections still open after 10s", b.dest.openConns()))
	return nil
}

func waitFor(ctx context.Context, d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// phaseLatency: figure 1.
func (b *bench) phaseLatency(ctx context.Context) error {
	var tun, dir, null latencyResult
	if b.nullTun != nil {
		r := measureLatencyPaths(ctx, b.dest.echo.Addr().String(), b.cfg.dials, directDialer, b.tun, b.nullTun)
		dir, tun, null = r[0], r[1], r[2]
	} else {
		tun, dir = measureLatency(ctx, b.tun, b.dest.echo.Addr().String(), b.cfg.dials)
	}
	b.check(fmt.Sprintf("%d tunnelled CONNECT + 1-byte echoes correct", b.cfg.dials), tun.errs == 0 && len(tun.sorted) == b.cfg.dials,
		fmt.Sprintf("%d errors, first: %v", tun.errs, tun.firstErr))
	b.check(fmt.Sprintf("%d direct dial + 1-byte echoes correct", b.cfg.dials), dir.errs == 0 && len(dir.sorted) == b.cfg.dials,
		fmt.Sprintf("%d errors, first: %v", dir.errs, dir.firstErr))
	for _, p := range []struct {
		name   string
		pct    float64
		target time.Duration
	}{{"p50", 50, 250 * time.Microsecond}, {"p99", 99, 1500 * time.Microsecond}} {
		t, d := percentile(tun.sorted, p.pct), percentile(dir.sorted, p.pct)
		ratio := ""
		if d > 0 {
			ratio = fmt.Sprintf("%.1fx", float64(t)/float64(d))
		}
		b.addRow("CONNECT + 1 B echo, "+p.name, ms(t), ms(d), ratio, "<= "+ms(p.target), ptr(len(tun.sorted) > 0 && t <= p.target))
	}
	if b.nullTun != nil {
		b.nullLatencyRows(tun, dir, null)
	}
	return nil
}

// nullLatencyRows adds the gRPC protocol floor: the same client and dials
// through the null proxy, measured in the same rounds as tun and dir.
func (b *bench) nullLatencyRows(tun, dir, null latencyResult) {
	b.check(fmt.Sprintf("%d CONNECT + 1-byte echoes through the gRPC null proxy correct", b.cfg.dials),
		null.errs == 0 && len(null.sorted) == b.cfg.dials, fmt.Sprintf("%d errors, first: %v", null.errs, null.firstErr))
	pcts := []struct {
		name string
		pct  float64
	}{{"p50", 50}, {"p99", 99}}
	for _, p := range pcts {
		n, d := percentile(null.sorted, p.pct), percentile(dir.sorted, p.pct)
		ratio := ""
		if d > 0 {
			ratio = fmt.Sprintf("%.1fx", float64(n)/float64(d))
		}
		b.addRow("CONNECT + 1 B echo, "+p.name+", gRPC protocol floor (null proxy, no tunnel)", ms(n), ms(d), ratio, "", nil)
	}
	for _, p := range pcts {
		t, n := percentile(tun.sorted, p.pct), percentile(null.sorted, p.pct)
		ratio := ""
		if n > 0 && len(tun.sorted) > 0 {
			ratio = fmt.Sprintf("%.2fx", float64(t)/float64(n))
		}
		b.addRow("CONNECT + 1 B echo, "+p.name+", tunnel / null proxy", ms(t)+" / "+ms(n), "", ratio, "", nil)
	}
}

// profiles fetches CPU profiles of server and agent while a run goes on;
// the returned func waits for them.
func (b *bench) profiles(ctx context.Context, label string) func() {
	if b.cfg.pprofDir == "" {
		return func() {}
	}
	var wg sync.WaitGroup
	for _, t := range []struct {
		name string
		port int
	}{{"server", b.serverAdmin}, {"agent", b.agentAdmin}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			path := filepath.Join(b.cfg.pprofDir, t.name+"-"+label+".pprof")
			if err := fetchProfile(ctx, t.port, b.cfg.pprofSeconds, path); err != nil {
				b.note("profile %s %s: %v", t.name, label, err)
				return
			}
			b.note("profile saved: %s", path)
		}()
	}
	return wg.Wait
}

func fetchProfile(ctx context.Context, port, seconds int, path string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Duration(seconds)*time.Second+30*time.Second)
	defer cancel()
	return fetchPprof(ctx, port, fmt.Sprintf("profile?seconds=%d", seconds), path)
}

// fetchPprof saves /debug/pprof/<what> of the admin server on port.
// perTunnelRows adds the RSS per open tunnel of each daemon: from RSS
// before (s0, a0) and just after the tunnels opened (s1, a1), and, with
// --idle-steady, again that much later. The later reading is the one held
// against the target: by then the daemons' memory trim (checked every 5 s) has
// collected the garbage of the burst that opened them and shrunk their
// goroutines' stacks, which is what a quiet node carries for hours.
func (b *bench) perTunnelRows(ctx context.Context, what string, n int, s0, a0, s1, a1 int64) {
	per := func(k1, k0 int64) float64 { return float64(k1-k0) / float64(max(n, 1)) }
	steady := b.cfg.idleSteady
	var s2, a2 int64
	if steady > 0 {
		settle(ctx, steady)
		var err error
		if s2, a2, err = b.rss(); err != nil {
			steady = 0
		}
	}
	for _, d := range []struct {
		name   string
		k0, k2 int64
		fresh  float64
	}{{"server", s0, s2, per(s1, s0)}, {"agent", a0, a2, per(a1, a0)}} {
		if steady == 0 {
			b.addRow(fmt.Sprintf("%s, %s (%d open)", what, d.name, n), fmt.Sprintf("%.1f KiB", d.fresh), "", "",
				"<= 10 KiB", ptr(d.fresh <= 10))
			continue
		}
		later := per(d.k2, d.k0)
		b.addRow(fmt.Sprintf("%s, %s (%d open)", what, d.name, n),
			fmt.Sprintf("%.1f KiB after %v (%.1f KiB at once)", later, steady, d.fresh), "", "",
			"<= 10 KiB", ptr(later <= 10))
	}
	if steady > 0 {
		b.note("%s: RSS %v after opening: server %s, agent %s", what, steady, kibStr(s2), kibStr(a2))
	}
}

// saveHeapProfiles saves both daemons' heap profiles, when --pprof is set:
// the profile, and the same as text, which ends with the runtime's
// MemStats (heap in use, stacks, garbage not yet collected).
func (b *bench) saveHeapProfiles(ctx context.Context, label string) {
	if b.cfg.pprofDir == "" {
		return
	}
	for _, t := range []struct {
		name string
		port int
	}{{"server", b.serverAdmin}, {"agent", b.agentAdmin}} {
		path := filepath.Join(b.cfg.pprofDir, fmt.Sprintf("%s-heap-%s.pprof", t.name, label))
		if err := fetchPprof(ctx, t.port, "heap", path); err != nil {
			b.note("heap profile %s: %v", t.name, err)
			continue
		}
		b.note("profile saved: %s", path)
		if err := fetchPprof(ctx, t.port, "heap?debug=1", strings.TrimSuffix(path, ".pprof")+".txt"); err != nil {
			b.note("heap profile %s: %v", t.name, err)
		}
	}
}

func fetchPprof(ctx context.Context, port int, what, path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	url := fmt.Sprintf("http://127.0.0.1:%d/debug/pprof/%s", port, what)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("get %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("get %s: %s", url, resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return fmt.Errorf("save %s: %w", path, err)
	}
	return f.Close()
}

// plainRelayResult is the plain TLS relay's run: see plain_relay.go.
type plainRelayResult struct {
	ok       bool
	down, up time.Duration
	cpu      float64 // both relays, seconds per GiB moved
}

// measurePlainRelay runs the same download and upload through two plain Go
// TLS relays (plain_relay.go) in their own processes, outside the
// daemons' CPU window.
func (b *bench) measurePlainRelay(ctx context.Context, src, sink string, n int64) plainRelayResult {
	var r plainRelayResult
	if !b.cfg.plainRelay {
		return r
	}
	rf, err := startPlainRelay(ctx, filepath.Join(b.dir, "plain-relay.sock"))
	b.check("plain TLS relay started", err == nil, errStr(err))
	if err != nil {
		return r
	}
	defer rf.stop()
	c0, cerr0 := rf.cpuTicks()
	via := tunnelDialer(rf.sock)
	var errD, errU error
	r.down, errD = download(ctx, via, b.pat, src, n)
	b.check("download through the plain TLS relay intact (CRC-32C)", errD == nil, errStr(errD))
	r.up, errU = upload(ctx, via, b.pat, sink, n)
	b.check("upload through the plain TLS relay intact (CRC-32C)", errU == nil, errStr(errU))
	c1, cerr1 := rf.cpuTicks()
	if errD != nil || errU != nil || cerr0 != nil || cerr1 != nil {
		return r
	}
	r.ok = true
	r.cpu = float64(c1-c0) / float64(clockTicks()) / (2 * float64(n) / gib)
	return r
}

// phaseThroughput: figures 2 and 3.
func (b *bench) phaseThroughput(ctx context.Context) error {
	n := b.cfg.bytes
	b.pat.crc(n) // outside the timed region
	src, sink := b.dest.source.Addr().String(), b.dest.sink.Addr().String()
	mbps := func(d time.Duration) float64 { return float64(n) / 1e6 / d.Seconds() }

	dDown, errDD := download(ctx, directDialer, b.pat, src, n)
	b.check("direct download intact (CRC-32C)", errDD == nil, errStr(errDD))
	dUp, errDU := upload(ctx, directDialer, b.pat, sink, n)
	b.check("direct upload intact (CRC-32C)", errDU == nil, errStr(errDU))
	// The gRPC protocol floor, between the direct and the tunnelled runs
	// and outside the server and agent CPU window.
	var nDown, nUp time.Duration
	var errND, errNU error
	if b.nullTun != nil {
		pid := b.null.cmd.Process.Pid
		c0, cerr0 := benchproc.CPUTicks(pid)
		nDown, errND = download(ctx, b.nullTun, b.pat, src, n)
		b.check("download through the gRPC null proxy intact (CRC-32C)", errND == nil, errStr(errND))
		nUp, errNU = upload(ctx, b.nullTun, b.pat, sink, n)
		b.check("upload through the gRPC null proxy intact (CRC-32C)", errNU == nil, errStr(errNU))
		c1, cerr1 := benchproc.CPUTicks(pid)
		if cerr0 == nil && cerr1 == nil && errND == nil && errNU == nil {
			b.note("gRPC null proxy CPU: %.2f s per GiB moved (its own process; %d ticks over %.2f GiB)",
				float64(c1-c0)/float64(clockTicks())/(2*float64(n)/gib), c1-c0, 2*float64(n)/gib)
		}
	}

	floor := b.measurePlainRelay(ctx, src, sink, n)

	hz := clockTicks()
	s0, err1 := benchproc.CPUTicks(b.server.PID())
	a0, err2 := benchproc.CPUTicks(b.agent.PID())
	if err := errors.Join(err1, err2); err != nil {
		return err
	}
	io0s, _ := procIO(b.server.PID())
	io0a, _ := procIO(b.agent.PID())
	wait := b.profiles(ctx, "download")
	tDown, errTD := download(ctx, b.tun, b.pat, src, n)
	wait()
	b.check("tunnelled download intact (CRC-32C)", errTD == nil, errStr(errTD))
	wait = b.profiles(ctx, "upload")
	tUp, errTU := upload(ctx, b.tun, b.pat, sink, n)
	wait()
	b.check("tunnelled upload intact (CRC-32C)", errTU == nil, errStr(errTU))
	s1, err1 := benchproc.CPUTicks(b.server.PID())
	a1, err2 := benchproc.CPUTicks(b.agent.PID())
	if err := errors.Join(err1, err2); err != nil {
		return err
	}

	for _, r := range []struct {
		name       string
		tun, dir   time.Duration
		terr, derr error
	}{{"download (destination -> client)", tDown, dDown, errTD, errDD}, {"upload (client -> destination)", tUp, dUp, errTU, errDU}} {
		if r.terr != nil || r.derr != nil {
			b.addRow("throughput, "+r.name, "error", "", "", ">= 25 % of direct", ptr(false))
			continue
		}
		pct := 100 * mbps(r.tun) / mbps(r.dir)
		b.addRow("throughput, "+r.name, fmt.Sprintf("%.0f MB/s", mbps(r.tun)), fmt.Sprintf("%.0f MB/s", mbps(r.dir)),
			fmt.Sprintf("%.1f %%", pct), ">= 25 % of direct", ptr(pct >= 25))
	}
	moved := 2 * float64(n) / gib
	io1s, errS := procIO(b.server.PID())
	io1a, errA := procIO(b.agent.PID())
	if errS == nil && errA == nil {
		m := 2 * float64(n) / mib
		b.note("syscalls per MiB moved: server %.1f reads + %.1f writes, agent %.1f reads + %.1f writes (/proc/PID/io)",
			float64(io1s.syscr-io0s.syscr)/m, float64(io1s.syscw-io0s.syscw)/m, float64(io1a.syscr-io0a.syscr)/m, float64(io1a.syscw-io0a.syscw)/m)
	}
	if errTD == nil && errTU == nil {
		srv := float64(s1-s0) / float64(hz) / moved
		agt := float64(a1-a0) / float64(hz) / moved
		b.addRow("CPU s per GiB, server + agent", fmt.Sprintf("%.2f s (server %.2f + agent %.2f)", srv+agt, srv, agt), "", "",
			"<= 1.5 s", ptr(srv+agt <= 1.5))
		b.note("CPU: %d ticks at %d/s over %.2f GiB moved through the tunnel", (s1-s0)+(a1-a0), hz, moved)
		if floor.ok {
			b.addRow("CPU s per GiB, plain TLS relay", fmt.Sprintf("%.2f s", floor.cpu), "", fmt.Sprintf("tunnel %.2fx", (srv+agt)/floor.cpu), "", nil)
		}
	}
	if floor.ok && errTD == nil && errTU == nil && errDD == nil && errDU == nil {
		for _, r := range []struct {
			name            string
			floor, tun, dir time.Duration
		}{{"download", floor.down, tDown, dDown}, {"upload", floor.up, tUp, dUp}} {
			b.addRow("throughput, "+r.name+", plain TLS relay", fmt.Sprintf("%.0f MB/s", mbps(r.floor)), fmt.Sprintf("%.0f MB/s", mbps(r.dir)),
				fmt.Sprintf("%.1f %% (tunnel %.0f %% of it)", 100*mbps(r.floor)/mbps(r.dir), 100*mbps(r.tun)/mbps(r.floor)), "", nil)
		}
	}
	if b.nullTun != nil {
		for _, r := range []struct {
			name             string
			null, tun, dir   time.Duration
			nerr, terr, derr error
		}{{"download (destination -> client)", nDown, tDown, dDown, errND, errTD, errDD},
			{"upload (client -> destination)", nUp, tUp, dUp, errNU, errTU, errDU}} {
			if r.nerr != nil || r.derr != nil {
				b.addRow("throughput, "+r.name+", gRPC protocol floor (null proxy, no tunnel)", "error", "", "", "", nil)
			} else {
				b.addRow("throughput, "+r.name+", gRPC protocol floor (null proxy, no tunnel)",
					fmt.Sprintf("%.0f MB/s", mbps(r.null)), fmt.Sprintf("%.0f MB/s", mbps(r.dir)),
					fmt.Sprintf("%.1f %%", 100*mbps(r.null)/mbps(r.dir)), "", nil)
			}
			if r.nerr != nil || r.terr != nil {
				b.addRow("throughput, "+r.name+", tunnel / null proxy", "error", "", "", "", nil)
				continue
			}
			b.addRow("throughput, "+r.name+", tunnel / null proxy",
				fmt.Sprintf("%.0f / %.0f MB/s", mbps(r.tun), mbps(r.null)), "",
				fmt.Sprintf("%.1f %%", 100*mbps(r.tun)/mbps(r.null)), "", nil)
		}
	}
	return nil
}

// phaseConcurrent: figure 4.
func (b *bench) phaseConcurrent(ctx context.Context) error {
	n, size := b.cfg.concurrent, b.cfg.echoSize
	echo := b.dest.echo.Addr().String()
	dir := concurrentEcho(ctx, directDialer, b.pat, echo, n, size)
	b.check(fmt.Sprintf("%d concurrent direct echoes of %d KiB correct", n, size/kib), dir.errs == 0,
		fmt.Sprintf("%d errors, first: %v", dir.errs, dir.firstErr))
	settle(ctx, 500*time.Millisecond)
	tun := concurrentEcho(ctx, b.tun, b.pat, echo, n, size)
	b.check(fmt.Sprintf("%d concurrent tunnelled echoes of %d KiB correct", n, size/kib), tun.errs == 0,
		fmt.Sprintf("%d errors, first: %v", tun.errs, tun.firstErr))
	b.addRow(fmt.Sprintf("%d x %d KiB concurrent echo, wall", n, size/kib),
		fmt.Sprintf("%.3f s, %d errors", tun.wall.Seconds(), tun.errs), fmt.Sprintf("%.3f s, %d errors", dir.wall.Seconds(), dir.errs),
		fmt.Sprintf("%.1fx", tun.wall.Seconds()/dir.wall.Seconds()), "<= 0.5 s, 0 errors", ptr(tun.errs == 0 && tun.wall <= 500*time.Millisecond))
	return nil
}

// phaseHOL: figure 6. One tunnel echoes small messages while a second has a
// client that stopped reading and a third a destination that stopped reading.
func (b *bench) phaseHOL(ctx context.Context) error {
	n := b.cfg.holEchoes
	echo := b.dest.echo.Addr().String()
	a, err := b.tun(ctx, echo)
	if err != nil {
		return err
	}
	defer a.Close()
	// Unloaded echoes before the stall and again after it (A-B-A): this
	// machine's tail latency drifts by several times from one second to the
	// next, and a baseline taken on one side only would decide the ratio.
	unloaded, err := smallEchoes(a, n, 1)
	b.check(fmt.Sprintf("%d 16-byte echoes on one tunnel, unloaded", n), err == nil, errStr(err))
	dc, err := directDialer(ctx, echo)
	if err != nil {
		return err
	}
	direct, derr := smallEchoes(dc, n, 2)
	dc.Close()
	b.check(fmt.Sprintf("%d 16-byte echoes direct", n), derr == nil, errStr(derr))

	// Tunnel B: the source writes stallBytes; the client reads none yet.
	stall := b.cfg.stallBytes
	sent0 := b.dest.sourceSent.Load()
	bc, err := b.tun(ctx, b.dest.source.Addr().String())
	if err != nil {
		return err
	}
	defer bc.Close()
	if err := writeLength(bc, stall); err != nil {
		return err
	}
	// Tunnel C: the client writes stallBytes; the hold destination reads none yet.
	cc, err := b.tun(ctx, b.dest.hold.Addr().String())
	if err != nil {
		return err
	}
	defer cc.Close()
	if err := writeLength(cc, stall); err != nil {
		return err
	}
	var cWritten atomic.Int64
	werr := make(chan error, 1)
	go func() { werr <- b.pat.writePattern(cc, stall, &cWritten) }()

	// Stalled = neither counter moved for 500 ms.
	stalled := func() (bool, int64, int64) {
		deadline := time.Now().Add(20 * time.Second)
		lastS, lastC, since := int64(-1), int64(-1), time.Now()
		for time.Now().Before(deadline) && ctx.Err() == nil {
			s, c := b.dest.sourceSent.Load()-sent0, cWritten.Load()
			if s != lastS || c != lastC {
				lastS, lastC, since = s, c, time.Now()
			} else if time.Since(since) >= 500*time.Millisecond {
				return true, s, c
			}
			time.Sleep(20 * time.Millisecond)
		}
		return false, lastS, lastC
	}
	ok, sBuf, cBuf := stalled()
	b.note("stalled tunnels: destination wrote %.1f MiB to a client that does not read; client wrote %.1f MiB to a destination that does not read (of %d MiB each)",
		float64(sBuf)/mib, float64(cBuf)/mib, stall/mib)
	if !ok {
		b.note("stalled tunnels still moving after 20 s (buffering without bound?)")
	}
	if sBuf >= stall || cBuf >= stall {
		b.note("a stalled tunnel accepted all %d MiB: the tunnel buffered everything (no backpressure?)", stall/mib)
	}
	if s, a, err := b.rss(); err == nil {
		b.note("RSS with two stalled tunnels: server %s, agent %s", kibStr(s), kibStr(a))
	}

	loaded, lerr := smallEchoes(a, n, 3)
	b.check(fmt.Sprintf("%d 16-byte echoes while two tunnels are stalled", n), lerr == nil,
		fmt.Sprintf("%v (%d of %d done)", lerr, len(loaded), n))
	_, nerr := dialEcho(ctx, b.tun, echo, 0x5a)
	b.check("a new tunnel works while two are stalled", nerr == nil, errStr(nerr))

	// Resume both stalled tunnels: every byte must arrive intact.
	got, rerr := readCRC(bc, stall, make([]byte, chunkSize))
	if rerr == nil && got != b.pat.crc(stall) {
		rerr = fmt.Errorf("CRC-32C %08x, want %08x", got, b.pat.crc(stall))
	}
	b.check("stalled download intact after the client resumes reading", rerr == nil, errStr(rerr))
	b.dest.releaseHold()
	var ans [4]byte
	uerr := <-werr
	if uerr == nil {
		if err := cc.SetReadDeadline(time.Now().Add(ioIdle)); err != nil {
			uerr = err
		} else if _, err := io.ReadFull(cc, ans[:]); err != nil {
			uerr = fmt.Errorf("read CRC answer: %w", err)
		} else if g := uint32(ans[0])<<24 | uint32(ans[1])<<16 | uint32(ans[2])<<8 | uint32(ans[3]); g != b.pat.crc(stall) {
			uerr = fmt.Errorf("sink CRC-32C %08x, want %08x", g, b.pat.crc(stall))
		}
	}
	b.check("stalled upload intact after the destination resumes reading", uerr == nil, errStr(uerr))
	after, aerr := smallEchoes(a, n, 4)
	b.check(fmt.Sprintf("%d 16-byte echoes on one tunnel, unloaded again", n), aerr == nil, errStr(aerr))
	b.note("16 B echo p99 unloaded: %s before the stall, %s after it; the row uses both", ms(percentile(unloaded, 99)), ms(percentile(after, 99)))
	unloaded = sortDur(append(unloaded, after...))

	up, dp := percentile(unloaded, 99), percentile(direct, 99)
	b.addRow("16 B echo p99 on one tunnel, unloaded", ms(up), ms(dp), fmt.Sprintf("%.1fx", float64(up)/float64(max(dp, 1))), "", nil)
	lp := percentile(loaded, 99)
	met := lerr == nil && len(loaded) == n && lp <= 2*up
	b.addRow("16 B echo p99, 2 other tunnels stalled", ms(lp), "", fmt.Sprintf("%.2fx unloaded", float64(lp)/float64(max(up, 1))),
		"<= 2x unloaded", ptr(met))
	return nil
}

// phase10k: figure 5 at 10,000 tunnels.
func (b *bench) phase10k(ctx context.Context) error {
	const n = 10000
	settle(ctx, time.Second)
	s0, a0, err := b.rss()
	if err != nil {
		return err
	}
	echo := b.dest.echo.Addr().String()
	destOpen := b.dest.openConns
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err == nil && lim.Cur < 2*n+1000 {
		h, err := startEchoHelper(ctx)
		if err != nil {
			return err
		}
		defer h.stop()
		echo = h.addr
		destOpen = func() int { return 0 } // the helper's connections close with it
		b.note("10,000 tunnels: RLIMIT_NOFILE is %d, so the echo destination ran in a helper process", lim.Cur)
	}
	t0 := time.Now()
	conns, errs, firstErr := openIdle(ctx, b.tun, echo, n, 64)
	took := time.Since(t0)
	defer closeAll(conns)
	b.check("10,000 tunnels open at once, each echoed 1 byte", errs == 0,
		fmt.Sprintf("%d errors, first: %v", errs, firstErr))
	settle(ctx, 2*time.Second)
	s1, a1, err := b.rss()
	if err != nil {
		return err
	}
	b.note("10,000 tunnels: %d opened in %v (64 dialling at a time), %d failed; RSS server %s, agent %s",
		len(conns), took.Round(time.Millisecond), errs, kibStr(s1), kibStr(a1))
	b.perTunnelRows(ctx, "RSS per tunnel", len(conns), s0, a0, s1, a1)
	b.saveHeapProfiles(ctx, fmt.Sprintf("%d-tunnels", len(conns)))
	closeAll(conns)
	ok := waitFor(ctx, 20*time.Second, func() bool { return destOpen() == 0 })
	b.check("closing 10,000 tunnels closes their destination connections", ok,
		fmt.Sprintf("%d still open after 20s", destOpen()))
	return nil
}

// finish reads the last figures, stops the processes and prints the table.
func (b *bench) finish() {
	if b.server != nil && !b.server.Exited() && !b.agent.Exited() {
		settle(context.Background(), time.Second)
		if s, a, err := b.rss(); err == nil {
			b.note("idle RSS after the load: server %s, agent %s", kibStr(s), kibStr(a))
		}
		if b.cfg.linger > 0 {
			// Does the memory go back to the OS once the tunnels are gone?
			settle(context.Background(), b.cfg.linger)
			if s, a, err := b.rss(); err == nil {
				b.note("idle RSS %v after the load: server %s, agent %s", b.cfg.linger, kibStr(s), kibStr(a))
			}
		}
		b.check("server and agent still running after the load", true, "")
	} else {
		b.check("server and agent still running after the load", false, "a process exited early")
	}
	b.stopProcs()
	for _, p := range []*proc{b.agent, b.server} {
		graceful, took := p.Graceful()
		b.check(p.Name+" exits on SIGTERM", graceful, fmt.Sprintf("needed SIGKILL after %v", benchproc.StopTimeout))
		if graceful {
			b.note("%s exited %v after SIGTERM (%v)", p.Name, took.Round(time.Millisecond), p.WaitErr())
		}
		lines, bad, sample := p.LogIssues(5)
		b.note("%s log: %d lines, %d WARN/ERROR", p.Name, lines, bad)
		for _, l := range sample {
			b.note("  %s: %s", p.Name, l)
		}
	}
	derrs := b.dest.errs.Load()
	b.check("destination saw no unexpected errors", derrs == 0, fmt.Sprintf("%d, first: %v", derrs, b.dest.firstErr()))

	size, stripped := binarySize(b.cfg.bin)
	sz := fmt.Sprintf("%.2f MB (%d bytes)", float64(size)/1e6, size)
	if !stripped {
		sz += ", NOT stripped"
	}
	b.addRow("binary size (server + agent in one)", sz, "", "", "<= 8 MB", ptr(stripped && size <= 8e6))

	fmt.Fprintln(b.out)
	tw := tabwriter.NewWriter(b.out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "figure\tkonnectivity\tdirect\tratio\ttarget\t")
	fmt.Fprintln(tw, "------\t------------\t------\t-----\t------\t")
	met, missed := 0, 0
	for _, r := range b.rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", r.figure, r.kon, r.direct, r.ratio, r.target, r.status)
		switch r.status {
		case "met":
			met++
		case "missed":
			missed++
		}
	}
	tw.Flush()
	fmt.Fprintf(b.out, "targets: %d met, %d missed (reported, not asserted)\n", met, missed)
	fmt.Fprintf(b.out, "load average at the end: %s\n", benchproc.LoadAvg())
	for _, n := range b.notes {
		fmt.Fprintf(b.out, "note: %s\n", n)
	}
	for _, f := range b.failures {
		fmt.Fprintf(b.out, "FAILED: %s\n", f)
	}
	if b.res.failed > 0 {
		for _, p := range []*proc{b.server, b.agent} {
			if p != nil {
				fmt.Fprintf(b.out, "--- %s log tail\n%s\n", p.Name, p.LogTail(20))
			}
		}
	}
}

// binarySize is the file size and whether it carries no symbol table.
func binarySize(path string) (int64, bool) {
	st, err := os.Stat(path)
	if err != nil {
		return 0, false
	}
	f, err := elf.Open(path)
	if err != nil {
		return st.Size(), false
	}
	defer f.Close()
	return st.Size(), f.Section(".symtab") == nil
}

// openConns counts live destination connections.
func (d *destination) openConns() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.conns)
}

// benchAgentStreams is the most tunnels the bench's one agent must carry
// at once: the 10,000 of the 10k phase, with room for the tunnels of a
// phase before it that are still closing.
const benchAgentStreams = 12000

// agentStreamFlags sets our agent's stream caps to what the bench needs.
// Left at their defaults they derive from RLIMIT_NOFILE, which on a host
// with a limit of 20,000 is below 10,000 tunnels on one connection. A
// binary whose agent has no --max-streams-total caps one connection only,
// at a default above the bench's need, so it is passed nothing.
func agentStreamFlags(bin string) []string {
	help, _ := exec.Command(bin, "agent", "--help").CombinedOutput()
	if !strings.Contains(string(help), "-max-streams-total") {
		return nil
	}
	n := strconv.Itoa(benchAgentStreams)
	return []string{"--max-streams=" + n, "--max-streams-total=" + n}
}
