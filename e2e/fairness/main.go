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
	bin     string        // this project's binary
	other   string        // a directory with proxy-server and proxy-agent, or another konnectivity binary; "" for none
	alone   time.Duration // probe alone, per row
	warm    time.Duration // bulk running before the probe is measured beside it
	measure time.Duration // probe and bulk measured together
	rows    string        // comma list of row names to run; "" for all
	keep    bool          // keep the work directory (logs, certificates)
	timeout time.Duration // bound on the whole run
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	c := config{}
	fs := flag.NewFlagSet("fairness", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.bin, "bin", "", "konnectivity binary under test (required)")
	fs.StringVar(&c.other, "other", "", "another build measured in the same run: a directory holding upstream's proxy-server and proxy-agent, or the path of another konnectivity binary")
	fs.DurationVar(&c.alone, "alone", 3*time.Second, "probe alone, per row")
	fs.DurationVar(&c.warm, "warm", 3*time.Second, "bulk tunnels running before the probe is measured beside them")
	fs.DurationVar(&c.measure, "measure", 8*time.Second, "probe and bulk measured together, per row")
	fs.StringVar(&c.rows, "rows", "", "comma list of rows to run (default all): "+strings.Join(rowNames(), ","))
	fs.BoolVar(&c.keep, "keep", false, "keep the work directory (logs, certificates)")
	fs.DurationVar(&c.timeout, "timeout", 20*time.Minute, "bound on the whole run")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if c.bin == "" {
		return c, fmt.Errorf("--bin is required (e.g. --bin ../bin/konnectivity)")
	}
	if c.alone <= 0 || c.warm < 0 || c.measure <= 0 {
		return c, fmt.Errorf("--alone and --measure must be positive, --warm not negative")
	}
	for _, r := range splitList(c.rows) {
		if findRow(r) == nil {
			return c, fmt.Errorf("--rows: no row %q (rows: %s)", r, strings.Join(rowNames(), ","))
		}
	}
	return c, nil
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func main() {
	if role := os.Getenv(nodeEnv); role != "" {
		os.Exit(runNode(role))
	}
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "fairness: %v\n", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	fmt.Printf("command: %s\n", strings.Join(os.Args, " "))
	failed, err := run(ctx, cfg, os.Stdout)
	if err != nil {
		fmt.Fprintf(os.Stderr, "fairness: %v\n", err)
		failed++
	}
	if failed > 0 {
		fmt.Printf("fairness: %d failed\n", failed)
		stop()
		os.Exit(1)
	}
}
