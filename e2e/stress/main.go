package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"
)

type config struct {
	bin     string        // konnectivity binary under test
	other   string        // another implementation: a directory with proxy-server and proxy-agent, or a konnectivity binary
	tunnels int           // concurrent tunnels
	bytes   int64         // bytes each tunnel moves (each way, for echo)
	shapes  []shape       // what the tunnels do
	hogs    int           // CPU hogs beside the run
	hogFor  time.Duration // how long the hogs run, from the moment the bytes start
	timeout time.Duration // one shape's bound, from the moment the bytes start
	dests   string        // where the destinations listen: "pod" (a namespace behind a veth) or "loopback"
	runs    int           // runs of each shape and implementation
	dir     string        // work directory (kept with --keep)
	keep    bool
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var c config
	var shapes string
	fs := flag.NewFlagSet("stress", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.bin, "bin", "", "konnectivity binary under test (required)")
	fs.StringVar(&c.other, "other", "", "another implementation in the same run: a directory holding upstream's proxy-server and proxy-agent, or another konnectivity binary")
	fs.IntVar(&c.tunnels, "tunnels", 2000, "concurrent tunnels")
	fs.Int64Var(&c.bytes, "bytes", 5<<20, "bytes each tunnel moves (each way for echo)")
	fs.StringVar(&shapes, "shapes", "echo", "comma list of shapes: echo, download, upload")
	fs.IntVar(&c.hogs, "hogs", 0, "CPU hogs (busy loops in processes of their own) beside the run")
	fs.DurationVar(&c.hogFor, "hog-for", 40*time.Second, "how long the hogs run, from the moment the bytes start")
	fs.DurationVar(&c.timeout, "timeout", 5*time.Minute, "bound on one run, from the moment the bytes start")
	fs.IntVar(&c.runs, "runs", 1, "runs of each shape and implementation")
	fs.StringVar(&c.dests, "destinations", "pod", "where the destinations listen: pod (a network namespace behind a veth of MTU 1500, as pods do; needs root) or loopback")
	fs.BoolVar(&c.keep, "keep", false, "keep the work directory (certificates, logs)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if c.bin == "" {
		return c, errors.New("--bin is required")
	}
	if c.tunnels <= 0 || c.bytes <= 0 || c.runs <= 0 || c.hogs < 0 || c.timeout <= 0 {
		return c, errors.New("--tunnels, --bytes, --runs and --timeout must be positive, --hogs not negative")
	}
	if c.dests != "pod" && c.dests != "loopback" {
		return c, fmt.Errorf("--destinations %q: want pod or loopback", c.dests)
	}
	for _, s := range strings.Split(shapes, ",") {
		sh, err := parseShape(strings.TrimSpace(s))
		if err != nil {
			return c, err
		}
		c.shapes = append(c.shapes, sh)
	}
	return c, nil
}

func main() {
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "stress:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ok, err := run(ctx, cfg, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "stress:", err)
		os.Exit(2)
	}
	if !ok {
		os.Exit(1)
	}
}

// run measures every shape for each implementation, the runs interleaved
// (ours, other, ours, other...) so that both meet the same machine.
func run(ctx context.Context, cfg config, out io.Writer) (ok bool, err error) {
	dir, err := os.MkdirTemp("", "konnectivity-stress-")
	if err != nil {
		return false, err
	}
	cfg.dir = dir
	if cfg.keep {
		fmt.Fprintf(out, "work directory %s\n", dir)
	} else {
		defer os.RemoveAll(dir)
	}
	impls := []impl{{name: "konnectivity", bin: cfg.bin}}
	if cfg.other != "" {
		o, err := otherImpl(cfg.other)
		if err != nil {
			return false, err
		}
		impls = append(impls, o)
	}
	listen := func() (net.Listener, error) { return net.Listen("tcp", "127.0.0.1:0") }
	if cfg.dests == "pod" {
		pn, err := newPodNetwork(ctx)
		if err != nil {
			return false, err
		}
		defer pn.close()
		listen = pn.listen
	}
	fmt.Fprintf(out, "stress: %d tunnels x %d bytes, shapes %v, %d hogs for %s, %d run(s) each, destinations on %s, %d CPUs\n",
		cfg.tunnels, cfg.bytes, cfg.shapes, cfg.hogs, cfg.hogFor, cfg.runs, cfg.dests, numCPU())
	var results []result
	ok = true
	for _, sh := range cfg.shapes {
		for r := range cfg.runs {
			for _, im := range impls {
				if ctx.Err() != nil {
					return false, ctx.Err()
				}
				res, err := runOnce(ctx, cfg, im, sh, listen, filepath.Join(dir, fmt.Sprintf("%s-%s-%d", im.name, sh, r)))
				if err != nil {
					return false, fmt.Errorf("%s %s run %d: %w", im.name, sh, r+1, err)
				}
				res.run = r + 1
				fmt.Fprintln(out, res.line())
				results = append(results, res)
				if im.name == "konnectivity" && !res.complete() {
					ok = false
				}
			}
		}
	}
	printTable(out, cfg, results)
	return ok, nil
}

func printTable(out io.Writer, cfg config, results []result) {
	fmt.Fprintln(out)
	tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "impl\tshape\trun\tcompleted\terrors\twall\tMB/s\tlongest stall\tafter hogs\tRSS server\tRSS agent\twindows' bound\t")
	for _, r := range results {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d/%d\t%d\t%s\t%.1f\t%s\t%s\t%d MiB\t%d MiB\t%d MiB\t\n",
			r.impl, r.shape, r.run, r.completed, r.tunnels, r.errors, r.wall.Round(100*time.Millisecond), r.mbps(),
			r.longestStall.Round(100*time.Millisecond), r.stallAfterHogs.Round(100*time.Millisecond),
			r.rssServer>>10, r.rssAgent>>10, r.windowBound>>20)
	}
	tw.Flush()
	fmt.Fprintf(out, "windows' bound: what the stream receive windows let both ends hold queued at once (%d tunnels x %d MiB x the directions that carry bytes), beside the peak RSS (VmHWM) of each end\n",
		cfg.tunnels, streamWindow>>20)
}

func numCPU() int {
	out, err := exec.Command("nproc").Output()
	if err != nil {
		return 0
	}
	var n int
	fmt.Sscan(strings.TrimSpace(string(out)), &n)
	return n
}
