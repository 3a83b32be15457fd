package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sort"
	"strconv"
	"strings"

	"github.com/spinifex/konnectivity/internal/daemon"
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

// commandFlags wraps a flag.FlagSet with the klog logging flags every
// command accepts and the upstream flags it only tolerates.
type commandFlags struct {
	*flag.FlagSet
	compat []*compatFlag
	// warnings are found while checking flags, before the logger exists;
	// runDaemon logs them once it does.
	warnings []startWarning

	// log holds the logging flags, klog's with klog's meaning.
	log daemon.LogSettings
}

// startWarning is one line logged at start: a flag or value this binary
// reads differently from upstream, with what it does instead.
type startWarning struct {
	msg  string
	args []any
}

// warn queues a start-up warning.
func (cf *commandFlags) warn(msg string, args ...any) {
	cf.warnings = append(cf.warnings, startWarning{msg, args})
}

func newCommandFlags(name string) *commandFlags {
	fs := newFlagSet(name)
	cf := &commandFlags{FlagSet: fs, log: daemon.LogSettings{StderrThreshold: daemon.SeverityError}}
	fs.IntVar(&cf.log.Verbosity, "v", 0, "log verbosity: 0 logs events that matter, 4 and up add per-dial debug lines (upstream's default is 4)")
	fs.StringVar(&cf.log.Format, "log-format", "text", "log format: text or json")
	// klog's flags, with klog's defaults and precedence.
	fs.BoolVar(&cf.log.ToStderr, "logtostderr", true, "log to stderr only; --log-file and --log-dir are ignored while this is true (as klog does)")
	fs.BoolVar(&cf.log.AlsoToStderr, "alsologtostderr", false, "with --logtostderr=false, log to stderr as well as to --log-file")
	fs.StringVar(&cf.log.File, "log-file", "", "with --logtostderr=false, append logs to this file")
	fs.StringVar(&cf.log.Dir, "log-dir", "", "with --logtostderr=false and no --log-file, klog writes files here; not honoured: logs go to stderr")
	fs.Var(&cf.log.StderrThreshold, "stderrthreshold", "with --logtostderr=false, lines at or above this severity (INFO, WARNING, ERROR, FATAL) also go to stderr")
	fs.Var(&cf.log.AlsoThreshold, "alsologtostderrthreshold", "with --alsologtostderr, lines at or above this severity go to stderr")
	fs.BoolVar(&cf.log.LegacyThreshold, "legacy-stderr-threshold-behavior", true, "false makes --stderrthreshold filter stderr even with --logtostderr=true")
	fs.Uint64Var(&cf.log.FileMaxSize, "log-file-max-size", 1800, "klog's size limit of --log-file in MB; not honoured (0, no limit, is what this binary does): rotate with logrotate copytruncate")
	// klog header and flush settings: the slog format has no such headers
	// and is not buffered, so they change nothing a reader would miss.
	for _, name := range []string{"add-dir-header", "skip-headers", "skip-log-headers", "one-output"} {
		cf.tolerate(name, true, "")
	}
	cf.tolerate("log-flush-frequency", false, "")
	for _, name := range []string{"vmodule", "log-backtrace-at"} {
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

// normalizeArgs rewrites "--log_file=x" to "--log-file=x" for flags defined
// with a hyphen, as klog's underscore names are normalised upstream. Values
// are not touched.
func (cf *commandFlags) normalizeArgs(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = a
		if a == "--" {
			copy(out[i:], args[i:])
			break
		}
		if !strings.HasPrefix(a, "-") || !strings.Contains(a, "_") {
			continue
		}
		dashes := "-"
		if strings.HasPrefix(a, "--") {
			dashes = "--"
		}
		name, value, hasValue := strings.Cut(a[len(dashes):], "=")
		if !strings.Contains(name, "_") || cf.Lookup(name) != nil {
			continue
		}
		if norm := strings.ReplaceAll(name, "_", "-"); cf.Lookup(norm) != nil {
			out[i] = dashes + norm
			if hasValue {
				out[i] += "=" + value
			}
		}
	}
	return out
}

// parseArgs parses flags interspersed with positional arguments, as
// upstream's command line (pflag) does, and returns the positional ones.
func (cf *commandFlags) parseArgs(args []string) (stray []string, err error) {
	rest := cf.normalizeArgs(args)
	for {
		before := rest
		if err := cf.Parse(rest); err != nil {
			return nil, err
		}
		rest = cf.Args()
		if len(rest) == 0 {
			return stray, nil
		}
		if used := len(before) - len(rest); used > 0 && before[used-1] == "--" {
			return append(stray, rest...), nil // everything after "--" is positional
		}
		// A bare "true"/"false" after a boolean flag given without "=":
		// the flag is true either way, here as upstream.
		arg := rest[0]
		if used := len(before) - len(rest); used > 0 && (arg == "true" || arg == "false") {
			prev := before[used-1]
			if name := strings.TrimLeft(prev, "-"); strings.HasPrefix(prev, "-") && !strings.Contains(name, "=") {
				if f := cf.Lookup(name); f != nil && isBoolFlag(f) {
					arg = prev + " " + arg + " (a boolean flag takes a value only as " + prev + "=" + arg + "; read as " + prev + "=true)"
				}
			}
		}
		stray = append(stray, arg)
		rest = rest[1:]
	}
}

func isBoolFlag(f *flag.Flag) bool {
	b, ok := f.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// startLogging returns a logger built from the logging flags. It queues
// warnings (cf.warn), one line each, about upstream flags that were given
// but have no effect here, and about positional arguments (stray:
// ignored, as upstream does).
func (cf *commandFlags) startLogging(stray []string, stderr io.Writer) (*slog.Logger, error) {
	cf.log.FileMaxSizeSet = cf.wasSet("log-file-max-size")
	log, err := daemon.NewLogger(cf.log, stderr, cf.warn)
	if err != nil {
		return nil, err
	}
	if len(stray) > 0 {
		cf.warn("positional arguments ignored, as upstream ignores them", "args", strings.Join(stray, " "))
	}
	sort.Slice(cf.compat, func(i, j int) bool { return cf.compat[i].name < cf.compat[j].name })
	for _, f := range cf.compat {
		if f.set && f.reason != "" {
			cf.warn("flag accepted for compatibility but not honoured", "flag", "--"+f.name, "value", f.value, "reason", f.reason)
		}
	}
	return log, nil
}

// flushWarnings logs the queued start-up warnings.
func (cf *commandFlags) flushWarnings(log *slog.Logger) {
	for _, w := range cf.warnings {
		log.Warn(w.msg, w.args...)
	}
	cf.warnings = nil
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

// runDaemon parses a daemon's flags, checks them with complete and runs it
// until a signal ends it: exit 2 for bad flags, 1 when it fails, 0
// otherwise. --help and --version answer and exit before anything starts.
// The start warnings go to warned, which run logs once it knows what a
// previous image of the process logged (onceWarnings.start).
func runDaemon(name string, cf *commandFlags, warned *onceWarnings, args []string, stdout, stderr io.Writer, complete func() error, run func(context.Context, *slog.Logger) error) int {
	stray, err := cf.parseArgs(args)
	if code, done := flagsParsed(cf.FlagSet, err, "", stdout, stderr); done {
		return code
	}
	log, err := cf.startLogging(stray, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "konnectivity %s: %v\n", name, err)
		return 2
	}
	defer daemon.CloseLog(log)
	if err := complete(); err != nil {
		cf.flushWarnings(log)
		if cf.log.ToStderr {
			daemon.CloseLog(log) // the warnings first
			fmt.Fprintf(stderr, "konnectivity %s: %v\n", name, err)
		} else {
			// Into --log-file and, as an error, onto stderr too.
			log.Error("konnectivity "+name+": bad flags", "err", err)
		}
		return 2
	}
	warned.delay(cf.warnings)
	cf.warnings = nil
	ctx, stop := daemon.SignalContext(log)
	defer stop()
	if err := run(ctx, log); err != nil {
		log.Error(name+" failed", "err", err)
		return 1
	}
	return 0
}

// goUntilStopped runs f on a goroutine it owns until ctx ends or stop,
// which cancels f's context and waits for f to return; stop may be called
// more than once.
func goUntilStopped(ctx context.Context, f func(context.Context)) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); f(ctx) }()
	return func() { cancel(); <-done }
}
