package daemon

import (
	"runtime/metrics"
	"strings"
	"testing"

	"github.com/spinifex/konnectivity/internal/promtext"
)

// Every runtime/metrics name the go_* families read exists in this Go
// release: an unknown one would read as 0 without a word.
func TestGoRuntimeNamesExist(t *testing.T) {
	known := map[string]bool{}
	for _, d := range metrics.All() {
		known[d.Name] = true
	}
	for _, n := range goRuntimeNames {
		if !known[n] {
			t.Errorf("runtime/metrics has no %s", n)
		}
	}
}

func TestProcStat(t *testing.T) {
	st, ok := readProcStat()
	if !ok || st.rss == 0 || st.vsize == 0 {
		t.Fatalf("readProcStat: %+v %v", st, ok)
	}
}

// The families are written in the text format with their types; the
// summary has its five quantiles.
func TestProcessAndGoFamilies(t *testing.T) {
	m := promtext.NewRegistry()
	AddProcessMetrics(m, "konnectivity_network_proxy_server_", "konnectivity test")
	var b strings.Builder
	if err := m.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{
		"# TYPE process_cpu_seconds_total counter\n",
		"# TYPE process_resident_memory_bytes gauge\n",
		"# TYPE go_gc_duration_seconds summary\n",
		`go_gc_duration_seconds{quantile="0.5"} `,
		"go_gc_duration_seconds_count ",
		"# TYPE go_memstats_alloc_bytes_total counter\n",
		`go_info{version="go`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("exposition lacks %q", want)
		}
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "go_memstats_sys_bytes ") && strings.HasSuffix(line, " 0") {
			t.Errorf("go_memstats_sys_bytes is 0: runtime/metrics not read before the scrape")
		}
	}
}
