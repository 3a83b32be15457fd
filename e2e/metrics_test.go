package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
)

// Metrics, health and status (docs/metrics.md).

const (
	srvPrefix = "konnectivity_network_proxy_server_"
	agtPrefix = "konnectivity_network_proxy_agent_"
)

// wantFamily is a family that must exist with this type and these label
// names on every series.
type wantFamily struct {
	name   string
	typ    dto.MetricType
	labels []string
}

var serverFamilies = []wantFamily{
	{srvPrefix + "dial_duration_seconds", dto.MetricType_HISTOGRAM, nil},
	{srvPrefix + "established_connections", dto.MetricType_GAUGE, nil},
	{srvPrefix + "http_connections", dto.MetricType_GAUGE, nil},
	{srvPrefix + "grpc_connections", dto.MetricType_GAUGE, []string{"service_method"}},
	{srvPrefix + "ready_backend_connections", dto.MetricType_GAUGE, nil},
	{srvPrefix + "ready_backends", dto.MetricType_GAUGE, []string{"proxy_strategy"}},
	{srvPrefix + "pending_backend_dials", dto.MetricType_GAUGE, nil},
	{srvPrefix + "dial_failure_count", dto.MetricType_COUNTER, []string{"reason"}},
	{srvPrefix + "connection_duration_seconds", dto.MetricType_HISTOGRAM, nil},
	{srvPrefix + "bytes_total", dto.MetricType_COUNTER, []string{"direction"}},
	{srvPrefix + "stream_resets_total", dto.MetricType_COUNTER, nil},
	{srvPrefix + "credit_stalls_total", dto.MetricType_COUNTER, []string{"kind"}},
	{srvPrefix + "agents_refused_total", dto.MetricType_COUNTER, nil},
	{srvPrefix + "token_reviews_total", dto.MetricType_COUNTER, []string{"result"}},
	{srvPrefix + "certificate_not_after_seconds", dto.MetricType_GAUGE, []string{"listener"}},
	{srvPrefix + "build_info", dto.MetricType_GAUGE, []string{"version", "goversion"}},
	{srvPrefix + "log_lines_dropped_total", dto.MetricType_COUNTER, nil},
	{"process_start_time_seconds", dto.MetricType_GAUGE, nil},
}

var agentFamilies = []wantFamily{
	{agtPrefix + "dial_duration_seconds", dto.MetricType_HISTOGRAM, nil},
	{agtPrefix + "endpoint_dial_failure_total", dto.MetricType_COUNTER, []string{"reason"}},
	{agtPrefix + "open_server_connections", dto.MetricType_GAUGE, nil},
	{agtPrefix + "known_server_count", dto.MetricType_GAUGE, nil},
	{agtPrefix + "open_endpoint_connections", dto.MetricType_GAUGE, nil},
	{agtPrefix + "bytes_total", dto.MetricType_COUNTER, []string{"direction"}},
	{agtPrefix + "stream_resets_total", dto.MetricType_COUNTER, nil},
	{agtPrefix + "credit_stalls_total", dto.MetricType_COUNTER, []string{"kind"}},
	{agtPrefix + "build_info", dto.MetricType_GAUGE, []string{"version", "goversion"}},
	{agtPrefix + "log_lines_dropped_total", dto.MetricType_COUNTER, nil},
	{"process_start_time_seconds", dto.MetricType_GAUGE, nil},
}

// checkFamilies fails for every wanted family that is missing, has another
// type, or has a series with other label names.
func checkFamilies(t *testing.T, where string, fams metricFamilies, want []wantFamily) {
	t.Helper()
	for _, w := range want {
		f := fams[w.name]
		if f == nil {
			t.Errorf("%s: family %s missing", where, w.name)
			continue
		}
		if f.GetType() != w.typ {
			t.Errorf("%s: %s has type %v, want %v", where, w.name, f.GetType(), w.typ)
		}
		if len(f.GetMetric()) == 0 {
			t.Errorf("%s: %s has no series", where, w.name)
		}
		for _, m := range f.GetMetric() {
			var names []string
			for _, lp := range m.GetLabel() {
				names = append(names, lp.GetName())
			}
			slices.Sort(names)
			wantNames := slices.Clone(w.labels)
			slices.Sort(wantNames)
			if !slices.Equal(names, wantNames) {
				t.Errorf("%s: %s series with labels %v, want %v", where, w.name, names, wantNames)
			}
		}
	}
}

// labelValues lists the values of label on the series of family name.
func labelValues(fams metricFamilies, name, label string) []string {
	var out []string
	for _, m := range fams[name].GetMetric() {
		for _, lp := range m.GetLabel() {
			if lp.GetName() == label {
				out = append(out, lp.GetValue())
			}
		}
	}
	slices.Sort(out)
	return out
}

// TestMetrics parses every /metrics endpoint with Prometheus' parser,
// checks the documented families, and watches values move with dials.
func TestMetrics(t *testing.T) {
	s := startServer(t, "--agent-wait=500ms", "--proxy-strategies=destHost,default")
	srvHealth := s.healthURL("/metrics")
	srvAdmin := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	d := s.egressDialer(t)
	failures := func(reason string) float64 {
		return metricValue(t, srvHealth, srvPrefix+"dial_failure_count", "reason", reason)
	}

	t.Run("readyz-no-agent", func(t *testing.T) {
		code, body, err := fetch(s.healthURL("/readyz?verbose"))
		if err != nil || code != http.StatusServiceUnavailable || !strings.Contains(body, "[-]agents failed") {
			t.Fatalf("/readyz?verbose with no agent: %d %q %v; want 503 with \"[-]agents failed\"", code, body, err)
		}
		t.Logf("/readyz?verbose, no agent: %d %q", code, body)
	})

	t.Run("no-agent", func(t *testing.T) {
		before := failures("no_agent")
		if _, err := dialErr(t, d, backend, 10*time.Second); err == nil || !strings.Contains(err.Error(), "code 503") {
			t.Fatalf("dial with no agent: %v, want code 503", err)
		}
		if got := failures("no_agent"); got != before+1 {
			t.Errorf("dial_failure_count{reason=\"no_agent\"} = %v after a 503, want %v", got, before+1)
		}
	})

	a := s.startAgent(t, "a1", "host=node-1&ipv4=127.0.0.1")
	agtHealth := a.healthURL("/metrics")
	agtAdmin := fmt.Sprintf("http://127.0.0.1:%d/metrics", a.adminPort)

	t.Run("families", func(t *testing.T) {
		for _, u := range []string{srvHealth, srvAdmin} {
			fams := scrape(t, u)
			checkFamilies(t, u, fams, serverFamilies)
			reasons := labelValues(fams, srvPrefix+"dial_failure_count", "reason")
			for _, r := range []string{"no_agent", "error_response", "backend_dial_timeout", "frontend_close", "bad_request", "forbidden", "backend_close", "shutdown"} {
				if !slices.Contains(reasons, r) {
					t.Errorf("%s: dial_failure_count has no reason=%q (has %v)", u, r, reasons)
				}
			}
			if got := labelValues(fams, srvPrefix+"ready_backends", "proxy_strategy"); !slices.Equal(got, []string{"default", "destHost"}) {
				t.Errorf("%s: ready_backends strategies %v, want [default destHost]", u, got)
			}
			if v := fams.value(srvPrefix + "ready_backend_connections"); v != 1 {
				t.Errorf("%s: ready_backend_connections = %v, want 1", u, v)
			}
			for _, st := range []string{"default", "destHost"} {
				if v := fams.value(srvPrefix+"ready_backends", "proxy_strategy", st); v != 1 {
					t.Errorf("%s: ready_backends{proxy_strategy=%q} = %v, want 1", u, st, v)
				}
			}
			if v := fams.value(srvPrefix + "build_info"); v != 1 {
				t.Errorf("%s: build_info = %v, want 1", u, v)
			}
			if v := fams.value(srvPrefix+"certificate_not_after_seconds", "listener", "agents"); v < float64(time.Now().Unix()) {
				t.Errorf("%s: certificate_not_after_seconds{listener=\"agents\"} = %v, want a future time", u, v)
			}
			checkStartTime(t, u, fams)
		}
		for _, u := range []string{agtHealth, agtAdmin} {
			fams := scrape(t, u)
			checkFamilies(t, u, fams, agentFamilies)
			if v := fams.value(agtPrefix + "open_server_connections"); v != 1 {
				t.Errorf("%s: open_server_connections = %v, want 1", u, v)
			}
			if v := fams.value(agtPrefix + "known_server_count"); v != 1 {
				t.Errorf("%s: known_server_count = %v, want 1", u, v)
			}
			checkStartTime(t, u, fams)
		}
		fams := scrape(t, srvAdmin)
		t.Logf("build_info: %v", fams[srvPrefix+"build_info"].GetMetric()[0].GetLabel())
	})

	t.Run("readyz-verbose", func(t *testing.T) {
		code, body, err := fetch(s.healthURL("/readyz?verbose"))
		if err != nil || code != http.StatusOK || !strings.Contains(body, "[+]agents ok") {
			t.Fatalf("server /readyz?verbose: %d %q %v; want 200 with \"[+]agents ok\"", code, body, err)
		}
		t.Logf("server /readyz?verbose: %q", body)
		code, body, err = fetch(a.healthURL("/readyz?verbose"))
		if err != nil || code != http.StatusOK || !strings.Contains(body, "[+]") || !strings.Contains(body, "connected 1/1 servers") {
			t.Fatalf("agent /readyz?verbose: %d %q %v; want 200 with \"[+]…connected 1/1 servers\"", code, body, err)
		}
		t.Logf("agent /readyz?verbose: %q", body)
	})

	t.Run("successful-dial", func(t *testing.T) {
		srvDials := metricValue(t, srvHealth, srvPrefix+"dial_duration_seconds")
		agtDials := metricValue(t, agtHealth, agtPrefix+"dial_duration_seconds")
		toAgent := metricValue(t, srvHealth, srvPrefix+"bytes_total", "direction", "to_agent")
		checkReachable(t, d, backend, "b1", 3)
		if got := metricValue(t, srvHealth, srvPrefix+"dial_duration_seconds"); got != srvDials+3 {
			t.Errorf("server dial_duration_seconds count %v after 3 dials, was %v", got, srvDials)
		}
		if got := metricValue(t, agtHealth, agtPrefix+"dial_duration_seconds"); got != agtDials+3 {
			t.Errorf("agent dial_duration_seconds count %v after 3 dials, was %v", got, agtDials)
		}
		if got := metricValue(t, srvHealth, srvPrefix+"bytes_total", "direction", "to_agent"); got <= toAgent {
			t.Errorf("bytes_total{direction=\"to_agent\"} %v after 3 requests, was %v", got, toAgent)
		}
		// Tunnels that closed are counted in connection_duration_seconds.
		waitFor(t, 10*time.Second, "connection_duration_seconds counts the closed tunnels", func() bool {
			return metricValue(t, srvHealth, srvPrefix+"connection_duration_seconds") >= 3
		})
	})

	t.Run("error-response", func(t *testing.T) {
		before := failures("error_response")
		agtBefore := metricValue(t, agtHealth, agtPrefix+"endpoint_dial_failure_total", "reason", "unknown")
		if _, err := dialErr(t, d, closedPort(t), 10*time.Second); err == nil || !strings.Contains(err.Error(), "code 502") {
			t.Fatalf("dial to a closed port: %v, want code 502", err)
		}
		if got := failures("error_response"); got != before+1 {
			t.Errorf("dial_failure_count{reason=\"error_response\"} = %v after a 502, want %v", got, before+1)
		}
		agtAfter := scrape(t, agtHealth)
		if got := agtAfter.value(agtPrefix+"endpoint_dial_failure_total", "reason", "unknown"); got != agtBefore+1 {
			t.Errorf("agent endpoint_dial_failure_total{reason=\"unknown\"} = %v after a refused dial, want %v (all: %v)",
				got, agtBefore+1, agtAfter[agtPrefix+"endpoint_dial_failure_total"].GetMetric())
		}
	})

	t.Run("established-rises-and-falls", func(t *testing.T) {
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		base := scrape(t, srvHealth)
		if v := base.value(srvPrefix + "established_connections"); v != 0 {
			t.Fatalf("established_connections = %v with no tunnel open", v)
		}
		c := rawUDS(t, s)
		if _, err := io.WriteString(c, connectHead(echo.addr())); err != nil {
			t.Fatal(err)
		}
		readExactly(t, c, established)
		if err := echoOnce(c, bufio.NewReader(c), "open\n"); err != nil {
			t.Fatal(err)
		}
		open := scrape(t, srvHealth)
		for name, want := range map[string]float64{
			srvPrefix + "established_connections": 1,
			srvPrefix + "http_connections":        1,
			srvPrefix + "pending_backend_dials":   0,
		} {
			if v := open.value(name); v != want {
				t.Errorf("with one tunnel open: %s = %v, want %v", name, v, want)
			}
		}
		if v := metricValue(t, agtHealth, agtPrefix+"open_endpoint_connections"); v != 1 {
			t.Errorf("with one tunnel open: agent open_endpoint_connections = %v, want 1", v)
		}
		c.Close()
		waitMetric(t, srvHealth, 0, srvPrefix+"established_connections")
		waitMetric(t, srvHealth, 0, srvPrefix+"http_connections")
		waitMetric(t, agtHealth, 0, agtPrefix+"open_endpoint_connections")
	})
}

func checkStartTime(t *testing.T, where string, fams metricFamilies) {
	t.Helper()
	st := fams.value("process_start_time_seconds")
	now := float64(time.Now().UnixNano()) / 1e9
	if st <= 0 || st > now || now-st > 600 {
		t.Errorf("%s: process_start_time_seconds = %v, now %v", where, st, now)
	}
}

// TestStatusTopology: two servers, three agents that each hold both
// (--proxy-server-host=a,b). Every server's /debug/tunnels lists the three
// agents, every agent's lists both servers, and `konnectivity status`
// prints them as an aligned table.
func TestStatusTopology(t *testing.T) {
	ips := []string{"127.0.0.1", "127.0.0.2"}
	if err := canListen(ips...); err != nil {
		t.Skipf("needs 127.0.0.2 on loopback (Linux): %v", err)
	}
	p := newPKI(t, t.TempDir(), net.ParseIP("127.0.0.2"))
	port := freePortOn(t, ips...)
	var servers []*server
	for i, ip := range ips {
		servers = append(servers, startServerOpts(t, serverOpts{pki: p, clusterCA: p.caCert,
			agentBind: ip, agentPort: port,
			extra: []string{"--server-id=s" + strconv.Itoa(i+1), "--server-count=2"}}))
	}
	var agents []*agent
	idents := map[string]string{}
	for i := 1; i <= 3; i++ {
		id := "node-" + strconv.Itoa(i)
		idents[id] = fmt.Sprintf("host=%s&ipv4=10.0.0.%d", id, i)
		agents = append(agents, startAgentArgs(t, id,
			haAgentArgs(p, "127.0.0.1,127.0.0.2", port, "--agent-identifiers="+idents[id])...))
	}
	el := waitMesh(t, servers, agents, 2, meshBound)
	t.Logf("2 servers x 3 agents meshed after %v", el.Round(time.Millisecond))

	for i, s := range servers {
		var st struct {
			Role        string `json:"role"`
			ServerID    string `json:"serverID"`
			ServerCount int    `json:"serverCount"`
			Agents      []struct {
				ID          string    `json:"id"`
				Identifiers string    `json:"identifiers"`
				Remote      string    `json:"remote"`
				Since       time.Time `json:"since"`
				OpenStreams *int64    `json:"openStreams"`
				Draining    *bool     `json:"draining"`
			} `json:"agents"`
		}
		getJSON(t, fmt.Sprintf("http://127.0.0.1:%d/debug/tunnels", s.adminPort), &st)
		wantID := "s" + strconv.Itoa(i+1)
		if st.Role != "server" || st.ServerID != wantID || st.ServerCount != 2 || len(st.Agents) != 3 {
			t.Errorf("server %s /debug/tunnels: role %q id %q count %d agents %d; want server %s 2 3",
				wantID, st.Role, st.ServerID, st.ServerCount, len(st.Agents), wantID)
		}
		for _, a := range st.Agents {
			want, ok := idents[a.ID]
			if !ok {
				t.Errorf("server %s lists unknown agent %q", wantID, a.ID)
				continue
			}
			if !sameIdentifiers(a.Identifiers, want) {
				t.Errorf("server %s: agent %s identifiers %q, want %q", wantID, a.ID, a.Identifiers, want)
			}
			if a.Remote == "" || a.Since.IsZero() || a.OpenStreams == nil || a.Draining == nil || *a.Draining {
				t.Errorf("server %s: agent %s entry incomplete: %+v", wantID, a.ID, a)
			}
		}
		out := runStatus(t, fmt.Sprintf("127.0.0.1:%d", s.adminPort))
		if !strings.Contains(out, fmt.Sprintf("server %s (server count 2): 3 agent(s)", wantID)) {
			t.Errorf("status of %s: no summary line:\n%s", wantID, out)
		}
		rows := checkTable(t, out, "AGENT", []string{"AGENT", "REMOTE", "CONNECTED", "TUNNELS", "TO AGENT", "FROM AGENT", "DRAINING", "STALLS", "WAITING", "IDENTIFIERS"})
		for id := range idents {
			if !slices.ContainsFunc(rows, func(r string) bool { return strings.HasPrefix(r, id+" ") }) {
				t.Errorf("status of %s: no row for agent %s:\n%s", wantID, id, out)
			}
		}
		if i == 0 {
			t.Logf("konnectivity status (server):\n%s", out)
		}
	}

	for _, a := range agents {
		var st struct {
			Role    string `json:"role"`
			AgentID string `json:"agentID"`
			Held    int    `json:"held"`
			Want    int    `json:"want"`
			Servers []struct {
				ServerID string `json:"serverID"`
				Addr     string `json:"addr"`
				Count    int    `json:"serverCount"`
			} `json:"servers"`
		}
		getJSON(t, fmt.Sprintf("http://127.0.0.1:%d/debug/tunnels", a.adminPort), &st)
		var ids []string
		for _, l := range st.Servers {
			ids = append(ids, l.ServerID)
			if l.Count != 2 || l.Addr == "" {
				t.Errorf("agent %s: server entry %+v", a.id, l)
			}
		}
		if st.Role != "agent" || st.AgentID != a.id || st.Held != 2 || st.Want != 2 || !slices.Equal(ids, []string{"s1", "s2"}) {
			t.Errorf("agent %s /debug/tunnels: %+v; want agent with s1 and s2, 2/2", a.id, st)
		}
		out := runStatus(t, fmt.Sprintf("127.0.0.1:%d", a.adminPort))
		if !strings.Contains(out, fmt.Sprintf("agent %s: connected 2/2 servers", a.id)) {
			t.Errorf("status of agent %s: no summary line:\n%s", a.id, out)
		}
		rows := checkTable(t, out, "SERVER", []string{"SERVER", "ADDRESS", "CONNECTED", "SERVER COUNT", "TUNNELS", "STALLS", "WAITING"})
		if len(rows) != 2 || !strings.HasPrefix(rows[0], "s1 ") || !strings.HasPrefix(rows[1], "s2 ") {
			t.Errorf("status of agent %s: rows %q, want s1 and s2", a.id, rows)
		}
		if a.id == "node-1" {
			t.Logf("konnectivity status (agent):\n%s", out)
		}
	}
}

// sameIdentifiers compares two URL-query identifier strings ignoring order.
func sameIdentifiers(a, b string) bool {
	as, bs := strings.Split(a, "&"), strings.Split(b, "&")
	slices.Sort(as)
	slices.Sort(bs)
	return slices.Equal(as, bs)
}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	resp, err := noKeepAlive.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %s", url, resp.StatusCode, body)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Errorf("GET %s: Content-Type %q", url, ct)
	}
	if err := json.Unmarshal(body, v); err != nil {
		t.Fatalf("GET %s: %v\n%s", url, err, body)
	}
}

// runStatus runs `konnectivity status --admin-address addr`.
func runStatus(t *testing.T, addr string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, konnectivityBin, "status", "--admin-address", addr).CombinedOutput()
	if err != nil {
		t.Fatalf("konnectivity status --admin-address %s: %v\n%s", addr, err, out)
	}
	return string(out)
}

// checkTable finds the header line (starting with first) and checks that
// every following row has a value starting exactly under each column
// title, preceded by a space: the columns are aligned. It returns the rows.
func checkTable(t *testing.T, out, first string, cols []string) []string {
	t.Helper()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	h := slices.IndexFunc(lines, func(l string) bool { return strings.HasPrefix(l, first+" ") })
	if h < 0 {
		t.Errorf("no header starting with %q:\n%s", first, out)
		return nil
	}
	header := lines[h]
	var offs []int
	from := 0
	for _, c := range cols {
		i := strings.Index(header[from:], c)
		if i < 0 {
			t.Errorf("header %q lacks column %q", header, c)
			return nil
		}
		offs = append(offs, from+i)
		from += i + len(c)
	}
	rows := lines[h+1:]
	for _, r := range rows {
		for ci, off := range offs[1:] {
			if len(r) <= off || r[off] == ' ' || r[off-1] != ' ' {
				t.Errorf("row %q: column %q (offset %d) not aligned with the header %q", r, cols[ci+1], off, header)
				break
			}
		}
	}
	return rows
}
