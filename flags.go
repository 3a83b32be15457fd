package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sort"
	"strconv"
	"strings"
)

// compatFlag accepts an upstream flag this binary does not honour, and
// remembers that it was given so the command can warn about it.
type compatFlag struct {
	name   string
	isBool bool
	reason string
	value  string
	set    bool
}

func (f *compatFlag) String() string { return f.value }
func (f *compatFlag) Set(v string) error {
	f.value, f.set = v, true
	return nil
}
func (f *compatFlag) IsBoolFlag() bool { return f.isBool }

// commandFlags wraps a flag.FlagSet with the klog-style logging flags every
// command accepts and the upstream flags it only tolerates.
type commandFlags struct {
	*flag.FlagSet
	compat []*compatFlag

	verbosity int
	logFormat string
	logFile   string
}

func newCommandFlags(name string, stderr io.Writer) *commandFlags {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	cf := &commandFlags{FlagSet: fs}
	fs.IntVar(&cf.verbosity, "v", 0, "log verbosity: 0 logs events that matter, 4 and up add per-dial debug lines")
	fs.StringVar(&cf.logFormat, "log-format", "text", "log format: text or json")
	fs.StringVar(&cf.logFile, "log-file", "", "append logs to this file instead of stderr")
	// klog flags that real manifests pass; logs always go to stderr (or --log-file).
	for _, name := range []string{"logtostderr", "alsologtostderr", "add-dir-header", "skip-headers", "skip-log-headers", "one-output"} {
		cf.tolerate(name, true, "")
	}
	for _, name := range []string{"vmodule", "log-dir", "stderrthreshold", "log-file-max-size", "log-flush-frequency", "log_backtrace_at"} {
		cf.tolerate(name, false, "klog setting; logging here is log/slog")
	}
	return cf
}

// tolerate registers an upstream flag that is accepted but not honoured.
// An empty reason means the flag is harmless and needs no warning.
func (cf *commandFlags) tolerate(name string, isBool bool, reason string) {
	f := &compatFlag{name: name, isBool: isBool, reason: reason}
	cf.compat = append(cf.compat, f)
	help := "accepted for compatibility with upstream; no effect"
	if reason != "" {
		help += ": " + reason
	}
	cf.Var(f, name, help)
}

// parse parses args and returns a logger built from the logging flags. It
// warns, one line each, about upstream flags that were given but have no
// effect here.
func (cf *commandFlags) parse(args []string, stderr io.Writer) (*slog.Logger, error) {
	if err := cf.Parse(args); err != nil {
		return nil, err
	}
	if cf.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %s", strings.Join(cf.Args(), " "))
	}
	out := stderr
	if cf.logFile != "" {
		f, err := os.OpenFile(cf.logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640)
		if err != nil {
			return nil, fmt.Errorf("--log-file: %w", err)
		}
		out = f // lives as long as the process
	}
	level := slog.LevelInfo
	if cf.verbosity >= 4 {
		level = slog.LevelDebug
	}
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler
	switch cf.logFormat {
	case "text":
		h = slog.NewTextHandler(out, opts)
	case "json":
		h = slog.NewJSONHandler(out, opts)
	default:
		return nil, fmt.Errorf("--log-format=%q: want text or json", cf.logFormat)
	}
	log := slog.New(h)
	sort.Slice(cf.compat, func(i, j int) bool { return cf.compat[i].name < cf.compat[j].name })
	for _, f := range cf.compat {
		if f.set && f.reason != "" {
			log.Warn("flag accepted for compatibility but not honoured", "flag", "--"+f.name, "value", f.value, "reason", f.reason)
		}
	}
	return log, nil
}

// wasSet reports whether the flag was given on the command line.
func (cf *commandFlags) wasSet(name string) bool {
	set := false
	cf.Visit(func(f *flag.Flag) {
		if f.Name == name {
			set = true
		}
	})
	return set
}

// fileMode is a flag.Value for an octal file mode such as 0600.
type fileMode struct{ mode os.FileMode }

func (m *fileMode) String() string { return fmt.Sprintf("%#o", m.mode) }
func (m *fileMode) Set(s string) error {
	v, err := strconv.ParseUint(s, 8, 32)
	if err != nil || v > 0o777 {
		return fmt.Errorf("want an octal mode like 0600")
	}
	m.mode = os.FileMode(v)
	return nil
}

// flagHelp is flag.ErrHelp: -h or --help was asked for and usage was printed.
var flagHelp = flag.ErrHelp

// runDaemon parses a daemon's flags, checks them with complete and runs it
// until a signal ends it: exit 2 for bad flags, 1 when it fails, 0 otherwise.
func runDaemon(name string, cf *commandFlags, args []string, stderr io.Writer, complete func() error, run func(context.Context, *slog.Logger) error) int {
	log, err := cf.parse(args, stderr)
	if err != nil {
		if errors.Is(err, flagHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "konnectivity %s: %v\n", name, err)
		return 2
	}
	if err := complete(); err != nil {
		fmt.Fprintf(stderr, "konnectivity %s: %v\n", name, err)
		return 2
	}
	ctx, stop := signalContext(log)
	defer stop()
	if err := run(ctx, log); err != nil {
		log.Error(name+" failed", "err", err)
		return 1
	}
	return 0
}
