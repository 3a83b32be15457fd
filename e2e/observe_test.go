package e2e

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Observing a running process from outside: its metrics (parsed with
// Prometheus' own text parser), goroutines, descriptors and socket inode.

// noKeepAlive scrapes without leaving idle connections behind, so the
// scraper does not show up in the descriptor counts it measures.
var noKeepAlive = &http.Client{
	Timeout:   3 * time.Second,
	Transport: &http.Transport{DisableKeepAlives: true},
}

// metricFamilies is one parsed scrape.
type metricFamilies map[string]*dto.MetricFamily

// scrape GETs url (a /metrics endpoint) and parses it with expfmt's text
// parser, which rejects anything Prometheus itself would reject.
func scrape(t *testing.T, url string) metricFamilies {
	t.Helper()
	fams, raw, err := scrapeRaw(url)
	if err != nil {
		t.Fatalf("scrape %s: %v\n%s", url, err, raw)
	}
	return fams
}

func scrapeRaw(url string) (metricFamilies, string, error) {
	resp, err := noKeepAlive.Get(url)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return nil, "", err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, string(body), fmt.Errorf("status %d", resp.StatusCode)
	}
	if ct := resp.Header.Get("Content-Type"); expfmt.ResponseFormat(resp.Header).FormatType() != expfmt.TypeTextPlain {
		return nil, string(body), fmt.Errorf("Content-Type %q is not the Prometheus text format", ct)
	}
	parser := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := parser.TextToMetricFamilies(strings.NewReader(string(body)))
	if err != nil {
		return nil, string(body), fmt.Errorf("parse: %w", err)
	}
	return fams, string(body), nil
}

// series finds the metric of family name whose labels include want (all
// of them; other labels are ignored). nil if there is none.
func (f metricFamilies) series(name string, want map[string]string) *dto.Metric {
	fam := f[name]
	if fam == nil {
		return nil
	}
	for _, m := range fam.GetMetric() {
		have := map[string]string{}
		for _, lp := range m.GetLabel() {
			have[lp.GetName()] = lp.GetValue()
		}
		match := true
		for k, v := range want {
			if have[k] != v {
				match = false
				break
			}
		}
		if match {
			return m
		}
	}
	return nil
}

// value is a counter's or gauge's value, or a histogram's sample count;
// -1 when the series is missing.
func (f metricFamilies) value(name string, labels ...string) float64 {
	want := map[string]string{}
	for i := 0; i+1 < len(labels); i += 2 {
		want[labels[i]] = labels[i+1]
	}
	m := f.series(name, want)
	if m == nil {
		return -1
	}
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Histogram != nil:
		return float64(m.Histogram.GetSampleCount())
	case m.Untyped != nil:
		return m.Untyped.GetValue()
	}
	return -1
}

// metricValue scrapes url and returns one value (see value).
func metricValue(t *testing.T, url, name string, labels ...string) float64 {
	t.Helper()
	return scrape(t, url).value(name, labels...)
}

// waitMetric polls url until name{labels} equals want.
func waitMetric(t *testing.T, url string, want float64, name string, labels ...string) {
	t.Helper()
	var got float64
	waitFor(t, 10*time.Second, fmt.Sprintf("%s%v = %v (last %v)", name, labels, want, &got), func() bool {
		fams, _, err := scrapeRaw(url)
		if err != nil {
			return false
		}
		got = fams.value(name, labels...)
		return got == want
	})
}

// goroutineCount is a process's goroutines, read from its goroutine
// profile (--enable-profiling on the admin port), with those of its HTTP
// client's pooled connections (to the kube-apiserver) counted apart: a
// TokenReview cancelled while its connection was being dialled leaves that
// connection in the pool until the idle timeout (net/http's rule, bounded
// by the transport's MaxIdleConnsPerHost), so a test that a process is back
// at rest compares ours and bounds conns.
type goroutineCount struct {
	total int // every goroutine
	pool  int // goroutines of pooled HTTP client connections
	conns int // pooled HTTP client connections
}

// ours is every goroutine but the HTTP client pool's.
func (g goroutineCount) ours() int { return g.total - g.pool }

func (g goroutineCount) String() string {
	return fmt.Sprintf("%d goroutines (%d of them %d pooled HTTP client connections)", g.total, g.pool, g.conns)
}

// maxPooledConns is auth's transport's MaxIdleConnsPerHost: the HTTP client
// connections a process at rest may keep to the kube-apiserver.
const maxPooledConns = 4

// goroutines reads adminPort's goroutine profile (debug=1: records of
// "N @ pcs" followed by "#\tpc\tfunction+off\tfile:line" frames).
func goroutines(adminPort int) (goroutineCount, error) {
	resp, err := noKeepAlive.Get(fmt.Sprintf("http://127.0.0.1:%d/debug/pprof/goroutine?debug=1", adminPort))
	if err != nil {
		return goroutineCount{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return goroutineCount{}, fmt.Errorf("goroutine profile: %w", err)
	}
	first, rest, _ := strings.Cut(string(body), "\n")
	total, ok := strings.CutPrefix(strings.TrimSpace(first), "goroutine profile: total ")
	if !ok {
		return goroutineCount{}, fmt.Errorf("goroutine profile: first line %q", first)
	}
	var g goroutineCount
	if g.total, err = strconv.Atoi(total); err != nil {
		return goroutineCount{}, fmt.Errorf("goroutine profile: first line %q", first)
	}
	for _, rec := range strings.Split(rest, "\n\n") {
		head, frames, _ := strings.Cut(strings.TrimSpace(rec), "\n")
		countText, _, ok := strings.Cut(head, " @ ")
		if !ok {
			continue
		}
		n, err := strconv.Atoi(countText)
		if err != nil {
			return goroutineCount{}, fmt.Errorf("goroutine profile: record %q", head)
		}
		switch {
		case strings.Contains(frames, "net/http.(*persistConn).readLoop"),
			strings.Contains(frames, "net/http.(*http2clientConnReadLoop).run"):
			g.pool += n
			g.conns += n
		case strings.Contains(frames, "net/http.(*persistConn).writeLoop"):
			g.pool += n
		}
	}
	return g, nil
}

// fdCount is the number of open descriptors of pid.
func fdCount(pid int) (int, error) {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return 0, err
	}
	return len(ents), nil
}

// fdList describes pid's descriptors (for a failure message).
func fdList(pid int) string {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, e := range ents {
		target, _ := os.Readlink(filepath.Join(dir, e.Name()))
		fmt.Fprintf(&b, "%s→%s ", e.Name(), target)
	}
	return b.String()
}

// inode of path (the frontend socket file).
func inode(t *testing.T, path string) uint64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatalf("stat %s: %v", path, err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}

// checkSameProcess asserts that p is alive with its original PID and that
// /proc/PID/exe is bin (not "bin (deleted)", not another file).
func checkSameProcess(t *testing.T, p *proc, pid int, bin string) {
	t.Helper()
	if p.exited() {
		t.Fatalf("%s exited: %v", p.name, p.waitErr)
	}
	if got := p.cmd.Process.Pid; got != pid {
		t.Fatalf("%s: PID %d, want %d", p.name, got, pid)
	}
	if err := syscall.Kill(pid, 0); err != nil {
		t.Fatalf("%s: PID %d not alive: %v", p.name, pid, err)
	}
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	if err != nil {
		t.Fatalf("%s: readlink /proc/%d/exe: %v", p.name, pid, err)
	}
	want, err := filepath.EvalSymlinks(bin)
	if err != nil {
		t.Fatal(err)
	}
	if exe != want {
		t.Fatalf("%s: /proc/%d/exe → %q, want %q", p.name, pid, exe, want)
	}
}
