package daemon

import (
	"bufio"
	"fmt"
	"html"
	"io"
	"net/http"
	"os"
	"runtime"
	"runtime/pprof"
	"runtime/trace"
	"strconv"
	"strings"
	"time"
)

// addProfiling serves /debug/pprof from runtime/pprof directly: the
// endpoints of net/http/pprof (index, named profiles with ?debug= and
// ?gc=, profile, trace, cmdline, symbol) except delta profiles (?seconds=
// on a named profile), whose profile arithmetic would add about 170 KB to
// the binary; take two profiles and compare them with go tool pprof -base.
func addProfiling(mux *http.ServeMux) {
	mux.HandleFunc("/debug/pprof/", pprofNamed)
	mux.HandleFunc("/debug/pprof/cmdline", pprofCmdline)
	mux.HandleFunc("/debug/pprof/profile", pprofCPU)
	mux.HandleFunc("/debug/pprof/symbol", pprofSymbol)
	mux.HandleFunc("/debug/pprof/trace", pprofTrace)
}

func pprofError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Del("Content-Disposition")
	w.WriteHeader(code)
	fmt.Fprintln(w, msg)
}

// pprofNamed serves the index at /debug/pprof/ and each named profile
// (heap, goroutine, allocs, block, mutex, threadcreate) below it.
func pprofNamed(w http.ResponseWriter, r *http.Request) {
	name := strings.TrimPrefix(r.URL.Path, "/debug/pprof/")
	if name == "" {
		pprofIndex(w)
		return
	}
	p := pprof.Lookup(name)
	if p == nil {
		pprofError(w, http.StatusNotFound, "unknown profile "+strconv.Quote(name))
		return
	}
	q := r.URL.Query()
	if q.Get("seconds") != "" {
		pprofError(w, http.StatusBadRequest, "delta profiles (?seconds= on "+name+") are not served: take two profiles and compare them with go tool pprof -base")
		return
	}
	if gc, _ := strconv.Atoi(q.Get("gc")); gc > 0 && name == "heap" {
		runtime.GC()
	}
	debug, _ := strconv.Atoi(q.Get("debug"))
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if debug != 0 {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	} else {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Disposition", `attachment; filename="`+name+`"`)
	}
	p.WriteTo(w, debug)
}

func pprofIndex(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	io.WriteString(w, "<html><head><title>/debug/pprof/</title></head><body>\n<p>Profiles (?debug=1 for text):</p>\n<table>\n")
	for _, p := range pprof.Profiles() {
		n := html.EscapeString(p.Name())
		fmt.Fprintf(w, "<tr><td align=right>%d</td><td><a href=\"%s?debug=1\">%s</a></td></tr>\n", p.Count(), n, n)
	}
	io.WriteString(w, "<tr><td></td><td><a href=\"cmdline\">cmdline</a></td></tr>\n<tr><td></td><td><a href=\"profile\">profile</a> (CPU, ?seconds=30)</td></tr>\n<tr><td></td><td><a href=\"trace\">trace</a> (?seconds=1)</td></tr>\n</table>\n</body></html>\n")
}

func pprofCmdline(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	io.WriteString(w, strings.Join(os.Args, "\x00"))
}

// pprofSeconds is the ?seconds= of a CPU profile or trace, or def.
func pprofSeconds(r *http.Request, def float64) time.Duration {
	s, err := strconv.ParseFloat(r.URL.Query().Get("seconds"), 64)
	if err != nil || s <= 0 {
		s = def
	}
	return time.Duration(s * float64(time.Second))
}

// pprofWait waits d, or until the client goes away.
func pprofWait(r *http.Request, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-r.Context().Done():
	}
}

func pprofCPU(w http.ResponseWriter, r *http.Request) {
	d := pprofSeconds(r, 30)
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", `attachment; filename="profile"`)
	if err := pprof.StartCPUProfile(w); err != nil {
		pprofError(w, http.StatusInternalServerError, "could not enable CPU profiling: "+err.Error())
		return
	}
	pprofWait(r, d)
	pprof.StopCPUProfile()
}

func pprofTrace(w http.ResponseWriter, r *http.Request) {
	d := pprofSeconds(r, 1)
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", `attachment; filename="trace"`)
	if err := trace.Start(w); err != nil {
		pprofError(w, http.StatusInternalServerError, "could not enable tracing: "+err.Error())
		return
	}
	pprofWait(r, d)
	trace.Stop()
}

// pprofSymbol answers go tool pprof's symbol lookups: GET says symbols are
// served; POST (or GET with a query) lists program counters joined by '+'
// and gets "0xPC name" for each that names a function.
func pprofSymbol(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	var in *bufio.Reader
	if r.Method == http.MethodPost {
		in = bufio.NewReader(io.LimitReader(r.Body, 1<<20))
	} else {
		in = bufio.NewReader(strings.NewReader(r.URL.RawQuery))
	}
	io.WriteString(w, "num_symbols: 1\n")
	for {
		word, err := in.ReadString('+')
		if pc, perr := strconv.ParseUint(strings.TrimSuffix(word, "+"), 0, 64); perr == nil && pc != 0 {
			if f := runtime.FuncForPC(uintptr(pc)); f != nil {
				fmt.Fprintf(w, "%#x %s\n", pc, f.Name())
			}
		}
		if err != nil {
			return
		}
	}
}
