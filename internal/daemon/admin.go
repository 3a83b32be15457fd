package daemon

import (
	"encoding/json"
	"net/http"
	"runtime"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
)

// metricsHandler serves the registry in the Prometheus text format.
func metricsHandler(m *promtext.Registry) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		m.WriteText(w)
	})
}

// jsonHandler serves what status returns, for /debug/tunnels.
func jsonHandler(status func() any) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.Encode(status())
	})
}

// AddProcessMetrics registers when the process started and what build it
// runs (version, as "konnectivity_network_proxy_server_build_info" and
// the like with prefix), and the process and Go families of a default
// Prometheus client (process_metrics.go).
func AddProcessMetrics(m *promtext.Registry, prefix, version string) {
	start := float64(time.Now().UnixNano()) / 1e9
	m.GaugeFunc("process_start_time_seconds", "Start time of the process since the Unix epoch, in seconds.", nil, nil, func() float64 { return start })
	m.GaugeFunc(prefix+"build_info", "Build of the running binary; the value is always 1.", []string{"version", "goversion"}, []string{version, runtime.Version()}, func() float64 { return 1 })
	// The Go collector's name, so existing leak alerts work: one per open
	// tunnel and a few per connection, so a count that only grows is a leak.
	m.GaugeFunc("go_goroutines", "Number of goroutines that currently exist.", nil, nil, func() float64 { return float64(runtime.NumGoroutine()) })
	addProcessFamilies(m)
	addGoFamilies(m)
}

// serviceMux is the health service's mux: /healthz, /livez, /readyz and
// /metrics.
func serviceMux(ready, readyAll []Check, m *promtext.Registry) *http.ServeMux {
	mux := healthMux(ready, readyAll...)
	mux.Handle("/metrics", metricsHandler(m))
	return mux
}

// adminMux adds to a service mux what only the admin port serves:
// /debug/tunnels and, with profiling, pprof.
func adminMux(mux *http.ServeMux, status func() any, profiling bool) *http.ServeMux {
	mux.Handle("/debug/tunnels", jsonHandler(status))
	if profiling {
		addProfiling(mux)
	}
	return mux
}
