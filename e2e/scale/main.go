package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

type config struct {
	bin          string
	other        string // directory with upstream's proxy-server, or another konnectivity binary
	otherIsDir   bool   // other is upstream's directory
	upstream     bool   // our server's agents speak upstream's protocol
	agents       int
	tunnels      int
	dials        int
	fdsPerHelper int // descriptors a simulator or echo process is given
	doors        []string
	idleCPU      time.Duration
	afterBurst   time.Duration // wait after a burst before the figures of a steady state
	connectBy    time.Duration // bound on the fleet connecting
	timeout      time.Duration
	keep         bool
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	c := config{}
	var doors string
	fs := flag.NewFlagSet("scale", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.bin, "bin", "", "konnectivity binary under test (required)")
	fs.StringVar(&c.other, "other", "", "the same run against another server: a directory holding upstream's proxy-server (its agents then speak upstream's agent protocol), or another konnectivity binary (with this tree's agents)")
	var proto string
	fs.StringVar(&proto, "agent-protocol", "konnectivity", "protocol of the simulated agents of konnectivity's server: konnectivity (the product's agent code) or upstream (upstream's agent protocol, as with --other)")
	fs.IntVar(&c.agents, "agents", 5000, "agents, each with its own TLS connection and link")
	fs.IntVar(&c.tunnels, "tunnels", 50000, "idle tunnels held with all agents connected (the HTTP CONNECT door holds as many as the descriptor limit allows)")
	fs.IntVar(&c.fdsPerHelper, "fds-per-helper", 12000, "sockets given to each agent-simulator and echo process; more processes are started to stay within it (below RLIMIT_NOFILE, with room for the tunnels' uneven spread over agents)")
	fs.IntVar(&c.dials, "dials", 2000, "sequential dials (CONNECT + 1-byte echo) per latency figure, as many again through the reference, interleaved")
	fs.StringVar(&doors, "doors", "http-connect,grpc", "front doors to measure, one server run each")
	fs.DurationVar(&c.idleCPU, "idle-cpu", 5*time.Second, "window over which the server's idle CPU is read")
	// The server trims its memory once a burst has gone quiet, at one of
	// its checks every 5 s (internal/daemon/memory.go): a one-off of two
	// forced collections that would otherwise land in one figure or another.
	fs.DurationVar(&c.afterBurst, "after-burst", 11*time.Second, "wait after the fleet connected and after the tunnels opened before the figures of a steady state (RSS, idle CPU, latency): past the server's memory trim after a burst")
	fs.DurationVar(&c.connectBy, "connect-timeout", 5*time.Minute, "bound on the fleet connecting")
	fs.DurationVar(&c.timeout, "timeout", 15*time.Minute, "bound on the whole run")
	fs.BoolVar(&c.keep, "keep", false, "keep the work directory (certificates, logs)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if c.bin == "" {
		return c, fmt.Errorf("--bin is required (e.g. --bin ../bin/konnectivity)")
	}
	if c.agents < 1 || c.tunnels < 0 || c.dials < 1 || c.fdsPerHelper < 1 {
		return c, fmt.Errorf("--agents, --dials and --fds-per-helper must be positive, --tunnels not negative")
	}
	for _, d := range strings.Split(doors, ",") {
		switch d = strings.TrimSpace(d); d {
		case "http-connect", "grpc":
			c.doors = append(c.doors, d)
		case "":
		default:
			return c, fmt.Errorf("--doors: %q is not http-connect or grpc", d)
		}
	}
	switch proto {
	case "konnectivity":
	case "upstream":
		c.upstream = true
	default:
		return c, fmt.Errorf("--agent-protocol=%q: want konnectivity or upstream", proto)
	}
	if c.other != "" {
		fi, err := os.Stat(c.other)
		if err != nil {
			return c, fmt.Errorf("--other: %w", err)
		}
		if c.otherIsDir = fi.IsDir(); c.otherIsDir {
			if _, err := os.Stat(filepath.Join(c.other, "proxy-server")); err != nil {
				return c, fmt.Errorf("--other: %w", err)
			}
		}
	}
	if len(c.doors) == 0 {
		return c, fmt.Errorf("--doors: none given")
	}
	return c, nil
}

func main() {
	if role := os.Getenv(helperEnv); role != "" {
		os.Exit(runHelper(role))
	}
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "scale: %v\n", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fmt.Printf("command: %s\n", strings.Join(os.Args, " "))
	res, err := run(ctx, cfg, os.Stdout, os.Stderr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "scale: %v\n", err)
		res.failed++
	}
	fmt.Printf("scale: %d checks passed, %d failed\n", res.passed, res.failed)
	if res.failed > 0 {
		stop()
		os.Exit(1)
	}
}
