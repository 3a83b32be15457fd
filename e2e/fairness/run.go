package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchdial"
	"github.com/spinifex/konnectivity/e2e/internal/benchpki"
	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

// row is one line of the table: a shaped link (rate and queue bound) or
// a long one (the relay's hold each way), and the bulk tunnels beside
// the probe. The targets are the ones this project is held to.
type row struct {
	name    string
	label   string
	rate    string        // tbf rate; "" for an unshaped veth
	queue   time.Duration // tbf queue bound (its latency)
	hold    time.Duration // the relay's hold each way; 0: no relay
	bulk    int
	p99     time.Duration // target: probe p99 beside the bulk at most this; 0 for none
	minMBps float64       // target: bulk at least this; 0 for none
	vsOther bool          // target: bulk at least the other build's
}

var rows = []row{
	{name: "unshaped", label: "unshaped veth", bulk: 1, p99: 10 * time.Millisecond, vsOther: true},
	{name: "1g", label: "1 Gbit / 5 ms", rate: "1gbit", queue: 5 * time.Millisecond, bulk: 1, p99: 15 * time.Millisecond, minMBps: 100},
	{name: "100m", label: "100 Mbit / 20 ms", rate: "100mbit", queue: 20 * time.Millisecond, bulk: 1},
	{name: "100m4", label: "100 Mbit / 20 ms", rate: "100mbit", queue: 20 * time.Millisecond, bulk: 4, p99: 30 * time.Millisecond, minMBps: 10},
	{name: "20m", label: "20 Mbit / 50 ms", rate: "20mbit", queue: 50 * time.Millisecond, bulk: 1, p99: 60 * time.Millisecond, minMBps: 2},
	{name: "rtt20", label: "relay, 20 ms round trip", hold: 10 * time.Millisecond, bulk: 1},
	{name: "rtt50", label: "relay, 50 ms round trip", hold: 25 * time.Millisecond, bulk: 1, p99: 60 * time.Millisecond, vsOther: true},
}

func rowNames() []string {
	var n []string
	for _, r := range rows {
		n = append(n, r.name)
	}
	return n
}

func findRow(name string) *row {
	for i := range rows {
		if rows[i].name == name {
			return &rows[i]
		}
	}
	return nil
}

// build is one implementation under test: its server in the control
// plane namespace, its agent in the node namespace.
type build struct {
	label         string
	serverBin     string
	agentBin      string
	serverPre     []string // before the upstream flags: "server" for ours
	agentPre      []string
	port, base    int // the agent port; health and admin ports from base
	sock          string
	server, agent *benchproc.Proc
	agentN        int
}

// result is one row measured on one build.
type result struct {
	alone50, alone99 time.Duration
	p50, p99         time.Duration
	mbps             float64
	err              error
}

type runner struct {
	cfg    config
	out    io.Writer
	dir    string
	tb     *testbed
	pki    *benchpki.PKI
	self   string // this program, run again in the node namespace
	builds []*build
	relay  *benchproc.Proc
	back   *benchproc.Proc
}

func run(ctx context.Context, cfg config, out io.Writer) (failed int, err error) {
	if os.Geteuid() != 0 {
		return 0, errors.New("needs root: it makes network namespaces and shapes a veth with tc")
	}
	r := &runner{cfg: cfg, out: out}
	if r.self, err = os.Executable(); err != nil {
		return 0, err
	}
	if r.dir, err = os.MkdirTemp("", "kfair-"); err != nil {
		return 0, err
	}
	if !cfg.keep {
		defer os.RemoveAll(r.dir)
	} else {
		fmt.Fprintf(out, "work directory: %s\n", r.dir)
	}
	r.builds = []*build{r.ours("this project", cfg.bin, 8091, 8100)}
	if cfg.other != "" {
		b, err := r.otherBuild(cfg.other)
		if err != nil {
			return 0, err
		}
		r.builds = append(r.builds, b)
	}
	if r.pki, err = benchpki.MintSpec(r.dir, benchpki.Spec{CAName: "kfair-ca", AgentName: "kfair-agent", IPs: []net.IP{net.ParseIP(cpIP)}}); err != nil {
		return 0, err
	}
	if r.tb, err = newTestbed(ctx); err != nil {
		return 0, err
	}
	defer r.tb.close()
	defer r.stopAll()
	fmt.Fprintf(out, "machine: %d CPUs, load average at start %s\n", runtime.NumCPU(), benchproc.LoadAvg())
	fmt.Fprintf(out, "namespaces %s (server, client socket) and %s (agent, source, echo); per row: probe alone %v, bulk %v before, probe and bulk together %v\n",
		r.tb.cp, r.tb.node, cfg.alone, cfg.warm, cfg.measure)
	if err := r.startCommon(ctx); err != nil {
		return 0, err
	}
	want := splitList(cfg.rows)
	results := map[string][]result{}
	hold := time.Duration(-1)
	for _, rw := range rows {
		if len(want) > 0 && !slices.Contains(want, rw.name) {
			continue
		}
		if err := ctx.Err(); err != nil {
			return failed, err
		}
		if rw.hold != hold {
			if err := r.startAgents(ctx, rw.hold); err != nil {
				return failed, err
			}
			hold = rw.hold
		}
		if err := r.tb.shape(ctx, rw.rate, rw.queue); err != nil {
			return failed, err
		}
		for _, b := range r.builds {
			res := measure(ctx, cfg, b.sock, rw.bulk)
			if res.err != nil {
				failed++
				fmt.Fprintf(out, "row %s, %s: %v\n", rw.name, b.label, res.err)
			}
			fmt.Fprintf(out, "  %-24s %-14s bulk %d: %s\n", rw.label, b.label, rw.bulk, res.cell(true))
			results[rw.name] = append(results[rw.name], res)
		}
	}
	r.tb.shape(ctx, "", 0)
	fmt.Fprintf(out, "load average at end %s\n\n", benchproc.LoadAvg())
	r.table(results)
	return failed, nil
}

func (r *runner) ours(label, bin string, port, base int) *build {
	return &build{label: label, serverBin: bin, agentBin: bin, serverPre: []string{"server", "--agent-wait=5s"}, agentPre: []string{"agent"}, port: port, base: base}
}

func (r *runner) otherBuild(other string) (*build, error) {
	st, err := os.Stat(other)
	if err != nil {
		return nil, fmt.Errorf("--other: %w", err)
	}
	abs, _ := filepath.Abs(other)
	if !st.IsDir() {
		return r.ours("other ("+filepath.Base(abs)+")", abs, 8191, 8200), nil
	}
	b := &build{label: "other (" + filepath.Base(abs) + ")", serverBin: filepath.Join(abs, "proxy-server"), agentBin: filepath.Join(abs, "proxy-agent"), port: 8191, base: 8200}
	for _, p := range []string{b.serverBin, b.agentBin} {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("--other %s: %w", other, err)
		}
	}
	return b, nil
}

// inNS starts bin in namespace ns with env set.
func (r *runner) inNS(name, ns string, env []string, bin string, args []string) (*benchproc.Proc, error) {
	a := append([]string{"netns", "exec", ns, "env"}, env...)
	a = append(a, bin)
	a = append(a, args...)
	return benchproc.Start(name, "ip", a, filepath.Join(r.dir, strings.ReplaceAll(name, " ", "-")+".log"))
}

// startCommon starts what lives for the whole run: the node's backends
// and each build's server.
func (r *runner) startCommon(ctx context.Context) error {
	var err error
	if r.back, err = r.inNS("backends", r.tb.node, []string{nodeEnv + "=backends"}, r.self, nil); err != nil {
		return err
	}
	for i, b := range r.builds {
		b.sock = filepath.Join(r.dir, fmt.Sprintf("server%d.sock", i))
		args := append(slices.Clone(b.serverPre),
			"--mode=http-connect",
			"--uds-name="+b.sock,
			"--server-port=0",
			"--agent-bind-address="+cpIP,
			"--agent-port="+strconv.Itoa(b.port),
			"--cluster-cert="+r.pki.ServerCert,
			"--cluster-key="+r.pki.ServerKey,
			"--cluster-ca-cert="+r.pki.CACert,
			"--health-bind-address=127.0.0.1",
			"--health-port="+strconv.Itoa(b.base+2),
			"--admin-bind-address=127.0.0.1",
			"--admin-port="+strconv.Itoa(b.base+5),
		)
		if b.server, err = r.inNS(fmt.Sprintf("server %d", i), r.tb.cp, nil, b.serverBin, args); err != nil {
			return err
		}
	}
	return nil
}

// startAgents (re)starts each build's agent: straight to its server, or
// through a relay holding bytes for hold each way (restarted too).
func (r *runner) startAgents(ctx context.Context, hold time.Duration) error {
	for _, b := range r.builds {
		if b.agent != nil {
			b.agent.Stop()
			b.agent = nil
		}
	}
	if r.relay != nil {
		r.relay.Stop()
		r.relay = nil
	}
	var env []string
	if hold > 0 {
		var err error
		if r.relay, err = r.inNS("relay", r.tb.node, []string{nodeEnv + "=relay=" + hold.String()}, r.self, nil); err != nil {
			return err
		}
		env = []string{"HTTPS_PROXY=http://" + relayAddr, "https_proxy=http://" + relayAddr, "NO_PROXY=", "no_proxy="}
	}
	for i, b := range r.builds {
		b.agentN++
		args := append(slices.Clone(b.agentPre),
			"--proxy-server-host="+cpIP,
			"--proxy-server-port="+strconv.Itoa(b.port),
			"--ca-cert="+r.pki.CACert,
			"--agent-cert="+r.pki.AgentCert,
			"--agent-key="+r.pki.AgentKey,
			"--agent-id=fairness",
			"--health-server-host=127.0.0.1",
			"--health-server-port="+strconv.Itoa(b.base+3),
			"--admin-server-port="+strconv.Itoa(b.base+4),
		)
		var err error
		if b.agent, err = r.inNS(fmt.Sprintf("agent %d-%d", i, b.agentN), r.tb.node, env, b.agentBin, args); err != nil {
			return err
		}
	}
	for _, b := range r.builds {
		if err := waitTunnel(ctx, b); err != nil {
			return err
		}
	}
	return nil
}

// waitTunnel waits until a tunnel through b reaches the echo backend: the
// server is up and the agent connected.
func waitTunnel(ctx context.Context, b *build) error {
	deadline := time.Now().Add(30 * time.Second)
	var last error
	for time.Now().Before(deadline) {
		for _, p := range []*benchproc.Proc{b.server, b.agent} {
			if p.Exited() {
				return fmt.Errorf("%s: %s exited (%v); log tail:\n%s", b.label, p.Name, p.WaitErr(), p.LogTail(20))
			}
		}
		c, err := benchdial.Connect(ctx, b.sock, echoAddr, 5*time.Second)
		if err == nil {
			_, err = probeOnce(c, make([]byte, 64))
			c.Close()
			if err == nil {
				return nil
			}
		}
		last = err
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("%s: no tunnel to the echo backend within 30 s (last: %v); server log:\n%s\nagent log:\n%s", b.label, last, b.server.LogTail(10), b.agent.LogTail(10))
}

func (r *runner) stopAll() {
	var all []*benchproc.Proc
	for _, b := range r.builds {
		all = append(all, b.agent, b.server)
	}
	all = append(all, r.relay, r.back)
	for _, p := range all {
		if p != nil {
			p.Stop()
		}
	}
}

// probeOnce sends buf and reads it back: one round trip.
func probeOnce(c net.Conn, buf []byte) (time.Duration, error) {
	c.SetDeadline(time.Now().Add(10 * time.Second))
	start := time.Now()
	if _, err := c.Write(buf); err != nil {
		return 0, fmt.Errorf("probe write: %w", err)
	}
	got := make([]byte, len(buf))
	if _, err := io.ReadFull(c, got); err != nil {
		return 0, fmt.Errorf("probe read: %w", err)
	}
	d := time.Since(start)
	if string(got) != string(buf) {
		return 0, errors.New("probe: the echo came back different")
	}
	return d, nil
}

// probeGap is the time between two probes.
const probeGap = 10 * time.Millisecond

// probeFor sends a 64-byte probe every probeGap for d, without waiting for
// the ones on their way (on a link whose round trip is longer than the gap
// several are), and times each one's echo: a long link gives as many
// samples as a short one, so that a p99 is a percentile there too, not
// the worst of a few. Each probe carries its sequence number, so an echo
// out of order or changed is an error.
func probeFor(ctx context.Context, c net.Conn, d time.Duration) ([]time.Duration, error) {
	c.SetDeadline(time.Now().Add(d + 10*time.Second))
	defer c.SetDeadline(time.Time{})
	type sent struct {
		seq uint64
		at  time.Time
	}
	// Buffered for every probe of the run: the sender never waits on the
	// reader, whose pace is the link's.
	queued := make(chan sent, int(d/probeGap)+2)
	stop := make(chan struct{})
	sendErr := make(chan error, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(queued)
		tick := time.NewTicker(probeGap)
		defer tick.Stop()
		buf := make([]byte, 64)
		for seq, end := uint64(0), time.Now().Add(d); time.Now().Before(end); seq++ {
			probeBytes(buf, seq)
			at := time.Now()
			if _, err := c.Write(buf); err != nil {
				sendErr <- fmt.Errorf("probe write: %w", err)
				return
			}
			queued <- sent{seq, at}
			select {
			case <-ctx.Done():
				sendErr <- ctx.Err()
				return
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	defer wg.Wait()
	defer close(stop)
	var rtts []time.Duration
	got, want := make([]byte, 64), make([]byte, 64)
	for s := range queued {
		if _, err := io.ReadFull(c, got); err != nil {
			return rtts, fmt.Errorf("probe read: %w", err)
		}
		rtts = append(rtts, time.Since(s.at))
		if probeBytes(want, s.seq); string(got) != string(want) {
			return rtts, fmt.Errorf("probe %d: the echo came back different or out of order", s.seq)
		}
	}
	select {
	case err := <-sendErr:
		return rtts, err
	default:
		return rtts, nil
	}
}

// probeBytes fills buf with probe seq: its number, then a pattern of it.
func probeBytes(buf []byte, seq uint64) {
	binary.BigEndian.PutUint64(buf, seq)
	for i := 8; i < len(buf); i++ {
		buf[i] = byte(seq) + byte(i)
	}
}

// settle waits until the link is quiet (what the row before left in
// flight has drained): ten round trips in a row under 5 ms, within 10 s.
func settle(ctx context.Context, c net.Conn) error {
	buf := make([]byte, 64)
	quick := 0
	for end := time.Now().Add(10 * time.Second); quick < 10 && time.Now().Before(end); {
		rtt, err := probeOnce(c, buf)
		if err != nil {
			return err
		}
		if quick++; rtt > 5*time.Millisecond {
			quick = 0
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

func pct(s []time.Duration, p int) time.Duration {
	if len(s) == 0 {
		return 0
	}
	s = slices.Clone(s)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*p/100)]
}

// measure runs one row on one build: the probe alone, then beside n bulk
// tunnels.
func measure(ctx context.Context, cfg config, sock string, n int) (res result) {
	probe, err := benchdial.Connect(ctx, sock, echoAddr, 10*time.Second)
	if err != nil {
		res.err = err
		return res
	}
	defer probe.Close()
	if err := settle(ctx, probe); err != nil {
		res.err = err
		return res
	}
	alone, err := probeFor(ctx, probe, cfg.alone)
	if err != nil {
		res.err = err
		return res
	}
	res.alone50, res.alone99 = pct(alone, 50), pct(alone, 99)

	var got atomic.Int64
	var wg sync.WaitGroup
	var bulk []net.Conn
	defer func() {
		for _, c := range bulk {
			c.Close()
		}
		wg.Wait()
	}()
	for range n {
		c, err := benchdial.Connect(ctx, sock, sourceAddr, 10*time.Second)
		if err != nil {
			res.err = err
			return res
		}
		bulk = append(bulk, c)
		if _, err := c.Write([]byte{1}); err != nil {
			res.err = err
			return res
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 256<<10)
			for {
				k, err := c.Read(buf)
				got.Add(int64(k))
				if err != nil {
					return
				}
			}
		}()
	}
	select {
	case <-ctx.Done():
		res.err = ctx.Err()
		return res
	case <-time.After(cfg.warm):
	}
	from, start := got.Load(), time.Now()
	beside, err := probeFor(ctx, probe, cfg.measure)
	res.mbps = float64(got.Load()-from) / time.Since(start).Seconds() / 1e6
	res.p50, res.p99 = pct(beside, 50), pct(beside, 99)
	res.err = err
	return res
}

func msStr(d time.Duration) string {
	return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', 1, 64)
}

// cell is a result as the table shows it.
func (res result) cell(alone bool) string {
	s := fmt.Sprintf("%.1f MB/s, %s / %s ms", res.mbps, msStr(res.p50), msStr(res.p99))
	if alone {
		s += fmt.Sprintf(" (alone %s / %s ms)", msStr(res.alone50), msStr(res.alone99))
	}
	if res.err != nil {
		s += " (failed)"
	}
	return s
}

// verdict says whether this project's result meets the row's targets.
func (rw row) verdict(res []result) string {
	if rw.p99 == 0 && rw.minMBps == 0 && !rw.vsOther {
		return ""
	}
	var want []string
	ok := res[0].err == nil
	if rw.p99 > 0 {
		want = append(want, "p99 ≤ "+msStr(rw.p99))
		ok = ok && res[0].p99 <= rw.p99
	}
	if rw.minMBps > 0 {
		want = append(want, fmt.Sprintf("bulk ≥ %.0f MB/s", rw.minMBps))
		ok = ok && res[0].mbps >= rw.minMBps
	}
	if rw.vsOther && len(res) > 1 {
		want = append(want, "bulk ≥ other's")
		ok = ok && res[0].mbps >= res[1].mbps
	}
	if ok {
		return strings.Join(want, ", ") + ": met"
	}
	v := strings.Join(want, ", ") + ": NOT met"
	if rw.p99 > 0 && res[0].err == nil && res[0].alone99 > rw.p99 {
		// With no bulk beside it the probe crosses only the link and the
		// machine: a p99 over the target then is the machine's, and the
		// run says nothing about the row.
		v += " (the probe alone misses it too: a noisy run)"
	}
	return v
}

func (r *runner) table(results map[string][]result) {
	tw := tabwriter.NewWriter(r.out, 0, 0, 1, ' ', tabwriter.Debug)
	head := "link (tbf rate / queue bound)\tbulk tunnels"
	for _, b := range r.builds {
		head += "\t" + b.label + ": bulk, probe p50 / p99 (alone p50 / p99)"
	}
	fmt.Fprintln(tw, head+"\ttarget (this project)\t")
	for _, rw := range rows {
		res, ok := results[rw.name]
		if !ok {
			continue
		}
		line := rw.label + "\t" + strconv.Itoa(rw.bulk)
		for _, x := range res {
			line += "\t" + x.cell(false) + " (" + msStr(x.alone50) + " / " + msStr(x.alone99) + ")"
		}
		fmt.Fprintln(tw, line+"\t"+rw.verdict(res)+"\t")
	}
	tw.Flush()
}
