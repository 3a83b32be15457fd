package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
)

// swarmEnv makes the test binary run a swarm of agents in its own process,
// so the benchmark process holds only the server.
const swarmEnv = "KONNECTIVITY_TEST_AGENT_SWARM"

// runAgentSwarm runs N agents against ADDR until its stdin closes.
func runAgentSwarm() int {
	dir := os.Getenv(swarmEnv)
	n, _ := strconv.Atoi(os.Getenv("SWARM_N"))
	addr := os.Getenv("SWARM_ADDR")
	ctx, cancel := context.WithCancel(context.Background())
	running, err := runChildAgents(ctx, dir, addr, "swarm", n)
	if err != nil {
		cancel()
		fmt.Fprintln(os.Stderr, "swarm:", err)
		return 1
	}
	io.Copy(io.Discard, os.Stdin)
	cancel()
	running.Wait()
	return 0
}

// runChildAgents runs n agents (IDs prefix-0...) against addr in a
// benchmark's child process, with the key files writeAgentFiles put in
// dir, until ctx ends; the WaitGroup waits for them to stop.
func runChildAgents(ctx context.Context, dir, addr, prefix string, n int) (*sync.WaitGroup, error) {
	pool, cert, err := readAgentFiles(dir)
	if err != nil {
		return nil, err
	}
	var running sync.WaitGroup
	for i := range n {
		a, err := agent.New(agent.Config{
			ServerAddrs:  []string{addr},
			ID:           fmt.Sprintf("%s-%d", prefix, i),
			DrainTimeout: time.Second,
			TLS: func(name string) (*tls.Config, error) {
				return &tls.Config{RootCAs: pool, ServerName: name, Certificates: []tls.Certificate{cert}}, nil
			},
		})
		if err != nil {
			return &running, err
		}
		running.Add(1)
		go func() { defer running.Done(); a.Run(ctx) }()
	}
	return &running, nil
}

// writeAgentFiles writes p's CA and agent key pair into a new directory
// for a child process (readAgentFiles), and returns it.
func writeAgentFiles(tb testing.TB, p *tunneltest.PKI) string {
	tb.Helper()
	dir := tb.TempDir()
	keyDER, err := x509.MarshalPKCS8PrivateKey(p.AgentCert.PrivateKey)
	if err != nil {
		tb.Fatal(err)
	}
	for name, block := range map[string]*pem.Block{
		"ca.crt":    {Type: "CERTIFICATE", Bytes: p.Ca.Cert.Raw},
		"agent.crt": {Type: "CERTIFICATE", Bytes: p.AgentCert.Certificate[0]},
		"agent.key": {Type: "PRIVATE KEY", Bytes: keyDER},
	} {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(block), 0o600); err != nil {
			tb.Fatal(err)
		}
	}
	return dir
}

// readAgentFiles reads what writeAgentFiles wrote.
func readAgentFiles(dir string) (*x509.CertPool, tls.Certificate, error) {
	caPEM, err := os.ReadFile(filepath.Join(dir, "ca.crt"))
	if err != nil {
		return nil, tls.Certificate{}, fmt.Errorf("read CA: %w", err)
	}
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, "agent.crt"), filepath.Join(dir, "agent.key"))
	if err != nil {
		return nil, tls.Certificate{}, fmt.Errorf("read agent key pair: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	return pool, cert, nil
}

// BenchmarkIdleAgents connects 1000 agents (in another process) to one
// server and reports what each idle agent costs the server: resident
// memory, heap and stacks, and CPU over an idle minute's share.
// Run: go test -run '^$' -bench IdleAgents -benchtime 1x ./tunnel/
func BenchmarkIdleAgents(b *testing.B) {
	const agents = 1000
	for range b.N {
		p := tunneltest.NewPKI(b)
		dir := writeAgentFiles(b, p)

		runtime.GC()
		rss0, heap0 := selfRSS(), heapAndStacks()
		e := newEnvOn(b, p, "127.0.0.1:0", func(c *Config) { c.MaxStreamsPerAgent = 100 })
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), swarmEnv+"="+dir, "SWARM_N="+strconv.Itoa(agents), "SWARM_ADDR="+e.AgentAddr)
		cmd.Stderr = os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		stdin, _ := cmd.StdinPipe()
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		start := time.Now()
		deadline := start.Add(60 * time.Second)
		for e.srv.AgentCount() < agents {
			if time.Now().After(deadline) {
				stdin.Close()
				cmd.Wait()
				b.Fatalf("only %d of %d agents connected in 60s", e.srv.AgentCount(), agents)
			}
			time.Sleep(10 * time.Millisecond)
		}
		connected := time.Since(start)
		time.Sleep(2 * time.Second) // let the handshakes' garbage settle
		runtime.GC()
		rss1, heap1 := selfRSS(), heapAndStacks()
		if path := os.Getenv("KONNECTIVITY_BENCH_HEAP"); path != "" {
			if f, err := os.Create(path); err == nil {
				pprof.WriteHeapProfile(f)
				f.Close()
			}
		}
		cpu0 := selfCPU()
		const idle = 10 * time.Second
		time.Sleep(idle)
		cpu1 := selfCPU()
		stdin.Close()
		cmd.Wait()

		perRSS := float64(rss1-rss0) / agents / 1024
		perHeap := float64(heap1-heap0) / agents / 1024
		cpuPerMin := float64(cpu1-cpu0) / float64(time.Millisecond) / agents * float64(time.Minute/idle)
		b.ReportMetric(perRSS, "KiB-RSS/agent")
		b.ReportMetric(perHeap, "KiB-heap+stack/agent")
		b.ReportMetric(cpuPerMin, "ms-CPU/agent/min")
		b.Logf("%d agents connected in %s; server per idle agent: %.1f KiB RSS, %.1f KiB heap+stacks, %.3f ms CPU per minute (keepalive %s)",
			agents, connected.Round(time.Millisecond), perRSS, perHeap, cpuPerMin, e.srv.cfg.KeepAlive)
	}
}

func selfRSS() int64 {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb * 1024
		}
	}
	return 0
}

func heapAndStacks() int64 {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapInuse + m.StackInuse)
}

func selfCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestMain lets the test binary double as the agent swarm of the agent
// benchmarks (see runAgentSwarm) and as the caller of the gRPC front
// door's (see runGRPCCaller).
func TestMain(m *testing.M) {
	if os.Getenv(swarmEnv) != "" {
		os.Exit(runAgentSwarm())
	}
	if os.Getenv(grpcCallerEnv) != "" {
		os.Exit(runGRPCCaller())
	}
	os.Exit(m.Run())
}
