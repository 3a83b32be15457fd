package promtext

import (
	"strings"
	"testing"
	"time"
)

func TestTextFormat(t *testing.T) {
	m := NewRegistry()
	m.Counter("x_total", "A counter\nwith a newline and \\.", []string{"reason"}, "a \"quoted\"\\path\n").Add(3)
	m.Gauge("y", "A gauge.", nil).Set(-2)
	h := m.Histogram("z_seconds", "A histogram.", []float64{0.1, 1}, []string{"k"}, "v")
	h.ObserveDuration(50 * time.Millisecond)
	h.ObserveDuration(500 * time.Millisecond)
	h.ObserveDuration(5 * time.Second)
	var b strings.Builder
	if err := m.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	want := `# HELP x_total A counter\nwith a newline and \\.
# TYPE x_total counter
x_total{reason="a \"quoted\"\\path\n"} 3
# HELP y A gauge.
# TYPE y gauge
y -2
# HELP z_seconds A histogram.
# TYPE z_seconds histogram
z_seconds_bucket{k="v",le="0.1"} 1
z_seconds_bucket{k="v",le="1"} 2
z_seconds_bucket{k="v",le="+Inf"} 3
z_seconds_sum{k="v"} 5.55
z_seconds_count{k="v"} 3
`
	if b.String() != want {
		t.Fatalf("got:\n%s\nwant:\n%s", b.String(), want)
	}
}
