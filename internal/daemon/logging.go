package daemon

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// LogSettings are klog's logging flags, with klog's meaning, so that a
// manifest written for upstream logs to the same places here. The commands
// fill it from their flags; this package reads no flags.
type LogSettings struct {
	// Verbosity 4 and up adds debug lines; Format is "text" or "json".
	Verbosity int
	Format    string
	// File, Dir, ToStderr, AlsoToStderr, LegacyThreshold, StderrThreshold,
	// AlsoThreshold and FileMaxSize are klog's --log-file, --log-dir,
	// --logtostderr, --alsologtostderr, --legacy-stderr-threshold-behavior,
	// --stderrthreshold, --alsologtostderrthreshold and --log-file-max-size.
	File, Dir                      string
	ToStderr, AlsoToStderr         bool
	LegacyThreshold                bool
	StderrThreshold, AlsoThreshold Severity
	FileMaxSize                    uint64
	// FileMaxSizeSet says --log-file-max-size was given: only a value the
	// operator chose is worth a warning that it is not honoured.
	FileMaxSizeSet bool
}

// NewLogger builds the process's logger from s. Start-up warnings about
// settings read differently from klog go to warn, because the logger does
// not exist yet when they are found; the caller logs them once it does.
// A --log-file it opens stays open for the life of the process. When
// stderr is a descriptor (a file, a pipe), its lines go through a queue
// that never makes a log call wait and SIGPIPE is ignored (logqueue.go);
// CloseLog writes out what is queued.
func NewLogger(s LogSettings, stderr io.Writer, warn func(msg string, args ...any)) (*slog.Logger, error) {
	var q *logQueue
	if f, ok := stderr.(*os.File); ok {
		var err error
		if q, err = newLogQueue(f); err != nil {
			return nil, fmt.Errorf("standard error: %w", err)
		}
		stderr = q
	}
	out, err := logOutput(s, stderr, warn)
	if err != nil {
		return nil, err
	}
	level := slog.LevelInfo
	if s.Verbosity >= 4 {
		level = slog.LevelDebug
	}
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler
	switch s.Format {
	case "text":
		h = slog.NewTextHandler(out, opts)
	case "json":
		h = slog.NewJSONHandler(out, opts)
	default:
		return nil, fmt.Errorf("--log-format=%q: want text or json", s.Format)
	}
	if q == nil {
		return slog.New(h), nil
	}
	// Go ends the process with SIGPIPE when a write of its own to
	// descriptor 1 or 2 finds the reader gone; the queue's writes are not
	// Go's, and this covers any other.
	signal.Ignore(unix.SIGPIPE)
	log := slog.New(queuedHandler{h, q})
	q.start(log)
	return log, nil
}

// logOutput decides where log lines go, with klog's precedence: with
// --logtostderr (the default) only stderr, and --log-file is ignored (a
// warning says so); otherwise --log-file, plus stderr for the lines
// --alsologtostderr or --stderrthreshold pick. Lines never vanish: with
// neither a file nor stderr they go to stderr.
func logOutput(s LogSettings, stderr io.Writer, warn func(msg string, args ...any)) (io.Writer, error) {
	if s.ToStderr {
		if s.File != "" || s.Dir != "" {
			warn("--log-file and --log-dir are ignored while --logtostderr=true (the default), as klog does; logging to stderr",
				"log_file", s.File, "log_dir", s.Dir)
		}
		if !s.LegacyThreshold {
			return &severityWriter{w: stderr, min: s.StderrThreshold}, nil
		}
		return stderr, nil
	}
	if s.File == "" {
		if s.Dir != "" {
			warn("--log-dir is not honoured (klog's per-severity files); logging to stderr", "log_dir", s.Dir)
		} else {
			warn("--logtostderr=false without --log-file: klog would write files under " + os.TempDir() + "; logging to stderr")
		}
		return stderr, nil
	}
	f, err := os.OpenFile(s.File, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640)
	if err != nil {
		// Said on stderr by the caller: the file is not there to say it.
		return nil, fmt.Errorf("--log-file: %w", err)
	}
	if s.FileMaxSize != 0 && s.FileMaxSizeSet {
		warn("--log-file-max-size is not honoured: the log file grows without limit; rotate it (logrotate copytruncate)", "log_file_max_size_mb", s.FileMaxSize)
	}
	// f lives as long as the process.
	threshold := s.StderrThreshold
	if s.AlsoToStderr {
		threshold = s.AlsoThreshold
	}
	return io.MultiWriter(f, &severityWriter{w: stderr, min: threshold}), nil
}

// Severity is a klog severity flag value: INFO, WARNING, ERROR, FATAL or
// 0..3. It is a flag.Value so the commands can define klog's threshold
// flags with it.
type Severity int

// The severities, in klog's order.
const (
	SeverityInfo Severity = iota
	SeverityWarning
	SeverityError
	SeverityFatal
)

func (s *Severity) String() string {
	return [...]string{"INFO", "WARNING", "ERROR", "FATAL"}[*s]
}

// Set reads a severity by name, in any case, or by number.
func (s *Severity) Set(v string) error {
	for i := SeverityInfo; i <= SeverityFatal; i++ {
		if strings.EqualFold(v, i.String()) || v == strconv.Itoa(int(i)) {
			*s = i
			return nil
		}
	}
	return fmt.Errorf("want INFO, WARNING, ERROR or FATAL")
}

// severityWriter passes on the log lines at or above min, as klog's
// thresholds do. One Write is one line from a slog handler; its level is
// read from the line's level field (level=WARN in text, "level":"WARN" in
// JSON). It holds no state of its own, so the handler's lock is enough.
type severityWriter struct {
	w   io.Writer
	min Severity
}

func (sw *severityWriter) Write(p []byte) (int, error) {
	if sw.min == SeverityInfo || lineSeverity(p) >= sw.min {
		return sw.w.Write(p)
	}
	return len(p), nil
}

// lineSeverity is the klog severity of one slog line; slog has no FATAL.
func lineSeverity(p []byte) Severity {
	line := string(p)
	switch {
	case strings.Contains(line, "level=ERROR") || strings.Contains(line, `"level":"ERROR"`):
		return SeverityError
	case strings.Contains(line, "level=WARN") || strings.Contains(line, `"level":"WARN"`):
		return SeverityWarning
	}
	return SeverityInfo
}
