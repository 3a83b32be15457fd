package promtext

import (
	"fmt"
	"io"
	"math"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Registry is a small Prometheus registry: counters, gauges and histograms
// with fixed label sets, written in the text exposition format. Updates are
// atomic adds, cheap enough for the per-dial path; nothing is locked per byte.
type Registry struct {
	mu       sync.Mutex
	families map[string]*family
	onScrape []func() // run before each scrape writes; guarded by mu
}

// OnScrape registers f to run at the start of every scrape, before any
// value is read: for families read together from one source.
func (m *Registry) OnScrape(f func()) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.onScrape = append(m.onScrape, f)
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{families: map[string]*family{}} }

type family struct {
	name, help, typ string
	labelNames      []string
	mu              sync.Mutex
	series          map[string]series // by rendered label values
	order           []string
}

type series interface {
	write(w io.Writer, name, labels string)
}

// Counter only goes up.
type Counter struct{ v atomic.Uint64 }

func (c *Counter) Add(n uint64) { c.v.Add(n) }
func (c *Counter) Inc()         { c.v.Add(1) }
func (c *Counter) Value() uint64 {
	return c.v.Load()
}
func (c *Counter) write(w io.Writer, name, labels string) {
	fmt.Fprintf(w, "%s%s %d\n", name, labels, c.v.Load())
}

// Gauge goes up and down.
type Gauge struct{ v atomic.Int64 }

func (g *Gauge) Add(n int64)  { g.v.Add(n) }
func (g *Gauge) Set(n int64)  { g.v.Store(n) }
func (g *Gauge) Value() int64 { return g.v.Load() }
func (g *Gauge) write(w io.Writer, name, labels string) {
	fmt.Fprintf(w, "%s%s %d\n", name, labels, g.v.Load())
}

// gaugeFunc reads its value when scraped.
type gaugeFunc func() float64

func (f gaugeFunc) write(w io.Writer, name, labels string) {
	fmt.Fprintf(w, "%s%s %s\n", name, labels, formatFloat(f()))
}

// summaryFunc reads a summary (quantile and value pairs, sum, count) when
// scraped.
type summaryFunc func() (quantiles [][2]float64, sum float64, count uint64)

func (f summaryFunc) write(w io.Writer, name, labels string) {
	q, sum, count := f()
	inner := strings.TrimSuffix(strings.TrimPrefix(labels, "{"), "}")
	if inner != "" {
		inner += ","
	}
	for _, p := range q {
		fmt.Fprintf(w, "%s{%squantile=\"%s\"} %s\n", name, inner, formatFloat(p[0]), formatFloat(p[1]))
	}
	fmt.Fprintf(w, "%s_sum%s %s\n", name, labels, formatFloat(sum))
	fmt.Fprintf(w, "%s_count%s %d\n", name, labels, count)
}

// Histogram counts observations into fixed buckets.
type Histogram struct {
	bounds []float64
	counts []atomic.Uint64 // one per bound, plus +Inf
	sumNs  atomic.Int64    // sum in nanoseconds (histograms here measure time)
	count  atomic.Uint64
}

// ObserveDuration records d.
func (h *Histogram) ObserveDuration(d time.Duration) {
	s := d.Seconds()
	i := sort.SearchFloat64s(h.bounds, s)
	h.counts[i].Add(1)
	h.sumNs.Add(int64(d))
	h.count.Add(1)
}

func (h *Histogram) write(w io.Writer, name, labels string) {
	var cum uint64
	inner := strings.TrimSuffix(strings.TrimPrefix(labels, "{"), "}")
	if inner != "" {
		inner += ","
	}
	for i, b := range h.bounds {
		cum += h.counts[i].Load()
		fmt.Fprintf(w, "%s_bucket{%sle=\"%s\"} %d\n", name, inner, formatFloat(b), cum)
	}
	cum += h.counts[len(h.bounds)].Load()
	fmt.Fprintf(w, "%s_bucket{%sle=\"+Inf\"} %d\n", name, inner, cum)
	fmt.Fprintf(w, "%s_sum%s %s\n", name, labels, formatFloat(float64(h.sumNs.Load())/1e9))
	fmt.Fprintf(w, "%s_count%s %d\n", name, labels, cum)
}

func formatFloat(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}

func (m *Registry) family(name, help, typ string, labelNames []string) *family {
	m.mu.Lock()
	defer m.mu.Unlock()
	if f, ok := m.families[name]; ok {
		if f.typ != typ {
			panic("metric " + name + " registered twice with different types")
		}
		return f
	}
	f := &family{name: name, help: help, typ: typ, labelNames: labelNames, series: map[string]series{}}
	m.families[name] = f
	return f
}

// get returns the series for these label values, creating it with mk.
func (f *family) get(values []string, mk func() series) series {
	if len(values) != len(f.labelNames) {
		panic(fmt.Sprintf("metric %s: %d label values for %d labels", f.name, len(values), len(f.labelNames)))
	}
	key := renderLabels(f.labelNames, values)
	f.mu.Lock()
	defer f.mu.Unlock()
	if s, ok := f.series[key]; ok {
		return s
	}
	s := mk()
	f.series[key] = s
	f.order = append(f.order, key)
	return s
}

// Counter returns the counter for the given label values (registering the
// family on first use). Callers keep the result; lookups are not for the
// hot path.
func (m *Registry) Counter(name, help string, labelNames []string, values ...string) *Counter {
	return m.family(name, help, "counter", labelNames).get(values, func() series { return &Counter{} }).(*Counter)
}

// Gauge returns the gauge for the given label values.
func (m *Registry) Gauge(name, help string, labelNames []string, values ...string) *Gauge {
	return m.family(name, help, "gauge", labelNames).get(values, func() series { return &Gauge{} }).(*Gauge)
}

// GaugeFunc registers a gauge read from f at scrape time.
func (m *Registry) GaugeFunc(name, help string, labelNames []string, values []string, f func() float64) {
	m.family(name, help, "gauge", labelNames).get(values, func() series { return gaugeFunc(f) })
}

// CounterFunc registers a counter read from f at scrape time.
func (m *Registry) CounterFunc(name, help string, labelNames []string, values []string, f func() float64) {
	m.family(name, help, "counter", labelNames).get(values, func() series { return gaugeFunc(f) })
}

// SummaryFunc registers a summary read from f at scrape time.
func (m *Registry) SummaryFunc(name, help string, f func() (quantiles [][2]float64, sum float64, count uint64)) {
	m.family(name, help, "summary", nil).get(nil, func() series { return summaryFunc(f) })
}

// Histogram returns the histogram with the given upper bounds (seconds).
func (m *Registry) Histogram(name, help string, bounds []float64, labelNames []string, values ...string) *Histogram {
	return m.family(name, help, "histogram", labelNames).get(values, func() series {
		return &Histogram{bounds: bounds, counts: make([]atomic.Uint64, len(bounds)+1)}
	}).(*Histogram)
}

// WriteText writes every family in the Prometheus text format, sorted by name.
func (m *Registry) WriteText(w io.Writer) error {
	m.mu.Lock()
	fams := make([]*family, 0, len(m.families))
	for _, f := range m.families {
		fams = append(fams, f)
	}
	hooks := append([]func(){}, m.onScrape...)
	m.mu.Unlock()
	for _, f := range hooks {
		f()
	}
	sort.Slice(fams, func(i, j int) bool { return fams[i].name < fams[j].name })
	var b strings.Builder
	for _, f := range fams {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n", f.name, escapeHelp(f.help), f.name, f.typ)
		f.mu.Lock()
		keys := append([]string(nil), f.order...)
		sort.Strings(keys)
		for _, k := range keys {
			f.series[k].write(&b, f.name, k)
		}
		f.mu.Unlock()
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func renderLabels(names, values []string) string {
	if len(names) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteByte('{')
	for i, n := range names {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%s=\"%s\"", n, escapeLabel(values[i]))
	}
	b.WriteByte('}')
	return b.String()
}

var (
	labelEscaper = strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`)
	helpEscaper  = strings.NewReplacer(`\`, `\\`, "\n", `\n`)
)

func escapeLabel(s string) string { return labelEscaper.Replace(s) }
func escapeHelp(s string) string  { return helpEscaper.Replace(s) }
