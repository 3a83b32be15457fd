package daemon

import (
	"bufio"
	"bytes"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
	"golang.org/x/sys/unix"
)

// The process and Go families every Prometheus client exports by default
// (client_golang's process and Go collectors), with their names, types and
// meaning, so that node and Go dashboards and alerts work unchanged. They
// are read when scraped: the process's from /proc/self, the Go runtime's
// from runtime/metrics (which, unlike runtime.ReadMemStats, does not stop
// the world).

// addProcessFamilies registers process_* (besides process_start_time_seconds).
func addProcessFamilies(m *promtext.Registry) {
	pageSize := float64(os.Getpagesize())
	m.CounterFunc("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", nil, nil, func() float64 {
		st, ok := readProcStat()
		if !ok {
			return 0
		}
		return float64(st.utime+st.stime) / userHZ
	})
	m.GaugeFunc("process_resident_memory_bytes", "Resident memory size in bytes.", nil, nil, func() float64 {
		st, _ := readProcStat()
		return float64(st.rss) * pageSize
	})
	m.GaugeFunc("process_virtual_memory_bytes", "Virtual memory size in bytes.", nil, nil, func() float64 {
		st, _ := readProcStat()
		return float64(st.vsize)
	})
	m.GaugeFunc("process_virtual_memory_max_bytes", "Maximum amount of virtual memory available in bytes.", nil, nil, func() float64 {
		return rlimit(unix.RLIMIT_AS)
	})
	m.GaugeFunc("process_open_fds", "Number of open file descriptors.", nil, nil, func() float64 {
		f, err := os.Open("/proc/self/fd")
		if err != nil {
			return 0
		}
		defer f.Close()
		names, _ := f.Readdirnames(-1)
		return float64(len(names) - 1) // less the one reading the directory
	})
	m.GaugeFunc("process_max_fds", "Maximum number of open file descriptors.", nil, nil, func() float64 {
		return rlimit(unix.RLIMIT_NOFILE)
	})
	m.CounterFunc("process_network_receive_bytes_total", "Number of bytes received by the process over the network.", nil, nil, func() float64 {
		rx, _ := readNetDev()
		return rx
	})
	m.CounterFunc("process_network_transmit_bytes_total", "Number of bytes sent by the process over the network.", nil, nil, func() float64 {
		_, tx := readNetDev()
		return tx
	})
}

// userHZ is the kernel's clock tick for /proc times (USER_HZ), 100 on
// every Linux architecture Go supports.
const userHZ = 100

type procStat struct {
	utime, stime uint64 // clock ticks
	vsize        uint64 // bytes
	rss          uint64 // pages
}

// readProcStat reads /proc/self/stat. The command name (field 2) may hold
// spaces and parentheses, so fields are counted from its closing one.
func readProcStat() (procStat, bool) {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return procStat{}, false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, false
	}
	f := strings.Fields(string(b[i+1:])) // f[0] is field 3 (state)
	if len(f) < 22 {
		return procStat{}, false
	}
	num := func(field int) uint64 { v, _ := strconv.ParseUint(f[field-3], 10, 64); return v }
	return procStat{utime: num(14), stime: num(15), vsize: num(23), rss: num(24)}, true
}

// readNetDev sums the received and sent bytes of every interface in the
// process's network namespace, as client_golang does.
func readNetDev() (rx, tx float64) {
	f, err := os.Open("/proc/self/net/dev")
	if err != nil {
		return 0, 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		_, counters, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue // the two header lines
		}
		c := strings.Fields(counters)
		if len(c) < 9 {
			continue
		}
		r, _ := strconv.ParseFloat(c[0], 64)
		t, _ := strconv.ParseFloat(c[8], 64)
		rx, tx = rx+r, tx+t
	}
	return rx, tx
}

func rlimit(resource int) float64 {
	var l unix.Rlimit
	if err := unix.Getrlimit(resource, &l); err != nil {
		return 0
	}
	return float64(l.Cur)
}

// goRuntime reads runtime/metrics once per scrape for all go_* families.
type goRuntime struct {
	mu      sync.Mutex // guards samples
	samples []metrics.Sample
	index   map[string]int // read only
}

// runtime/metrics names behind client_golang's go_memstats_* values.
var goRuntimeNames = []string{
	"/gc/heap/allocs:bytes", "/gc/heap/allocs:objects", "/gc/heap/frees:objects", "/gc/heap/tiny/allocs:objects",
	"/gc/heap/objects:objects", "/gc/heap/goal:bytes", "/memory/classes/total:bytes",
	"/memory/classes/heap/objects:bytes", "/memory/classes/heap/unused:bytes", "/memory/classes/heap/released:bytes",
	"/memory/classes/heap/free:bytes", "/memory/classes/heap/stacks:bytes", "/memory/classes/os-stacks:bytes",
	"/memory/classes/metadata/mspan/inuse:bytes", "/memory/classes/metadata/mspan/free:bytes",
	"/memory/classes/metadata/mcache/inuse:bytes", "/memory/classes/metadata/mcache/free:bytes",
	"/memory/classes/profiling/buckets:bytes", "/memory/classes/metadata/other:bytes", "/memory/classes/other:bytes",
	"/sched/gomaxprocs:threads", "/gc/gogc:percent", "/gc/gomemlimit:bytes",
}

func newGoRuntime() *goRuntime {
	g := &goRuntime{index: map[string]int{}}
	for i, name := range goRuntimeNames {
		g.samples = append(g.samples, metrics.Sample{Name: name})
		g.index[name] = i
	}
	return g
}

// read takes a new snapshot: once per scrape, before values are read.
func (g *goRuntime) read() {
	g.mu.Lock()
	defer g.mu.Unlock()
	metrics.Read(g.samples)
}

// value returns one runtime metric from the last snapshot.
func (g *goRuntime) value(name string) float64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	s := g.samples[g.index[name]]
	switch s.Value.Kind() {
	case metrics.KindUint64:
		return float64(s.Value.Uint64())
	case metrics.KindFloat64:
		return s.Value.Float64()
	}
	return 0
}

func (g *goRuntime) sum(names ...string) float64 {
	var t float64
	for _, n := range names {
		t += g.value(n)
	}
	return t
}

// addGoFamilies registers go_* (besides go_goroutines), as client_golang's
// Go collector computes them from runtime/metrics.
func addGoFamilies(m *promtext.Registry) {
	g := newGoRuntime()
	m.OnScrape(g.read)
	gauge := func(name, help string, f func() float64) { m.GaugeFunc(name, help, nil, nil, f) }
	counter := func(name, help string, f func() float64) { m.CounterFunc(name, help, nil, nil, f) }
	one := func(n string) func() float64 { return func() float64 { return g.value(n) } }
	const mem = "go_memstats_"
	heapInuse := func() float64 {
		return g.sum("/memory/classes/heap/objects:bytes", "/memory/classes/heap/unused:bytes")
	}
	heapIdle := func() float64 {
		return g.sum("/memory/classes/heap/released:bytes", "/memory/classes/heap/free:bytes")
	}
	gauge(mem+"alloc_bytes", "Number of bytes allocated in heap and currently in use. Equals to /memory/classes/heap/objects:bytes.", one("/memory/classes/heap/objects:bytes"))
	counter(mem+"alloc_bytes_total", "Total number of bytes allocated in heap until now, even if released already. Equals to /gc/heap/allocs:bytes.", one("/gc/heap/allocs:bytes"))
	gauge(mem+"sys_bytes", "Number of bytes obtained from system. Equals to /memory/classes/total:byte.", one("/memory/classes/total:bytes"))
	counter(mem+"mallocs_total", "Total number of heap objects allocated, both live and gc-ed. Semantically a counter version for go_memstats_heap_objects gauge. Equals to /gc/heap/allocs:objects + /gc/heap/tiny/allocs:objects.", func() float64 {
		return g.sum("/gc/heap/allocs:objects", "/gc/heap/tiny/allocs:objects")
	})
	counter(mem+"frees_total", "Total number of heap objects frees. Equals to /gc/heap/frees:objects + /gc/heap/tiny/allocs:objects.", func() float64 {
		return g.sum("/gc/heap/frees:objects", "/gc/heap/tiny/allocs:objects")
	})
	gauge(mem+"heap_alloc_bytes", "Number of heap bytes allocated and currently in use, same as go_memstats_alloc_bytes. Equals to /memory/classes/heap/objects:bytes.", one("/memory/classes/heap/objects:bytes"))
	gauge(mem+"heap_sys_bytes", "Number of heap bytes obtained from system. Equals to /memory/classes/heap/objects:bytes + /memory/classes/heap/unused:bytes + /memory/classes/heap/released:bytes + /memory/classes/heap/free:bytes.", func() float64 { return heapInuse() + heapIdle() })
	gauge(mem+"heap_idle_bytes", "Number of heap bytes waiting to be used. Equals to /memory/classes/heap/released:bytes + /memory/classes/heap/free:bytes.", heapIdle)
	gauge(mem+"heap_inuse_bytes", "Number of heap bytes that are in use. Equals to /memory/classes/heap/objects:bytes + /memory/classes/heap/unused:bytes", heapInuse)
	gauge(mem+"heap_released_bytes", "Number of heap bytes released to OS. Equals to /memory/classes/heap/released:bytes.", one("/memory/classes/heap/released:bytes"))
	gauge(mem+"heap_objects", "Number of currently allocated objects. Equals to /gc/heap/objects:objects.", one("/gc/heap/objects:objects"))
	gauge(mem+"stack_inuse_bytes", "Number of bytes obtained from system for stack allocator in non-CGO environments. Equals to /memory/classes/heap/stacks:bytes.", one("/memory/classes/heap/stacks:bytes"))
	gauge(mem+"stack_sys_bytes", "Number of bytes obtained from system for stack allocator. Equals to /memory/classes/heap/stacks:bytes + /memory/classes/os-stacks:bytes.", func() float64 {
		return g.sum("/memory/classes/heap/stacks:bytes", "/memory/classes/os-stacks:bytes")
	})
	gauge(mem+"mspan_inuse_bytes", "Number of bytes in use by mspan structures. Equals to /memory/classes/metadata/mspan/inuse:bytes.", one("/memory/classes/metadata/mspan/inuse:bytes"))
	gauge(mem+"mspan_sys_bytes", "Number of bytes used for mspan structures obtained from system. Equals to /memory/classes/metadata/mspan/inuse:bytes + /memory/classes/metadata/mspan/free:bytes.", func() float64 {
		return g.sum("/memory/classes/metadata/mspan/inuse:bytes", "/memory/classes/metadata/mspan/free:bytes")
	})
	gauge(mem+"mcache_inuse_bytes", "Number of bytes in use by mcache structures. Equals to /memory/classes/metadata/mcache/inuse:bytes.", one("/memory/classes/metadata/mcache/inuse:bytes"))
	gauge(mem+"mcache_sys_bytes", "Number of bytes used for mcache structures obtained from system. Equals to /memory/classes/metadata/mcache/inuse:bytes + /memory/classes/metadata/mcache/free:bytes.", func() float64 {
		return g.sum("/memory/classes/metadata/mcache/inuse:bytes", "/memory/classes/metadata/mcache/free:bytes")
	})
	gauge(mem+"buck_hash_sys_bytes", "Number of bytes used by the profiling bucket hash table. Equals to /memory/classes/profiling/buckets:bytes.", one("/memory/classes/profiling/buckets:bytes"))
	gauge(mem+"gc_sys_bytes", "Number of bytes used for garbage collection system metadata. Equals to /memory/classes/metadata/other:bytes.", one("/memory/classes/metadata/other:bytes"))
	gauge(mem+"other_sys_bytes", "Number of bytes used for other system allocations. Equals to /memory/classes/other:bytes.", one("/memory/classes/other:bytes"))
	gauge(mem+"next_gc_bytes", "Number of heap bytes when next garbage collection will take place. Equals to /gc/heap/goal:bytes.", one("/gc/heap/goal:bytes"))
	gauge("go_sched_gomaxprocs_threads", "The current runtime.GOMAXPROCS setting, or the number of operating system threads that can execute user-level Go code simultaneously. Sourced from /sched/gomaxprocs:threads.", one("/sched/gomaxprocs:threads"))
	gauge("go_gc_gogc_percent", "Heap size target percentage configured by the user, otherwise 100. Sourced from /gc/gogc:percent.", one("/gc/gogc:percent"))
	gauge("go_gc_gomemlimit_bytes", "Go runtime memory limit configured by the user, otherwise math.MaxInt64. Sourced from /gc/gomemlimit:bytes.", one("/gc/gomemlimit:bytes"))

	gauge("go_threads", "Number of OS threads created.", func() float64 {
		n, _ := runtime.ThreadCreateProfile(nil)
		return float64(n)
	})
	m.GaugeFunc("go_info", "Information about the Go environment.", []string{"version"}, []string{runtime.Version()}, func() float64 { return 1 })
	gauge(mem+"last_gc_time_seconds", "Number of seconds since 1970 of last garbage collection.", func() float64 {
		var s debug.GCStats
		debug.ReadGCStats(&s)
		return float64(s.LastGC.UnixNano()) / 1e9
	})
	m.SummaryFunc("go_gc_duration_seconds", "A summary of the wall-time pause (stop-the-world) duration in garbage collection cycles.", func() ([][2]float64, float64, uint64) {
		s := debug.GCStats{PauseQuantiles: make([]time.Duration, 5)}
		debug.ReadGCStats(&s)
		q := make([][2]float64, 5)
		for i, p := range s.PauseQuantiles {
			q[i] = [2]float64{float64(i) / 4, p.Seconds()}
		}
		return q, s.PauseTotal.Seconds(), uint64(s.NumGC)
	})
}
