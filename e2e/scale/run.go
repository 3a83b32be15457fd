package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchpki"
	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

// fdReserve is what a process keeps for everything but tunnels and agents.
const fdReserve = 1024

const (
	serverPrefix = "konnectivity_network_proxy_server_"
	mAgents      = serverPrefix + "ready_backend_connections"
	mRefused     = serverPrefix + "agents_refused_total"
	mEstablished = serverPrefix + "established_connections"
	mGoroutines  = "go_goroutines"
)

type result struct{ passed, failed int }

// scale is one run of the benchmark: both front doors, one server each.
type scale struct {
	cfg      config
	progress io.Writer
	dir      string
	pki      *benchpki.PKI
	res      result
	failures []string
	notes    []string // what went wrong in the other implementation's runs
}

func (s *scale) logf(format string, a ...any) {
	fmt.Fprintf(s.progress, "scale: "+format+"\n", a...)
}

// check records one correctness check.
func (s *scale) check(name string, ok bool, detail string) {
	if ok {
		s.res.passed++
		s.logf("ok   %s", name)
		return
	}
	s.res.failed++
	if detail != "" {
		name += ": " + detail
	}
	s.failures = append(s.failures, name)
	s.logf("FAIL %s", name)
}

// run is the whole benchmark; it stops every process it started before
// returning.
func run(ctx context.Context, cfg config, out, progress io.Writer) (result, error) {
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	s := &scale{cfg: cfg, progress: progress}
	bin, err := filepath.Abs(cfg.bin)
	if err != nil {
		return s.res, fmt.Errorf("--bin %s: %w", cfg.bin, err)
	}
	if _, err := os.Stat(bin); err != nil {
		return s.res, fmt.Errorf("--bin: %w", err)
	}
	s.cfg.bin = bin
	s.dir, err = os.MkdirTemp("", "kscale")
	if err != nil {
		return s.res, fmt.Errorf("work dir: %w", err)
	}
	defer func() {
		if cfg.keep || s.res.failed > 0 {
			fmt.Fprintf(out, "work dir kept (certificates, logs): %s\n", s.dir)
			return
		}
		os.RemoveAll(s.dir)
	}()
	nofile := raiseNofile()
	fmt.Fprintf(out, "machine: %d CPUs, load average %s, RLIMIT_NOFILE %d; %s\n", runtime.NumCPU(), benchproc.LoadAvg(), nofile, runtime.Version())
	fmt.Fprintf(out, "sizes: %d agents, %d tunnels requested, %d dials per latency figure\n", cfg.agents, cfg.tunnels, cfg.dials)
	if s.pki, err = benchpki.Mint(s.dir, "scale"); err != nil {
		return s.res, err
	}
	var plan []*doorRun
	for _, door := range cfg.doors {
		d := &doorRun{s: s, door: door, label: door, nofile: int64(nofile), serverBin: s.cfg.bin, simRole: "agents"}
		if cfg.upstream {
			d.label, d.simRole = door+" (upstream-protocol agents)", "upstream-agents"
		}
		plan = append(plan, d)
	}
	if cfg.other != "" {
		for _, door := range cfg.doors {
			d := &doorRun{s: s, door: door, label: "other " + door, nofile: int64(nofile), serverBin: cfg.other, other: true, simRole: "agents"}
			if cfg.otherIsDir {
				d.serverBin, d.upstreamServer, d.simRole = filepath.Join(cfg.other, "proxy-server"), true, "upstream-agents"
			} else if cfg.upstream {
				d.label, d.simRole = d.label+" (upstream-protocol agents)", "upstream-agents"
			}
			plan = append(plan, d)
		}
	}
	var doors []*doorRun
	for _, d := range plan {
		if ctx.Err() != nil {
			break
		}
		s.logf("== %s (load %s)", d.label, benchproc.LoadAvg())
		err := d.run(ctx)
		d.stop()
		if err != nil {
			d.check("run", false, err.Error())
		}
		doors = append(doors, d)
	}
	if ctx.Err() != nil {
		s.check("run completed", false, context.Cause(ctx).Error())
	}
	printTable(out, cfg, doors)
	for _, n := range s.notes {
		fmt.Fprintln(out, n)
	}
	for _, f := range s.failures {
		fmt.Fprintf(out, "FAIL %s\n", f)
	}
	return s.res, nil
}

// doorRun is one server run through one front door, and its figures.
type doorRun struct {
	s              *scale
	door           string // http-connect or grpc
	label          string // column of the table
	nofile         int64
	serverBin      string
	other          bool   // the server is --other: its failures are reported, not counted
	upstreamServer bool   // the server is upstream's proxy-server, run without the server subcommand
	simRole        string // helper role of the agent simulators: agents or upstream-agents

	server     *proc
	ref        launched // the reference server, with one agent (startReference)
	refSim     *helper  // the reference's agent
	adminPort  int
	sock       string
	dial       dialer
	sims       []*helper
	simRanges  [][2]int // agents [from, to) of each simulator
	echoes     []*helper
	echoAddrs  []string
	agentsAddr string

	// Figures; zero when not reached.
	rss1, rssPre, rssN, rssM   int64 // server KiB: 1 agent, after its dials, N agents, N agents + held tunnels
	g1, gN, gM                 float64
	lat1, latN, latM           latency
	ref1, refN, refM           latency // the reference's, interleaved with lat1, latN, latM
	connectTime                time.Duration
	connectPolled              time.Duration
	connectCurve               []int64 // connections made per curveStep from the fleet's start
	connectCPU, connectSimCPU  float64 // CPU seconds of the server and of the simulators while the fleet connected
	refused                    float64
	fleet                      simStat // simulators after the fleet connected
	fleetM                     simStat // simulators with the tunnels held
	echoRSS                    int64
	cpuN, cpuM                 float64 // server CPU, % of one core
	held, heldWanted, heldErrs int
	heldWhy                    string
	openTime                   time.Duration
	heldFirstErr               error
}

// simStat sums the simulators' stat answers.
type simStat struct {
	agents, connected, connects, failures, retried2, open, goroutines, rssKiB int64
	maxFailures, lastConnect                                                  int64
	errors                                                                    map[string]int64 // most frequent connection error of each simulator: count
}

func (d *doorRun) run(ctx context.Context) error {
	cfg := d.s.cfg
	if err := d.startServer(ctx); err != nil {
		return err
	}
	if err := d.startHelpers(ctx); err != nil {
		return err
	}
	if err := d.startReference(ctx); err != nil {
		return err
	}
	// One agent.
	if _, err := d.sims[0].call(ctx, "start 0 1"); err != nil {
		return err
	}
	if err := d.waitAgents(ctx, 1, time.Minute); err != nil {
		return err
	}
	settle(ctx, time.Second)
	d.rss1, _ = benchproc.RSSKiB(d.server.PID())
	d.g1 = d.metric(ctx, mGoroutines)
	target := d.echoAddrs[0]
	d.collectHelpers(ctx)
	d.lat1, d.ref1 = measureLatency(ctx, d.dial, d.ref.dial, target, cfg.dials)
	if ctx.Err() != nil {
		return nil // run reports the interruption; no check past it
	}
	d.check(fmt.Sprintf("%d dials with 1 agent", cfg.dials), d.lat1.errs == 0, errDetail(d.lat1.errs, d.lat1.firstErr))
	settle(ctx, time.Second)

	// The fleet, all at once, as after a server restart.
	d.rssPre, _ = benchproc.RSSKiB(d.server.PID())
	refused0 := d.metric(ctx, mRefused)
	srvCPU0, simCPU0 := d.cpuSeconds()
	t0 := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, len(d.sims))
	for i, h := range d.sims {
		from, to := d.simRanges[i][0], d.simRanges[i][1]
		if i == 0 {
			from = 1
		}
		if from >= to {
			continue
		}
		wg.Add(1)
		go func() { // owned by run: waited for below
			defer wg.Done()
			_, errs[i] = h.call(ctx, fmt.Sprintf("start %d %d", from, to))
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	st, err := d.pollFleet(ctx, cfg.agents, cfg.connectBy)
	d.connectPolled = time.Since(t0)
	srvCPU1, simCPU1 := d.cpuSeconds()
	d.connectCPU, d.connectSimCPU = srvCPU1-srvCPU0, simCPU1-simCPU0
	d.fleet = st
	if st.lastConnect > 0 {
		d.connectTime = time.Unix(0, st.lastConnect).Sub(t0)
		d.connectCurve = d.curve(ctx, t0, d.connectTime)
	}
	if ctx.Err() != nil {
		return nil
	}
	d.check(fmt.Sprintf("%d agents connected", cfg.agents), err == nil, errStr(err))
	if err != nil {
		return nil
	}
	if err := d.waitAgents(ctx, cfg.agents, time.Minute); err != nil {
		return err
	}
	if r, ok := d.metricOK(ctx, mRefused); ok {
		d.refused = r - refused0
	} else {
		d.refused = -1 // not counted by this server
	}
	settle(ctx, cfg.afterBurst)
	d.rssN, _ = benchproc.RSSKiB(d.server.PID())
	d.gN = d.metric(ctx, mGoroutines)
	d.cpuN = d.idleCPU(ctx)
	d.collectHelpers(ctx)
	d.latN, d.refN = measureLatency(ctx, d.dial, d.ref.dial, target, cfg.dials)
	if ctx.Err() != nil {
		return nil
	}
	d.check(fmt.Sprintf("%d dials with %d agents", cfg.dials, cfg.agents), d.latN.errs == 0, errDetail(d.latN.errs, d.latN.firstErr))

	// The held tunnels.
	if cfg.tunnels == 0 {
		return nil
	}
	h, err := d.holder()
	if err != nil {
		return err
	}
	defer h.close()
	t1 := time.Now()
	d.heldErrs, d.heldFirstErr = openAll(ctx, h, d.echoAddrs, d.heldWanted, 64)
	d.openTime = time.Since(t1)
	if ctx.Err() != nil {
		return nil
	}
	d.held = d.heldWanted - d.heldErrs
	d.check(fmt.Sprintf("%d idle tunnels opened, each echoed a byte", d.heldWanted), d.heldErrs == 0, errDetail(d.heldErrs, d.heldFirstErr))
	settle(ctx, cfg.afterBurst)
	d.rssM, _ = benchproc.RSSKiB(d.server.PID())
	d.gM = d.metric(ctx, mGoroutines)
	est, estOK := d.metricOK(ctx, mEstablished)
	d.check("server counts the held tunnels", estOK && int(est) == d.held, fmt.Sprintf("established %v (series present %v), held %d", est, estOK, d.held))
	d.fleetM, _ = d.simStats(ctx)
	d.check("agents carry the held tunnels", int(d.fleetM.open) == d.held, fmt.Sprintf("open at agents %d, held %d", d.fleetM.open, d.held))
	for _, e := range d.echoes {
		if a, err := e.call(ctx, "stat"); err == nil {
			d.echoRSS += kvInt(kv(a), "rss_kib")
		}
	}
	d.cpuM = d.idleCPU(ctx)
	d.collectHelpers(ctx)
	d.latM, d.refM = measureLatency(ctx, d.dial, d.ref.dial, target, cfg.dials)
	if ctx.Err() != nil {
		return nil
	}
	d.check(fmt.Sprintf("%d dials with %d agents and %d tunnels held", cfg.dials, cfg.agents, d.held), d.latM.errs == 0, errDetail(d.latM.errs, d.latM.firstErr))

	h.close()
	var left float64
	ok := waitFor(ctx, time.Minute, func() bool {
		left = d.metric(ctx, mEstablished)
		return left == 0
	})
	d.check("every held tunnel closed at the server", ok, fmt.Sprintf("%v still established a minute after closing", left))
	return nil
}

func (d *doorRun) startServer(ctx context.Context) error {
	srv, err := d.launch(ctx, d.tag())
	if err != nil {
		return err
	}
	d.server, d.adminPort, d.sock, d.agentsAddr, d.dial = srv.proc, srv.adminPort, srv.sock, srv.agentsAddr, srv.dial
	d.s.logf("%s: server %s pid %d, agents at %s, socket %s", d.label, d.serverBin, d.server.PID(), d.agentsAddr, d.sock)
	return nil
}

// launched is a server process of a run.
type launched struct {
	proc       *proc
	adminPort  int
	sock       string
	agentsAddr string
	dial       dialer
}

// launch starts a server for this door, its files named by tag, and waits
// until it is healthy.
func (d *doorRun) launch(ctx context.Context, tag string) (launched, error) {
	s := d.s
	var l launched
	ports := make([]int, 3)
	for i := range ports {
		p, err := benchproc.FreePort()
		if err != nil {
			return l, err
		}
		ports[i] = p
	}
	agentPort, health := ports[0], ports[1]
	l.adminPort = ports[2]
	l.sock = filepath.Join(s.dir, tag+".sock")
	l.agentsAddr = "127.0.0.1:" + strconv.Itoa(agentPort)
	args := []string{
		"--mode=" + d.door,
		"--uds-name=" + l.sock,
		"--server-port=0",
		"--agent-bind-address=127.0.0.1",
		"--agent-port=" + strconv.Itoa(agentPort),
		"--cluster-cert=" + s.pki.ServerCert,
		"--cluster-key=" + s.pki.ServerKey,
		"--cluster-ca-cert=" + s.pki.CACert,
		"--health-bind-address=127.0.0.1",
		"--health-port=" + strconv.Itoa(health),
		"--admin-bind-address=127.0.0.1",
		"--admin-port=" + strconv.Itoa(l.adminPort),
	}
	if !d.upstreamServer {
		// The fleet logs in from one address with one certificate.
		args = append([]string{"server", "--max-agent-connections-per-credential=0"}, args...)
	}
	var err error
	l.proc, err = benchproc.Start("server", d.serverBin, args, filepath.Join(s.dir, tag+"-server.log"))
	if err != nil {
		return l, err
	}
	l.proc.StopAfter = stopTimeout // a server with thousands of agents and tunnels drains longer
	if err := benchproc.WaitHTTP(ctx, l.proc, health, "/healthz", readyTimeout); err != nil {
		l.proc.Stop()
		return l, err
	}
	l.dial = connectDialer(l.sock)
	if d.door == "grpc" {
		l.dial = grpcDialer(l.sock)
	}
	return l, nil
}

// startReference starts the reference: a second server of this door with
// one agent (its own simulator process) for the whole run. Each latency
// figure interleaves its dials with dials through the reference, so the
// ratio to one agent is taken under the same load of the machine.
func (d *doorRun) startReference(ctx context.Context) error {
	s := d.s
	ref, err := d.launch(ctx, d.tag()+"-ref")
	if err != nil {
		return err
	}
	d.ref = ref
	args := simArgs{Server: ref.agentsAddr, CACert: s.pki.CACert, AgentCert: s.pki.AgentCert, AgentKey: s.pki.AgentKey}
	d.refSim, _, err = startHelper(ctx, "reference simulator", d.simRole, args, filepath.Join(s.dir, d.tag()+"-ref-sim.log"))
	if err != nil {
		return err
	}
	if _, err := d.refSim.call(ctx, "start 0 1"); err != nil {
		return err
	}
	var got float64
	if !waitFor(ctx, time.Minute, func() bool {
		m, _ := scrape(ctx, ref.adminPort, mAgents)
		got = m[mAgents]
		return got == 1
	}) {
		return fmt.Errorf("reference server counts %v agents, want 1, after a minute; log tail:\n%s", got, ref.proc.LogTail(10))
	}
	s.logf("%s: reference server pid %d with one agent (simulator pid %d)", d.label, ref.proc.PID(), d.refSim.pid())
	return nil
}

// startHelpers starts the echo destinations and the agent simulators,
// as many of each as the descriptor budgets ask for.
func (d *doorRun) startHelpers(ctx context.Context) error {
	s, cfg := d.s, d.s.cfg
	d.heldWanted = cfg.tunnels
	if d.door == "http-connect" {
		// One Unix socket per tunnel in the server and in this process.
		srvLimit, err := nofileOf(d.server.PID())
		if err != nil {
			return err
		}
		room := int(min(srvLimit, d.nofile)) - cfg.agents - fdReserve
		if room < d.heldWanted {
			d.heldWanted = max(0, room)
			d.heldWhy = fmt.Sprintf("of %d: descriptor limit %d of server and client", cfg.tunnels, min(srvLimit, d.nofile))
		}
	}
	// A simulator holds its agents' server connections and the destination
	// sockets of the tunnels they serve; an echo process, destination sockets.
	// Within 60% of the descriptor limit: the tunnels spread over agents
	// unevenly, and dials come and go.
	budget := max(1, min(cfg.fdsPerHelper, int(d.nofile)*6/10))
	nEcho := max(1, (d.heldWanted+budget-1)/budget)
	nSim := max(1, (cfg.agents+d.heldWanted+budget-1)/budget)
	for i := range nEcho {
		// Each destination on its own loopback address: the agents' sockets
		// toward it have their own ephemeral port range.
		bind := fmt.Sprintf("127.0.0.%d", 10+i)
		h, addr, err := startHelper(ctx, fmt.Sprintf("echo %d", i), "echo", echoArgs{Bind: bind}, filepath.Join(s.dir, fmt.Sprintf("%s-echo%d.log", d.tag(), i)))
		if err != nil {
			return err
		}
		d.echoes = append(d.echoes, h)
		d.echoAddrs = append(d.echoAddrs, addr)
	}
	args := simArgs{Server: d.agentsAddr, CACert: s.pki.CACert, AgentCert: s.pki.AgentCert, AgentKey: s.pki.AgentKey}
	for i := range nSim {
		h, _, err := startHelper(ctx, fmt.Sprintf("simulator %d", i), d.simRole, args, filepath.Join(s.dir, fmt.Sprintf("%s-sim%d.log", d.tag(), i)))
		if err != nil {
			return err
		}
		d.sims = append(d.sims, h)
		d.simRanges = append(d.simRanges, [2]int{i * cfg.agents / nSim, (i + 1) * cfg.agents / nSim})
	}
	var pids []int
	for _, h := range append(append([]*helper{}, d.sims...), d.echoes...) {
		pids = append(pids, h.pid())
	}
	s.logf("%s: %d simulator and %d echo processes (pids %v), echo at %v; %d tunnels to hold", d.label, nSim, nEcho, pids, d.echoAddrs, d.heldWanted)
	return nil
}

// tag names this run's files.
func (d *doorRun) tag() string {
	if d.other {
		return "other-" + d.door
	}
	return d.door
}

func (d *doorRun) holder() (holder, error) {
	if d.door == "grpc" {
		return newGRPCHolder(d.sock, d.heldWanted)
	}
	return &connectHolder{dial: d.dial}, nil
}

// stop stops every process of this run: simulators first (their agents
// drain), then destinations, then the server.
func (d *doorRun) stop() {
	var wg sync.WaitGroup
	helpers := append(append([]*helper{}, d.sims...), d.echoes...)
	if d.refSim != nil {
		helpers = append(helpers, d.refSim)
	}
	for _, h := range helpers {
		wg.Add(1)
		go func() { // owned by stop
			defer wg.Done()
			h.stop()
		}()
	}
	wg.Wait()
	if d.server != nil {
		d.server.Stop()
	}
	if d.ref.proc != nil {
		d.ref.proc.Stop()
	}
}

// metric reads one series from the server's /metrics: 0 when absent or
// unreadable (the checks that use it then fail visibly).
func (d *doorRun) metric(ctx context.Context, name string) float64 {
	v, _ := d.metricOK(ctx, name)
	return v
}

// metricOK reads one series and says whether the server has it.
func (d *doorRun) metricOK(ctx context.Context, name string) (float64, bool) {
	m, err := scrape(ctx, d.adminPort, name)
	if err != nil {
		d.s.logf("%s: scrape %s: %v", d.label, name, err)
	}
	v, ok := m[name]
	return v, ok
}

// check records a correctness check of this run; in a run of the other
// implementation a failure is reported below the table, not counted.
func (d *doorRun) check(name string, ok bool, detail string) {
	name = d.label + ": " + name
	if !d.other || ok {
		d.s.check(name, ok, detail)
		return
	}
	if detail != "" {
		name += ": " + detail
	}
	d.s.logf("note %s", name)
	d.s.notes = append(d.s.notes, "not met by the other implementation: "+name)
}

// waitAgents waits until the server counts n connected agents.
func (d *doorRun) waitAgents(ctx context.Context, n int, bound time.Duration) error {
	var got float64
	if waitFor(ctx, bound, func() bool {
		got = d.metric(ctx, mAgents)
		return int(got) == n
	}) {
		return nil
	}
	return fmt.Errorf("server counts %v agents, want %d, after %v; log tail:\n%s", got, n, bound, d.server.LogTail(10))
}

// pollFleet polls the simulators until n agents hold a connection.
func (d *doorRun) pollFleet(ctx context.Context, n int, bound time.Duration) (simStat, error) {
	var st simStat
	var err error
	// Every 250 ms: a stat walks every agent of a simulator, CPU taken from
	// the handshakes being timed; the time to connect is read from the
	// agents' connection events, not from the poll.
	ok := waitEvery(ctx, bound, 250*time.Millisecond, func() bool {
		st, err = d.simStats(ctx)
		return err == nil && st.connected == int64(n)
	})
	if !ok {
		return st, fmt.Errorf("%d of %d agents connected after %v (err %v)", st.connected, n, bound, err)
	}
	return st, nil
}

// curveStep is the width of a step of the fleet's connection curve.
const curveStep = 250 * time.Millisecond

// curve sums the simulators' connections made per curveStep from t0
// over span: where the fleet's connect time went (a ramp, a plateau at
// the handshake rate, a tail of retries).
func (d *doorRun) curve(ctx context.Context, t0 time.Time, span time.Duration) []int64 {
	n := int(span/curveStep) + 1
	sum := make([]int64, n)
	for _, h := range d.sims {
		a, err := h.call(ctx, fmt.Sprintf("curve %d %d %d", t0.UnixNano(), curveStep.Milliseconds(), n))
		counts, ok := strings.CutPrefix(a, "curve ")
		if err != nil || !ok {
			return nil
		}
		for i, c := range strings.Split(counts, ",") {
			v, err := strconv.ParseInt(c, 10, 64)
			if err != nil || i >= n {
				return nil
			}
			sum[i] += v
		}
	}
	return sum
}

func (d *doorRun) simStats(ctx context.Context) (simStat, error) {
	var st simStat
	for _, h := range d.sims {
		a, err := h.call(ctx, "stat")
		if err != nil {
			return st, err
		}
		m := kv(a)
		st.agents += kvInt(m, "agents")
		st.connected += kvInt(m, "connected")
		st.connects += kvInt(m, "connects")
		st.failures += kvInt(m, "failures")
		st.retried2 += kvInt(m, "retried2")
		st.open += kvInt(m, "open")
		st.goroutines += kvInt(m, "goroutines")
		st.rssKiB += kvInt(m, "rss_kib")
		st.maxFailures = max(st.maxFailures, kvInt(m, "max_failures"))
		st.lastConnect = max(st.lastConnect, kvInt(m, "last_connect"))
		if n, kind, ok := strings.Cut(m["errors"], "x:"); ok {
			if st.errors == nil {
				st.errors = map[string]int64{}
			}
			c, _ := strconv.ParseInt(n, 10, 64)
			st.errors[strings.ReplaceAll(kind, "_", " ")] += c
		}
	}
	return st, nil
}

// collectHelpers has every simulator and echo process collect its garbage
// before a latency figure. A simulator holds thousands of agents in one
// heap of hundreds of MiB, whose collection (a mark phase of 0.3–1.5 s on
// this machine) slows every agent in it; a real agent, alone in its
// process, has a heap of a few MiB. Collecting first keeps that cost of
// the simulator out of the dials; the servers are not touched.
func (d *doorRun) collectHelpers(ctx context.Context) {
	helpers := append(append([]*helper{}, d.sims...), d.echoes...)
	if d.refSim != nil {
		helpers = append(helpers, d.refSim)
	}
	for _, h := range helpers {
		if _, err := h.call(ctx, "gc"); err != nil {
			d.s.logf("%s: gc in %s: %v", d.label, h.name, err)
		}
	}
}

// cpuSeconds returns the CPU time used so far by the server and by the
// simulators together.
func (d *doorRun) cpuSeconds() (server, sims float64) {
	if t, err := benchproc.CPUTicks(d.server.PID()); err == nil {
		server = float64(t) / clockTicks
	}
	for _, h := range d.sims {
		if t, err := benchproc.CPUTicks(h.pid()); err == nil {
			sims += float64(t) / clockTicks
		}
	}
	return server, sims
}

// idleCPU is the server's CPU over cfg.idleCPU, in % of one core.
func (d *doorRun) idleCPU(ctx context.Context) float64 {
	t0, err := benchproc.CPUTicks(d.server.PID())
	if err != nil {
		return -1
	}
	start := time.Now()
	settle(ctx, d.s.cfg.idleCPU)
	t1, err := benchproc.CPUTicks(d.server.PID())
	if err != nil {
		return -1
	}
	return float64(t1-t0) / clockTicks / time.Since(start).Seconds() * 100
}

// waitFor polls cond every 50 ms until it holds, ctx ends or bound passes.
func waitFor(ctx context.Context, bound time.Duration, cond func() bool) bool {
	return waitEvery(ctx, bound, 50*time.Millisecond, cond)
}

// waitEvery polls cond every interval until it holds, ctx ends or bound
// passes.
func waitEvery(ctx context.Context, bound, interval time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(bound)
	for {
		if cond() {
			return true
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return false
		}
		settle(ctx, interval)
	}
}

// settle waits d or until ctx ends.
func settle(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

func errStr(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func errDetail(n int, first error) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf("%d failed, first: %v", n, first)
}
