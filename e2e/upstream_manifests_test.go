package e2e

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	apiserverapi "k8s.io/apiserver/pkg/apis/apiserver"
)

// The command lines of upstream's deployments, as data: the args of
// apiserver-network-proxy's examples/ (kind, kind-multinode, kubernetes)
// and of its e2e suite (e2e/static_count_test.go, e2e/lease_count_test.go),
// and of the Kubernetes documentation's konnectivity example
// (kubernetes/website content/en/examples/admin/konnectivity). Only what
// cannot exist here is replaced (see manifestEnv.rewrite): file paths,
// host names and ports; "$(HOST_IP)" is expanded as Kubernetes expands it
// from the pod's env, "${HOST_IP}" is not (Kubernetes does not either).
type upstreamManifest struct {
	name          string
	server, agent []string
	// The start-up warnings each process must print, and no other: each
	// names a row of docs/upstream.md.
	serverWarns, agentWarns []string
	// bound: the fake apiserver answers as Kubernetes 1.30+ does for a
	// pod-bound token (node-name and pod-name claims, the pod's name the
	// agent's default ID), and its Node lookups as named. Empty: as
	// before 1.30, no claims.
	bound string
}

// How the fake apiserver of a bound manifest answers GET /api/v1/nodes/NAME.
const (
	boundNodesForbidden = "nodes-forbidden" // 403: upstream's RBAC grants no get on nodes
	boundNodesReadable  = "nodes-readable"  // the Node, with the agent's $(HOST_IP) as its address
)

// Warnings, one per row of docs/upstream.md that these
// command lines meet.
const (
	warnLogFileIgnored = "--log-file and --log-dir are ignored while --logtostderr=true"
	warnProbeInterval  = "flag=--probe-interval"
	warnIdentifier     = `--agent-identifiers: value ignored; upstream checks keys only, and it names nothing a dial can match" identifier="ipv4=${HOST_IP}: an unexpanded variable`
	// The fake apiserver answers TokenReviews as Kubernetes before 1.30
	// does, without the token's node (docs/upstream.md "agent identity" row).
	warnIdentityOff = "agent identity binding is off for tokens without node claims"
	// The server may not get nodes: node-bound agents' addresses are
	// dropped (docs/upstream.md "agent identity" rows).
	warnAddressDropped = "ipv4=/ipv6= identifiers of agents with node-bound tokens are dropped"
	// An agent counting Leases outside a pod has no API access: it says so
	// once and goes on with the announced count (docs/upstream.md "--count-server-leases" row).
	warnLeaseAgent = "cannot count server leases: using the server count the servers announce"
)

// The kind example's command lines (apiserver-network-proxy examples/kind).
var (
	anpKindServer = []string{
		"--log-file=/var/log/konnectivity-server.log", "--logtostderr=true", "--log-file-max-size=0",
		"--uds-name=/etc/kubernetes/konnectivity-server/konnectivity-server.socket", "--delete-existing-uds-file",
		"--cluster-cert=/etc/kubernetes/pki/apiserver.crt", "--cluster-key=/etc/kubernetes/pki/apiserver.key",
		"--server-port=0", "--agent-port=8091", "--health-port=8092", "--admin-port=8093", "--keepalive-time=1h",
		"--mode=grpc", "--agent-namespace=kube-system", "--agent-service-account=konnectivity-agent",
		"--kubeconfig=/etc/kubernetes/admin.conf", "--authentication-audience=system:konnectivity-server",
	}
	anpKindAgent = []string{
		"--logtostderr=true", "--ca-cert=/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
		"--proxy-server-host=konnectivity-server.kube-system.svc.cluster.local", "--proxy-server-port=8091",
		"--sync-interval=5s", "--sync-interval-cap=30s", "--probe-interval=5s",
		"--service-account-token-path=/var/run/secrets/tokens/konnectivity-agent-token",
		"--agent-identifiers=ipv4=$(HOST_IP)",
	}
)

var upstreamManifests = []upstreamManifest{
	{
		name:        "anp-examples-kind",
		server:      anpKindServer,
		agent:       anpKindAgent,
		serverWarns: []string{warnLogFileIgnored, warnIdentityOff},
		agentWarns:  []string{warnProbeInterval},
	},
	{
		// Kubernetes 1.30+: the agent's projected token is bound to its
		// pod, and upstream's RBAC (system:auth-delegator) does not let
		// the server get nodes. The agent's ID is its default, the host
		// name (the pod's name), and its ipv4=$(HOST_IP) is dropped.
		name:        "anp-examples-kind-pod-bound-token-nodes-forbidden",
		server:      anpKindServer,
		agent:       anpKindAgent,
		bound:       boundNodesForbidden,
		serverWarns: []string{warnLogFileIgnored, warnAddressDropped},
		agentWarns:  []string{warnProbeInterval},
	},
	{
		// The same with `get nodes` granted: the address is the Node's, kept.
		name:        "anp-examples-kind-pod-bound-token-nodes-readable",
		server:      anpKindServer,
		agent:       anpKindAgent,
		bound:       boundNodesReadable,
		serverWarns: []string{warnLogFileIgnored},
		agentWarns:  []string{warnProbeInterval},
	},
	{
		name: "anp-examples-kind-multinode",
		server: []string{
			"--log-file=/var/log/konnectivity-server.log", "--logtostderr=true", "--log-file-max-size=0",
			"--uds-name=/etc/kubernetes/konnectivity-server/konnectivity-server.socket", "--delete-existing-uds-file",
			"--cluster-cert=/etc/kubernetes/pki/apiserver.crt", "--cluster-key=/etc/kubernetes/pki/apiserver.key",
			"--server-port=0", "--agent-port=8091", "--health-port=8092", "--admin-port=8093", "--keepalive-time=1h",
			"--mode=grpc", "--agent-namespace=kube-system", "--agent-service-account=konnectivity-agent",
			"--kubeconfig=/etc/kubernetes/admin.conf", "--authentication-audience=system:konnectivity-server",
			"--enable-lease-controller",
		},
		agent: []string{
			"--logtostderr=true", "--ca-cert=/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
			"--proxy-server-host=konnectivity-server.kube-system.svc.cluster.local", "--proxy-server-port=8091",
			"--sync-interval=5s", "--sync-interval-cap=30s", "--sync-forever", "--probe-interval=5s",
			"--service-account-token-path=/var/run/secrets/tokens/konnectivity-agent-token",
			"--agent-identifiers=ipv4=${HOST_IP}", "--count-server-leases",
		},
		serverWarns: []string{warnLogFileIgnored, warnIdentityOff},
		agentWarns:  []string{warnProbeInterval, warnIdentifier, warnLeaseAgent},
	},
	{
		name: "anp-examples-kubernetes",
		server: []string{
			"--log-file=/var/log/konnectivity-server.log", "--logtostderr=false", "--log-file-max-size=0",
			"--uds-name=/etc/srv/kubernetes/konnectivity-server/konnectivity-server.socket",
			"--cluster-cert=/etc/srv/kubernetes/pki/apiserver.crt", "--cluster-key=/etc/srv/kubernetes/pki/apiserver.key",
			"--server-port=0", "--agent-port=8091", "--health-port=8092", "--admin-port=8093", "--keepalive-time=1h",
			"--mode=http-connect", "--agent-namespace=kube-system", "--agent-service-account=konnectivity-agent",
			"--kubeconfig=/etc/srv/kubernetes/konnectivity-server/kubeconfig", "--authentication-audience=system:konnectivity-server",
		},
		agent: []string{
			"--logtostderr=true", "--ca-cert=/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
			"--proxy-server-host=${CLUSTER_IP}", "--proxy-server-port=8091",
			"--service-account-token-path=/var/run/secrets/tokens/konnectivity-agent-token",
		},
		serverWarns: []string{warnIdentityOff},
	},
	{
		name: "anp-e2e-static-count-grpc",
		server: []string{
			"--log-file=/var/log/konnectivity-server.log", "--logtostderr=true", "--log-file-max-size=0",
			"--uds-name=/etc/kubernetes/konnectivity-server/konnectivity-server.socket", "--delete-existing-uds-file",
			"--cluster-cert=/etc/kubernetes/pki/apiserver.crt", "--cluster-key=/etc/kubernetes/pki/apiserver.key",
			"--server-port=0", "--kubeconfig=/etc/kubernetes/admin.conf", "--keepalive-time=1h", "--mode=grpc",
			"--agent-namespace=kube-system", "--agent-service-account=konnectivity-agent",
			"--authentication-audience=system:konnectivity-server", "--admin-bind-address=", "--server-count=1", "--mode=grpc",
		},
		agent: []string{
			"--logtostderr=true", "--ca-cert=/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
			"--proxy-server-host=konnectivity-server.kube-system.svc.cluster.local", "--proxy-server-port=8091",
			"--sync-interval=1s", "--sync-interval-cap=10s", "--sync-forever", "--probe-interval=1s",
			"--service-account-token-path=/var/run/secrets/tokens/konnectivity-agent-token",
			"--agent-identifiers=ipv4=${HOST_IP}", "--admin-bind-address=",
		},
		serverWarns: []string{warnLogFileIgnored, warnIdentityOff},
		agentWarns:  []string{warnProbeInterval, warnIdentifier},
	},
	{
		name: "anp-e2e-lease-count-http-connect",
		server: []string{
			"--log-file=/var/log/konnectivity-server.log", "--logtostderr=true", "--log-file-max-size=0",
			"--uds-name=/etc/kubernetes/konnectivity-server/konnectivity-server.socket", "--delete-existing-uds-file",
			"--cluster-cert=/etc/kubernetes/pki/apiserver.crt", "--cluster-key=/etc/kubernetes/pki/apiserver.key",
			"--server-port=0", "--kubeconfig=/etc/kubernetes/admin.conf", "--keepalive-time=1h", "--mode=grpc",
			"--agent-namespace=kube-system", "--agent-service-account=konnectivity-agent",
			"--authentication-audience=system:konnectivity-server", "--enable-lease-controller", "--admin-bind-address=",
			"--mode=http-connect",
		},
		agent: []string{
			"--logtostderr=true", "--ca-cert=/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
			"--proxy-server-host=konnectivity-server.kube-system.svc.cluster.local", "--proxy-server-port=8091",
			"--sync-interval=1s", "--sync-interval-cap=10s", "--sync-forever", "--probe-interval=1s",
			"--service-account-token-path=/var/run/secrets/tokens/konnectivity-agent-token",
			"--count-server-leases", "--agent-identifiers=ipv4=${HOST_IP}", "--admin-bind-address=",
		},
		serverWarns: []string{warnLogFileIgnored, warnIdentityOff},
		agentWarns:  []string{warnProbeInterval, warnIdentifier, warnLeaseAgent},
	},
	{
		name: "kubernetes-docs",
		server: []string{
			"--logtostderr=true", "--uds-name=/etc/kubernetes/konnectivity-server/konnectivity-server.socket",
			"--cluster-cert=/etc/kubernetes/pki/apiserver.crt", "--cluster-key=/etc/kubernetes/pki/apiserver.key",
			"--mode=grpc", "--server-port=0", "--agent-port=8132", "--admin-port=8133", "--health-port=8134",
			"--agent-namespace=kube-system", "--agent-service-account=konnectivity-agent",
			"--kubeconfig=/etc/kubernetes/konnectivity-server.conf", "--authentication-audience=system:konnectivity-server",
		},
		agent: []string{
			"--logtostderr=true", "--ca-cert=/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
			"--proxy-server-host=35.225.206.7", "--proxy-server-port=8132", "--admin-server-port=8133",
			"--health-server-port=8134", "--service-account-token-path=/var/run/secrets/tokens/konnectivity-agent-token",
		},
		serverWarns: []string{warnIdentityOff},
	},
}

// manifestEnv is what a manifest's paths, hosts and ports become here.
type manifestEnv struct {
	dir, sock, kubeconfig, logFile, token string
	pki                                   *pki
	agentPort, healthPort, adminPort      int
	agentHealth, agentAdmin               int
}

// rewrite maps one upstream flag onto this test's files, loopback and
// ports. Nothing else changes: every other flag and value is upstream's.
func (e *manifestEnv) rewrite(arg string, agent bool) string {
	name, value, hasValue := strings.Cut(strings.TrimPrefix(arg, "--"), "=")
	if !hasValue {
		return arg
	}
	ports := map[string]int{"agent-port": e.agentPort, "health-port": e.healthPort, "admin-port": e.adminPort, "proxy-server-port": e.agentPort,
		"health-server-port": e.agentHealth, "admin-server-port": e.agentAdmin}
	if p, ok := ports[name]; ok && value != "0" {
		return "--" + name + "=" + strconv.Itoa(p)
	}
	values := map[string]string{
		"/etc/kubernetes/pki/apiserver.crt":                                  e.pki.serverCert,
		"/etc/srv/kubernetes/pki/apiserver.crt":                              e.pki.serverCert,
		"/etc/kubernetes/pki/apiserver.key":                                  e.pki.serverKey,
		"/etc/srv/kubernetes/pki/apiserver.key":                              e.pki.serverKey,
		"/etc/kubernetes/konnectivity-server/konnectivity-server.socket":     e.sock,
		"/etc/srv/kubernetes/konnectivity-server/konnectivity-server.socket": e.sock,
		"/etc/kubernetes/admin.conf":                                         e.kubeconfig,
		"/etc/kubernetes/konnectivity-server.conf":                           e.kubeconfig,
		"/etc/srv/kubernetes/konnectivity-server/kubeconfig":                 e.kubeconfig,
		"/var/log/konnectivity-server.log":                                   e.logFile,
		"/var/run/secrets/kubernetes.io/serviceaccount/ca.crt":               e.pki.caCert,
		"/var/run/secrets/tokens/konnectivity-agent-token":                   e.token,
		"konnectivity-server.kube-system.svc.cluster.local":                  "127.0.0.1",
		"${CLUSTER_IP}": "127.0.0.1",
		"35.225.206.7":  "127.0.0.1",
	}
	if v, ok := values[value]; ok {
		return "--" + name + "=" + v
	}
	// Kubernetes expands $(VAR) from the container's env (HOST_IP is the
	// node's address); ${VAR} stays literal.
	return "--" + name + "=" + strings.ReplaceAll(value, "$(HOST_IP)", "127.0.0.1")
}

// TestUpstreamManifests runs each upstream command line through the binary
// (as proxy-server and proxy-agent, upstream's names): the server and the
// agent start, the agent authenticates with its ServiceAccount token
// (TokenReview against a fake kube-apiserver, as the manifests configure),
// kube-apiserver's own egress dialer carries a dial through them in the
// manifest's mode, and each prints exactly the warnings listed for it.
func TestUpstreamManifests(t *testing.T) {
	binDir := t.TempDir()
	for _, name := range []string{"proxy-server", "proxy-agent"} {
		if err := os.Symlink(konnectivityBin, filepath.Join(binDir, name)); err != nil {
			t.Fatal(err)
		}
	}
	for _, m := range upstreamManifests {
		t.Run(m.name, func(t *testing.T) {
			dir, err := os.MkdirTemp("", "kse2e") // short: the socket path is bounded
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(dir) })
			p := newPKI(t, dir)
			var api *fakeAPIServer
			var bound *boundAPIServer
			if m.bound == "" {
				api = startFakeAPIServer(t, p)
			} else {
				bound = startBoundAPIServer(t, p)
				api = bound.fakeAPIServer
				// The agent passes no --agent-id: its ID is the host name,
				// in a DaemonSet pod the pod's name.
				host, err := os.Hostname()
				if err != nil {
					t.Fatal(err)
				}
				bound.issue(goodToken, "node-e2e", host, "uid-e2e")
				if m.bound == boundNodesForbidden {
					bound.forbidNodes.Store(true)
				} else {
					bound.setNode("node-e2e", "127.0.0.1")
				}
			}
			// The same apiserver keeps the Leases of --enable-lease-controller.
			leases := startFakeLeaseAPI(t)
			var leaseAPI http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				r.Header.Set("Authorization", "Bearer "+leaseToken) // the fake's credential; the server authenticated with its certificate
				leases.serve(w, r)
			})
			api.other.Store(&leaseAPI)
			env := &manifestEnv{
				dir: dir, sock: filepath.Join(dir, "konnectivity-server.socket"), pki: p,
				kubeconfig: filepath.Join(dir, "kubeconfig"), logFile: filepath.Join(dir, "konnectivity-server.log"),
				token:     filepath.Join(dir, "konnectivity-agent-token"),
				agentPort: freePort(t), healthPort: freePort(t), adminPort: freePort(t), agentHealth: freePort(t), agentAdmin: freePort(t),
			}
			api.writeKubeconfig(t, p, env.kubeconfig)
			if err := os.WriteFile(env.token, []byte(goodToken+"\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			mode := "grpc" // upstream's default
			var serverArgs []string
			has := map[string]bool{}
			for _, a := range m.server {
				serverArgs = append(serverArgs, env.rewrite(a, false))
				name, value, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
				has[name] = true
				if name == "mode" {
					mode = value
				}
			}
			// Ports a manifest leaves at upstream's defaults are moved off them,
			// and every listener stays on loopback (this test's, not the manifest's).
			for flag, port := range map[string]int{"agent-port": env.agentPort, "health-port": env.healthPort, "admin-port": env.adminPort} {
				if !has[flag] {
					serverArgs = append(serverArgs, "--"+flag+"="+strconv.Itoa(port))
				}
			}
			serverArgs = append(serverArgs, "--agent-bind-address=127.0.0.1", "--health-bind-address=127.0.0.1", "--admin-bind-address=127.0.0.1")
			srv := startProcBin(t, filepath.Join(binDir, "proxy-server"), "server", serverArgs...)
			healthz := "http://127.0.0.1:" + strconv.Itoa(env.healthPort)
			waitHTTP(t, srv, healthz+"/healthz", http.StatusOK)

			var agentArgs []string
			has = map[string]bool{}
			for _, a := range m.agent {
				agentArgs = append(agentArgs, env.rewrite(a, true))
				name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
				has[name] = true
			}
			for flag, port := range map[string]int{"health-server-port": env.agentHealth, "admin-server-port": env.agentAdmin} {
				if !has[flag] {
					agentArgs = append(agentArgs, "--"+flag+"="+strconv.Itoa(port))
				}
			}
			agentArgs = append(agentArgs, "--health-server-host=127.0.0.1", "--admin-bind-address=127.0.0.1")
			agt := startProcBin(t, filepath.Join(binDir, "proxy-agent"), "agent", agentArgs...)
			waitHTTP(t, agt, "http://127.0.0.1:"+strconv.Itoa(env.agentHealth)+"/readyz", http.StatusOK)
			waitHTTP(t, srv, healthz+"/readyz", http.StatusOK)
			if api.reviews.Load() == 0 {
				t.Errorf("the agent was admitted without a TokenReview")
			}

			// kube-apiserver's egress dialer, in the manifest's mode.
			proto := apiserverapi.ProtocolGRPC
			if mode == "http-connect" {
				proto = apiserverapi.ProtocolHTTPConnect
			}
			s := &server{dir: dir, sock: env.sock, pki: p}
			backend := startHTTPBackend(t, "127.0.0.1", "b1")
			checkReachable(t, s.egressDialerProto(t, proto), backend, "b1", 3)

			if bound != nil {
				checkBoundAgent(t, m, "http://127.0.0.1:"+strconv.Itoa(env.adminPort), healthz, bound)
			}
			if slices.Contains(m.server, "--enable-lease-controller") {
				waitFor(t, 10*time.Second, "the server keeps its Lease", func() bool {
					leases.mu.Lock()
					defer leases.mu.Unlock()
					return len(leases.leases) == 1
				})
			}
			agt.stop(t) // first: an agent that outlives its server warns about it
			srv.stop(t)
			serverOut := srv.out.String()
			logFile, _ := os.ReadFile(env.logFile)
			if slices.Contains(m.server, "--logtostderr=false") {
				// klog: every line to --log-file, only errors to stderr.
				if !strings.Contains(string(logFile), "msg=listening") || strings.Contains(serverOut, "level=INFO") {
					t.Errorf("--logtostderr=false --log-file: file has %d bytes, stderr:\n%s", len(logFile), serverOut)
				}
			} else if len(logFile) > 0 {
				t.Errorf("--log-file written though --logtostderr=true:\n%s", logFile)
			}
			serverOut += string(logFile)
			checkWarnings(t, "server", serverOut, m.serverWarns)
			checkWarnings(t, "agent", agt.out.String(), m.agentWarns)
		})
	}
}

// checkBoundAgent: the agent logged in under its default ID with a
// pod-bound token; its ipv4= routes when the Node backs it and is dropped
// (counted as address_unverifiable) when the server may not read Nodes.
func checkBoundAgent(t *testing.T, m upstreamManifest, admin, health string, api *boundAPIServer) {
	t.Helper()
	host, _ := os.Hostname()
	resp, err := http.Get(admin + "/debug/tunnels")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st struct {
		Agents []struct {
			ID          string `json:"id"`
			Identifiers string `json:"identifiers"`
		} `json:"agents"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	if len(st.Agents) != 1 || st.Agents[0].ID != host {
		t.Fatalf("agents %+v, want one with the host name %q as its ID", st.Agents, host)
	}
	wantIDs, wantDropped := "ipv4=127.0.0.1", 0.0
	if m.bound == boundNodesForbidden {
		wantIDs, wantDropped = "", 1
	}
	if got := st.Agents[0].Identifiers; got != wantIDs {
		t.Errorf("the agent routes by %q, want %q", got, wantIDs)
	}
	const refusals = "konnectivity_network_proxy_server_agent_identity_refusals_total"
	if v := metricValue(t, health+"/metrics", refusals, "reason", "address_unverifiable"); v != wantDropped {
		t.Errorf("%s{reason=address_unverifiable} = %v, want %v", refusals, v, wantDropped)
	}
	if n := api.nodeGets.Load(); n == 0 {
		t.Errorf("the server never asked the apiserver for the Node")
	}
	t.Logf("agent %q admitted with a pod-bound token, routes by %q (Node lookups: %d, %s)", host, st.Agents[0].Identifiers, api.nodeGets.Load(), m.bound)
}

// checkWarnings: out holds one WARN line for each entry of want (matched
// by substring), and no other WARN line.
func checkWarnings(t *testing.T, who, out string, want []string) {
	t.Helper()
	var warns []string
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "level=WARN") {
			warns = append(warns, line)
		}
	}
	used := make([]bool, len(warns))
	for _, w := range want {
		found := false
		for i, line := range warns {
			if !used[i] && strings.Contains(line, w) {
				used[i], found = true, true
				break
			}
		}
		if !found {
			t.Errorf("%s: no warning with %q; warnings:\n%s", who, w, strings.Join(warns, "\n"))
		}
	}
	for i, line := range warns {
		if !used[i] {
			t.Errorf("%s: warning not in docs/upstream.md for this command line:\n%s", who, line)
		}
	}
}
