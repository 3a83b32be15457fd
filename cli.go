package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"strings"
)

// Set at build time (the Makefile passes them with -ldflags -X); a build
// without them reads the commit and its time from the Go build info.
var (
	version   = "dev"
	commit    = "" // full commit hash
	buildDate = "" // RFC 3339, UTC
)

// build is what `konnectivity version` and every command's --version print.
type build struct {
	version, commit, date, goVersion string
	modified                         bool // built from a tree with uncommitted changes
}

func currentBuild() build {
	b := build{version: version, commit: commit, date: buildDate, goVersion: runtime.Version()}
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				if b.commit == "" {
					b.commit = s.Value
				}
			case "vcs.time":
				if b.date == "" {
					b.date = s.Value
				}
			case "vcs.modified":
				b.modified = s.Value == "true"
			}
		}
	}
	return b
}

// versionString is the one-line version: the first line of `version`, and
// the version label of the build_info metrics.
func versionString() string { return "konnectivity " + version }

func writeVersion(w io.Writer) {
	b := currentBuild()
	unknown := func(s string) string {
		if s == "" {
			return "unknown"
		}
		return s
	}
	c := unknown(b.commit)
	if b.modified {
		c += " (with uncommitted changes)"
	}
	fmt.Fprintf(w, "%s\ncommit:     %s\nbuild date: %s\ngo:         %s %s/%s\n",
		versionString(), c, unknown(b.date), b.goVersion, runtime.GOOS, runtime.GOARCH)
}

func runVersion(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("konnectivity version")
	if code, done := parseFlags(fs, args, stdout, stderr); done {
		return code
	}
	writeVersion(stdout)
	return 0
}

// newFlagSet is a command's flag set: --version on every command, errors
// and help written by parseFlags, not by the flag package.
func newFlagSet(cmd string) *flag.FlagSet {
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	fs.Bool("version", false, "print the version and exit")
	return fs
}

// parseFlags parses args with fs; done says the command must end now with
// code: --help (the flags, on stdout), --version, or a flag error (one
// line on stderr).
func parseFlags(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) (code int, done bool) {
	return flagsParsed(fs, fs.Parse(args), "", stdout, stderr)
}

// flagsParsed answers what parsing fs gave: err from the parse, usage the
// lines shown above the flags for --help ("" for "Usage: CMD [flags]").
func flagsParsed(fs *flag.FlagSet, err error, usage string, stdout, stderr io.Writer) (code int, done bool) {
	switch {
	case errors.Is(err, flag.ErrHelp):
		if usage == "" {
			usage = "Usage: " + fs.Name() + " [flags]\n"
		}
		fmt.Fprintf(stdout, "%s\nFlags:\n", usage)
		fs.SetOutput(stdout)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
		return 0, true
	case err != nil:
		fmt.Fprintf(stderr, "%s: %s; '%s --help' lists the flags\n", fs.Name(), flagError(fs, err), fs.Name())
		return 2, true
	}
	if f := fs.Lookup("version"); f != nil && f.Value.String() == "true" {
		writeVersion(stdout)
		return 0, true
	}
	return 0, false
}

// flagError rewords the flag package's error for an unknown flag, with the
// defined flag it most likely meant.
func flagError(fs *flag.FlagSet, err error) string {
	name, ok := strings.CutPrefix(err.Error(), "flag provided but not defined: -")
	if !ok {
		return err.Error()
	}
	msg := "unknown flag --" + name
	if near := nearestFlag(fs, name); near != "" {
		msg += " (did you mean --" + near + "?)"
	}
	return msg
}

// nearestFlag is the defined flag closest to name: within two edits, or a
// third of its length for long names; "" if none is that close.
func nearestFlag(fs *flag.FlagSet, name string) string {
	best, bestD := "", max(2, len(name)/3)+1
	fs.VisitAll(func(f *flag.Flag) {
		if d := editDistance(name, f.Name); d < bestD {
			best, bestD = f.Name, d
		}
	})
	return best
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
