package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

type config struct {
	bin          string
	frontend     string // http-connect or grpc
	serverBin    string // another implementation: server and agent binaries taking upstream flags
	agentBin     string
	bytes        int64 // per throughput run
	dials        int   // figure 1
	concurrent   int   // figure 4 tunnels
	echoSize     int   // figure 4 bytes per tunnel
	idleTunnels  int   // figure 5
	holEchoes    int   // figure 6
	stallBytes   int64 // figure 6: bytes each stalled tunnel tries to move
	tunnels10k   bool
	quick        bool
	pprofDir     string
	pprofSeconds int
	timeout      time.Duration
	keep         bool // keep the work dir (certs, logs)
	phases       string
	linger       time.Duration // idle wait before a last RSS reading
	idleSteady   time.Duration // extra wait with the idle tunnels open before a second reading
	plainRelay   bool          // measure the plain TLS relay in the throughput phase
}

// wants reports whether phase key runs: --phases if given, else all but the
// optional 10k one (--tunnels10k).
func (c config) wants(key string) bool {
	if c.phases == "" {
		return key != "10k" || c.tunnels10k
	}
	for _, p := range strings.Split(c.phases, ",") {
		if strings.TrimSpace(p) == key {
			return true
		}
	}
	return false
}

func defaultConfig() config {
	return config{
		bytes:        1 << 30,
		dials:        2000,
		concurrent:   1000,
		echoSize:     64 << 10,
		idleTunnels:  1000,
		holEchoes:    1000,
		stallBytes:   64 << 20,
		pprofSeconds: 5,
		timeout:      20 * time.Minute,
	}
}

// applyQuick shrinks every size for a CI smoke run, keeping flags the user set.
func applyQuick(c *config, set map[string]bool) {
	if !set["bytes"] {
		c.bytes = 64 << 20
	}
	if !set["dials"] {
		c.dials = 200
	}
	if !set["concurrent"] {
		c.concurrent = 100
	}
	if !set["idle-tunnels"] {
		c.idleTunnels = 100
	}
	if !set["hol-echoes"] {
		c.holEchoes = 200
	}
	if !set["stall-bytes"] {
		c.stallBytes = 16 << 20
	}
	if !set["plain-relay"] {
		c.plainRelay = false
	}
	if !set["idle-steady"] {
		c.idleSteady = 0
	}
	if !set["pprof-seconds"] {
		c.pprofSeconds = 1
	}
	if !set["timeout"] {
		c.timeout = 5 * time.Minute
	}
}

// mode is the server's --mode for the front door being measured.
func (c config) mode() string { return c.frontend }

func parseFlags(args []string, stderr io.Writer) (config, error) {
	c := defaultConfig()
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.bin, "bin", "", "konnectivity binary under test (required unless --server-bin and --agent-bin are given)")
	fs.StringVar(&c.frontend, "frontend", "http-connect", "front door to measure: http-connect, or grpc (kube-apiserver's GRPC protocol through upstream's konnectivity-client)")
	fs.StringVar(&c.serverBin, "server-bin", "", "another server binary taking the upstream flags (e.g. upstream's proxy-server), run without a subcommand")
	fs.StringVar(&c.agentBin, "agent-bin", "", "another agent binary taking the upstream flags (e.g. upstream's proxy-agent), with --server-bin")
	fs.Int64Var(&c.bytes, "bytes", c.bytes, "bytes per single-stream throughput run, each direction")
	fs.IntVar(&c.dials, "dials", c.dials, "sequential CONNECT + 1-byte echo dials (each path)")
	fs.IntVar(&c.concurrent, "concurrent", c.concurrent, "concurrent tunnels for the 64 KiB echo figure")
	fs.IntVar(&c.echoSize, "echo-size", c.echoSize, "bytes each concurrent tunnel echoes")
	fs.IntVar(&c.idleTunnels, "idle-tunnels", c.idleTunnels, "idle open tunnels for the RSS-per-tunnel figure")
	fs.IntVar(&c.holEchoes, "hol-echoes", c.holEchoes, "16-byte echoes per head-of-line run")
	fs.Int64Var(&c.stallBytes, "stall-bytes", c.stallBytes, "bytes each stalled tunnel tries to move in the head-of-line figure")
	fs.BoolVar(&c.tunnels10k, "tunnels10k", false, "also hold 10,000 open tunnels and report RSS per tunnel")
	fs.BoolVar(&c.quick, "quick", false, "small sizes for a CI smoke run (64 MiB, 200 dials, 100 tunnels)")
	fs.StringVar(&c.pprofDir, "pprof", "", "directory: start server and agent with --enable-profiling and save CPU profiles of the tunnelled throughput runs there")
	fs.StringVar(&c.pprofDir, "cpuprofile-server", "", "alias of --pprof")
	fs.IntVar(&c.pprofSeconds, "pprof-seconds", c.pprofSeconds, "length of each CPU profile")
	fs.DurationVar(&c.timeout, "timeout", c.timeout, "bound on the whole run")
	fs.StringVar(&c.phases, "phases", "", "comma list of phases to run: idle,latency,throughput,concurrent,hol,10k (default all; 10k only with --tunnels10k)")
	fs.DurationVar(&c.linger, "linger", 0, "after the phases, stay idle this long and read RSS again (is memory returned?)")
	fs.BoolVar(&c.plainRelay, "plain-relay", true, "in the throughput phase, also measure two plain Go TLS relays in the tunnel's shape (a reference: what io.Copy and crypto/tls give for three socket hops and two TLS ends)")
	fs.DurationVar(&c.idleSteady, "idle-steady", 20*time.Second, "keep the idle tunnels open this much longer and read their RSS again: the steady state, after the daemons' memory trim (checked every 5 s) (0: one reading at once)")
	fs.BoolVar(&c.keep, "keep", false, "keep the work directory (certificates, server and agent logs)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if c.frontend != "http-connect" && c.frontend != "grpc" {
		return c, fmt.Errorf("--frontend=%q: want http-connect or grpc", c.frontend)
	}
	if (c.serverBin == "") != (c.agentBin == "") {
		return c, fmt.Errorf("--server-bin and --agent-bin go together")
	}
	if c.bin == "" && c.serverBin != "" {
		c.bin = c.serverBin // the binary-size row then measures the server binary
	}
	if c.bin == "" {
		return c, fmt.Errorf("--bin is required (e.g. --bin ../bin/konnectivity)")
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if c.quick {
		applyQuick(&c, set)
	}
	if c.frontend == "grpc" && !set["plain-relay"] {
		c.plainRelay = false // an HTTP CONNECT reference: the gRPC floor is the null proxy
	}
	if c.phases != "" && c.wants("10k") {
		c.tunnels10k = true
	}
	if c.bytes <= 0 || c.dials <= 0 || c.concurrent <= 0 || c.echoSize <= 0 ||
		c.idleTunnels <= 0 || c.holEchoes <= 0 || c.stallBytes <= 0 {
		return c, fmt.Errorf("sizes and counts must be positive")
	}
	return c, nil
}

func main() {
	if os.Getenv(helperEnv) != "" {
		os.Exit(runEchoHelper())
	}
	if os.Getenv(grpcNullEnv) != "" {
		os.Exit(runGRPCNullHelper())
	}
	if os.Getenv(relayFarEnv) != "" {
		os.Exit(runRelayFar())
	}
	if spec := os.Getenv(relayNearEnv); spec != "" {
		os.Exit(runRelayNear(spec))
	}
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fmt.Printf("command: %s\n", strings.Join(os.Args, " "))
	res, err := run(ctx, cfg, os.Stdout, os.Stderr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		res.failed++
	}
	fmt.Printf("bench: %d passed, %d failed\n", res.passed, res.failed)
	if res.failed > 0 {
		stop()
		os.Exit(1)
	}
}
