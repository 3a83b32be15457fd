package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spinifex/konnectivity/auth"
	"github.com/spinifex/konnectivity/certs"
	"github.com/spinifex/konnectivity/internal/daemon"
	"github.com/spinifex/konnectivity/internal/kubeclient"
	"github.com/spinifex/konnectivity/internal/lease"
	"github.com/spinifex/konnectivity/internal/nodemap"
	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/server"
	"github.com/spinifex/konnectivity/tunnel/wire"
)

type serverOptions struct {
	daemonOptions
	warned *onceWarnings // the process's one-time warnings
	// reviewer checks agents' tokens (token auth), once agentAuthenticator
	// made it; its accepted reviews cross a restart (reviewedTokens).
	reviewer              *auth.TokenReviewer
	alpnProto             string // --alpn-proto: what the agent port accepts besides h2
	kubeCtx               string
	mode                  string
	udsName               string
	deleteExistingUDS     bool
	udsMode               fileMode
	udsOwner, udsGroup    string
	frontendAllowedUIDs   string
	serverPort            int
	serverBindAddress     string
	serverCert, serverKey string
	serverCACert          string
	agentPort             int
	agentBindAddress      string
	clusterCert           string
	clusterKey            string
	clusterCACert         string
	allowUnauthenticated  bool
	agentNamespace        string
	agentServiceAccount   string
	authAudience          string
	serverID              string
	serverIDFixed         bool // from --server-id or $PROXY_SERVER_ID: the same after a self-restart
	serverCount           int
	proxyStrategies       string
	nodeStrategyPods      bool
	agentWait             time.Duration
	backendDialTimeout    time.Duration
	headerTimeout         time.Duration
	gracefulShutdown      time.Duration
	maxStreamsPerAgent    int
	maxUnadmitted         int
	maxAgentsPerCred      int
	reservedFDs           int
	maxAgentReviews       int
	stalledBudgetMiB      int64
	readyzRequiresAgent   bool
	tokenReviewTimeout    time.Duration
	tokenReviewCacheTTL   time.Duration
	tokenReviewRate       float64
	bindAgentIdentity     bool
	agentIDFromCert       bool
	routeAgents           string
	tokenRecheck          time.Duration
	tokenDoubtGrace       time.Duration
	mintCACert, mintCAKey string
	mintSANs, mintCN      string
	mintCheckInterval     time.Duration
	restartGrace          time.Duration
	leases                serverLeaseOptions
}

// serverLeaseOptions are upstream's lease controller flags and this
// binary's timing flags (upstream fixes the timing).
type serverLeaseOptions struct {
	enable                bool
	label                 string
	labels                map[string]string
	duration, renew, cull time.Duration
}

func newServerFlags() (*serverOptions, *commandFlags) {
	o := &serverOptions{udsMode: fileMode{0o600}, warned: newOnceWarnings()}
	cf := newCommandFlags("konnectivity server")
	cf.defineDaemonFlags(&o.daemonOptions, daemonFlagNames{
		healthHost: "health-bind-address", healthPort: "health-port", adminPort: "admin-port",
		healthDefault: 8092, adminDefault: 8095,
		peer: "an agent", onPingTimeout: "the agent is dropped", kubeconfigFor: "TokenReview and Leases",
	})
	f := cf.FlagSet
	f.StringVar(&o.alpnProto, "alpn-proto", "", "ALPN protocols the agent port accepts besides h2 (comma list), for a port an ALPN router shares")
	f.StringVar(&o.mode, "mode", "grpc", "frontend protocol kube-apiserver speaks: grpc (proxyProtocol: GRPC) or http-connect (HTTPConnect)")
	f.StringVar(&o.udsName, "uds-name", "", "Unix socket path for the kube-apiserver frontend")
	f.BoolVar(&o.deleteExistingUDS, "delete-existing-uds-file", true, "remove a stale socket at --uds-name before listening")
	f.Var(&o.udsMode, "uds-mode", "file mode of the frontend socket (octal)")
	f.StringVar(&o.udsOwner, "uds-owner", "", "owner (name or UID) of the frontend socket")
	f.StringVar(&o.udsGroup, "uds-group", "", "group (name or GID) of the frontend socket")
	f.StringVar(&o.frontendAllowedUIDs, "frontend-allowed-uids", "", "comma list of UIDs allowed on the frontend socket (default: root and this process's UID)")
	f.IntVar(&o.serverPort, "server-port", 8090, "TCP port of the mTLS frontend; 0 disables it (and it is off by default when --uds-name is set)")
	f.StringVar(&o.serverBindAddress, "server-bind-address", "", "address the TCP frontend binds to (default all)")
	f.StringVar(&o.serverCert, "server-cert", "", "TLS certificate of the TCP frontend")
	f.StringVar(&o.serverKey, "server-key", "", "TLS key of the TCP frontend")
	f.StringVar(&o.serverCACert, "server-ca-cert", "", "CA that signs kube-apiserver's client certificate on the TCP frontend (required with it)")
	f.IntVar(&o.agentPort, "agent-port", 8091, "TCP port agents connect to")
	f.StringVar(&o.agentBindAddress, "agent-bind-address", "", "address the agent listener binds to (default all)")
	f.StringVar(&o.clusterCert, "cluster-cert", "", "TLS certificate presented to agents (required)")
	f.StringVar(&o.clusterKey, "cluster-key", "", "TLS key presented to agents (required)")
	f.StringVar(&o.clusterCACert, "cluster-ca-cert", "", "if set, agents may authenticate with a client certificate signed by this CA")
	f.BoolVar(&o.allowUnauthenticated, "allow-unauthenticated-agents", false, "admit agents with neither a client certificate nor a token (insecure)")
	f.StringVar(&o.kubeCtx, "context", "", "kubeconfig context to use (default: current-context)")
	f.StringVar(&o.agentNamespace, "agent-namespace", "", "namespace of the agents' ServiceAccount (enables token auth)")
	f.StringVar(&o.agentServiceAccount, "agent-service-account", "", "name of the agents' ServiceAccount (enables token auth)")
	f.StringVar(&o.authAudience, "authentication-audience", "", "audience the agents' tokens must carry (enables token auth)")
	f.DurationVar(&o.tokenReviewTimeout, "token-review-timeout", 5*time.Second, "bound on one TokenReview call")
	f.DurationVar(&o.tokenReviewCacheTTL, "token-review-cache-ttl", 10*time.Second, "how long a TokenReview result is reused (never past the token's expiry)")
	f.Float64Var(&o.tokenReviewRate, "max-token-reviews-per-second", 100, "TokenReviews sent to the apiserver per second, with a burst of one second's worth (cached results are not counted); past it a login is answered \"authentication unavailable\" at once; 0: no bound")
	f.BoolVar(&o.bindAgentIdentity, "bind-agent-identity", true, "a token agent's ID and host=/ipv4=/ipv6= identifiers must name the node its token was issued for (Kubernetes 1.30+ bound tokens); false admits any")
	f.BoolVar(&o.agentIDFromCert, "agent-id-from-certificate", false, "a certificate agent's ID and host= identifiers must be its certificate's CN or a DNS SAN, its ipv4=/ipv6= an IP SAN")
	f.StringVar(&o.routeAgents, "route-agents", "", "comma list of agent IDs and serviceaccount:NAMESPACE/NAME allowed to advertise cidr= and default-route identifiers; * allows every agent")
	f.DurationVar(&o.tokenRecheck, "token-recheck-interval", time.Minute, "how often a connected agent's token is reviewed again (and at its expiry); a link whose token is no longer valid is drained and closed; 0 never")
	f.DurationVar(&o.tokenDoubtGrace, "token-doubt-grace", time.Minute, "how long a connected agent keeps its open tunnels while the reviews of its token are refused with an apiserver error (TokenReview status.error), taking no new dials; a plain refusal or an expired token closes it at once; 0: the first such refusal closes it")
	f.StringVar(&o.serverID, "server-id", "", "ID announced to agents (default: $PROXY_SERVER_ID, else random per process)")
	f.IntVar(&o.serverCount, "server-count", 1, "number of server replicas agents should connect to")
	f.StringVar(&o.proxyStrategies, "proxy-strategies", "default", "ordered agent-selection strategies: node, destHost, default, defaultRoute")
	f.BoolVar(&o.nodeStrategyPods, "node-strategy-pods", false, "the node strategy also learns pod addresses from Pods, not only EndpointSlices (for pods/proxy to pods outside the Nodes' pod CIDRs; RBAC: list,watch pods)")
	f.DurationVar(&o.agentWait, "agent-wait", 5*time.Second, "how long a dial waits for an agent to connect before 503")
	f.DurationVar(&o.backendDialTimeout, "backend-dial-timeout", 10*time.Second, "bound from CONNECT to the agent's dial answer (504 after it); below kube-apiserver's 30s")
	f.DurationVar(&o.headerTimeout, "frontend-header-timeout", 10*time.Second, "bound on reading a CONNECT request head, and on an agent-port connection from accept to admission (TLS, login, review)")
	f.IntVar(&o.maxUnadmitted, "max-unadmitted-agent-connections", 64, "agent-port connections that may wait for admission at once; past it new ones are closed at once")
	f.IntVar(&o.maxAgentsPerCred, "max-agent-connections-per-credential", 32, "agent connections (each with its own agent ID) one certificate or token may hold from one address; past it a login is refused 429; 0 no bound")
	f.IntVar(&o.reservedFDs, "reserved-file-descriptors", 0, "file descriptors agent connections may never take, reserved for the front door and the health and admin ports; 0 a quarter of the descriptor limit, at most 1024; -1 none")
	f.IntVar(&o.maxAgentReviews, "max-concurrent-agent-reviews", 32, "agent credential checks (TokenReview) in flight at once; more wait, within the header timeout")
	f.Int64Var(&o.stalledBudgetMiB, "stalled-tunnel-memory-budget", 1024, "MiB the server may hold, in all, of what agents sent for clients that do not read it yet (each tunnel up to its 1 MiB window); past it new dials get 503")
	f.DurationVar(&o.gracefulShutdown, "graceful-shutdown-timeout", 15*time.Second, "on SIGTERM, how long open tunnels may finish")
	f.IntVar(&o.maxStreamsPerAgent, "max-streams-per-agent", 10000, "open tunnels per agent before dials go elsewhere")
	f.StringVar(&o.mintCACert, "mint-ca-cert", "", "CA certificate to mint --cluster-cert from (with --mint-ca-key): minted at start when missing or wrong, renewed before expiry")
	f.StringVar(&o.mintCAKey, "mint-ca-key", "", "CA key for --mint-ca-cert")
	f.StringVar(&o.mintSANs, "mint-sans", "", "comma list of DNS names and IPs agents dial, for the minted certificate")
	f.StringVar(&o.mintCN, "mint-cn", "konnectivity-server", "common name of the minted certificate")
	f.DurationVar(&o.mintCheckInterval, "mint-check-interval", time.Hour, "how often the minted certificate is checked for renewal")
	f.DurationVar(&o.restartGrace, "restart-grace", 10*time.Second, "on SIGHUP (self-restart), how long open tunnels may finish before the process re-executes itself")
	f.BoolVar(&o.readyzRequiresAgent, "readyz-requires-agent", true, "/readyz fails until an agent is connected")

	cf.tolerate("frontend-write-channel-size", false, "not needed: every tunnel has its own HTTP/2 flow-control window")
	cf.tolerate("frontend-keepalive-time", false, "the HTTP CONNECT frontend has no keepalive")
	cf.tolerate("kubeconfig-qps", false, "TokenReview results are cached instead")
	cf.tolerate("kubeconfig-burst", false, "TokenReview results are cached instead")
	cf.tolerate("kube-api-content-type", false, "TokenReview uses JSON")
	f.BoolVar(&o.leases.enable, "enable-lease-controller", false, "keep a coordination.k8s.io/v1 Lease for this server (renewed, deleted on exit) and delete expired ones, so agents with --count-server-leases can count the servers")
	f.StringVar(&o.leases.label, "lease-label", "k8s-app=konnectivity-server", "labels of this server's Lease (k=v,k2=v2); expired Leases with these labels are deleted")
	f.DurationVar(&o.leases.duration, "lease-duration", lease.DefaultDuration, "how long the server's Lease stays valid without renewal (whole seconds; upstream fixes 30s)")
	f.DurationVar(&o.leases.renew, "lease-renew-interval", lease.DefaultRenewInterval, "how often the server renews its Lease (upstream fixes 15s)")
	f.DurationVar(&o.leases.cull, "lease-gc-interval", lease.DefaultGCInterval, "how often expired server Leases are looked for and deleted (upstream fixes 15s)")
	return o, cf
}

func runServer(args []string, stdout, stderr io.Writer) int {
	o, cf := newServerFlags()
	o.checkArgs = append([]string{"check", "server"}, args...)
	return runDaemon("server", cf, o.warned, args, stdout, stderr, func() error { return o.complete(cf) }, o.run)
}

// complete checks flag combinations and fills derived defaults.
func (o *serverOptions) complete(cf *commandFlags) error {
	switch o.mode {
	case "http-connect", "grpc":
	default:
		return fmt.Errorf("--mode=%q: want grpc or http-connect", o.mode)
	}
	// Upstream requires --server-port=0 with --uds-name; here an unset
	// --server-port simply means no TCP frontend when a socket is given.
	if o.udsName != "" && !cf.wasSet("server-port") {
		o.serverPort = 0
	}
	if o.udsName == "" && o.serverPort == 0 {
		return fmt.Errorf("no frontend: set --uds-name or --server-port")
	}
	if o.serverPort != 0 && (o.serverCert == "" || o.serverKey == "" || o.serverCACert == "") {
		return fmt.Errorf("the TCP frontend (--server-port=%d) needs --server-cert, --server-key and --server-ca-cert (mTLS, as upstream); use --server-port=0 to disable it", o.serverPort)
	}
	if o.clusterCert == "" || o.clusterKey == "" {
		return fmt.Errorf("the agent listener needs --cluster-cert and --cluster-key")
	}
	if (o.mintCACert == "") != (o.mintCAKey == "") {
		return fmt.Errorf("--mint-ca-cert and --mint-ca-key go together")
	}
	if o.mintCAKey != "" && o.mintSANs == "" {
		return fmt.Errorf("--mint-ca-key needs --mint-sans (the names and addresses agents dial)")
	}
	if o.serverID == "" {
		o.serverID = os.Getenv("PROXY_SERVER_ID")
	}
	o.serverIDFixed = o.serverID != ""
	if o.serverID == "" {
		var b [8]byte
		rand.Read(b[:])
		o.serverID = hex.EncodeToString(b[:])
	}
	if o.serverCount < 1 {
		return fmt.Errorf("--server-count=%d: want at least 1", o.serverCount)
	}
	if o.leases.enable {
		var err error
		if o.leases.labels, err = lease.ParseLabels(o.leases.label); err != nil {
			return fmt.Errorf("--lease-label: %w", err)
		}
		if o.leases.duration < time.Second || o.leases.renew <= 0 || o.leases.renew >= o.leases.duration || o.leases.cull <= 0 {
			return fmt.Errorf("--lease-renew-interval=%s must be positive and shorter than --lease-duration=%s (at least 1s), --lease-gc-interval=%s positive", o.leases.renew, o.leases.duration, o.leases.cull)
		}
		if err := lease.CheckName(o.leaseNamespace, lease.NamePrefix+o.serverID); err != nil {
			return fmt.Errorf("--enable-lease-controller: %w (set --lease-namespace, or a --server-id of lower-case letters, digits and '-')", err)
		}
	}
	if o.stalledBudgetMiB < 1 || o.stalledBudgetMiB > 1<<30 {
		return fmt.Errorf("--stalled-tunnel-memory-budget=%d: want 1 to %d MiB", o.stalledBudgetMiB, 1<<30)
	}
	if o.maxAgentsPerCred < 0 || o.reservedFDs < -1 {
		return fmt.Errorf("--max-agent-connections-per-credential=%d, --reserved-file-descriptors=%d: want at least 0 and -1", o.maxAgentsPerCred, o.reservedFDs)
	}
	if o.maxUnadmitted < 1 || o.maxAgentReviews < 1 {
		return fmt.Errorf("--max-unadmitted-agent-connections=%d, --max-concurrent-agent-reviews=%d: want at least 1 each", o.maxUnadmitted, o.maxAgentReviews)
	}
	if _, err := server.ParseStrategies(o.proxyStrategies); err != nil {
		return fmt.Errorf("--proxy-strategies: %w", err)
	}
	if o.tokenAuth() && (o.agentNamespace == "" || o.agentServiceAccount == "" || o.authAudience == "") {
		return fmt.Errorf("token auth needs all of --agent-namespace, --agent-service-account and --authentication-audience")
	}
	if err := o.daemonOptions.complete(cf); err != nil {
		return err
	}
	switch {
	case o.backendDialTimeout < 0:
		return fmt.Errorf("--backend-dial-timeout=%s: want 0 or more", o.backendDialTimeout)
	case o.backendDialTimeout == 0:
		// Upstream's 0 is "no bound"; kube-apiserver's gRPC client gives up
		// after 30s anyway, and its HTTP CONNECT dialer never does, so an
		// unanswered dial would hang a request for good.
		o.backendDialTimeout = noDialTimeoutBound
		cf.warn("--backend-dial-timeout=0 (upstream: no bound) is read as " + noDialTimeoutBound.String() + ", kube-apiserver's own gRPC dial backstop, so an unanswered HTTP CONNECT dial cannot hang for good")
	}
	for _, v := range splitList(o.routeAgents) {
		if !validRouteAgent(v) {
			return fmt.Errorf("--route-agents: %q is not an agent ID, serviceaccount:NAMESPACE/NAME or *", v)
		}
	}
	return nil
}

// noDialTimeoutBound stands for --backend-dial-timeout=0.
const noDialTimeoutBound = 30 * time.Second

// splitList splits a comma list, dropping blanks.
func splitList(s string) []string {
	var out []string
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
}

// validRouteAgent accepts "*", "serviceaccount:NAMESPACE/NAME" or an agent ID.
func validRouteAgent(v string) bool {
	if v == "*" {
		return true
	}
	if sa, ok := strings.CutPrefix(v, "serviceaccount:"); ok {
		ns, name, ok := strings.Cut(sa, "/")
		return ok && ns != "" && name != "" && !strings.ContainsAny(name, "/:")
	}
	return !strings.ContainsAny(v, " \t:/")
}

func (o *serverOptions) tokenAuth() bool {
	return o.agentNamespace != "" || o.agentServiceAccount != "" || o.authAudience != ""
}

func (o *serverOptions) run(ctx context.Context, log *slog.Logger) error {
	inherited := daemon.Inherit("paused tunnels", func(p *server.PausedTunnel, c net.Conn) { p.Socket = c }, log) // before anything can fail: their sockets close with the process
	state := daemon.InheritedState(log)
	o.warned.start(state[warnedState], log)
	minTLS := o.minTLS()
	stopMinting, err := o.startMinting(ctx, log)
	if err != nil {
		return err
	}
	defer stopMinting()
	agentTLS, agentCert, err := o.agentTLSConfig(minTLS, log)
	if err != nil {
		return err
	}
	log.Info("agent-listener certificate", "cert", o.clusterCert, "not_after", agentCert.NotAfter().UTC().Format(time.RFC3339))
	metrics := promtext.NewRegistry()
	daemon.AddProcessMetrics(metrics, "konnectivity_network_proxy_server_", versionString())
	addCertificateMetric(metrics, "agents", agentCert)
	cfg, err := o.serverConfig(agentTLS, metrics, log)
	if err != nil {
		return err
	}
	o.trustReviewed(state[reviewedTokens], log)
	if nodes, err := o.nodeMap(log); err != nil {
		return err
	} else if nodes != nil {
		cfg.NodeOf = nodes.NodeOf
		defer goUntilStopped(context.WithoutCancel(ctx), nodes.Run)()
	}
	srv, err := server.New(cfg)
	if err != nil {
		return err
	}
	defer srv.Close()

	d := daemon.New(log)
	defer d.Close()
	var serving sync.WaitGroup
	done := make(chan error, 3) // one per accept loop, so none blocks
	serve := func(f func() error) {
		serving.Add(1)
		go func() { defer serving.Done(); done <- f() }()
	}
	if err := o.listenPorts(d, srv, minTLS, metrics, serve, log); err != nil {
		return err
	}
	if err := d.StartServices(o.services(daemon.Services{
		Ready:   o.readyChecks(srv),
		Metrics: metrics,
		Status:  func() any { return srv.Status() },
	})); err != nil {
		return err
	}
	sock, err := o.listenSocket(d, srv, serve, log)
	if err != nil {
		return err
	}
	srv.Resume(inherited)
	stopLeases := o.startLeases(context.WithoutCancel(ctx), metrics, log)
	defer stopLeases(true)

	return d.Run(ctx, o.restarts(daemon.Work{
		Done: done,
		Shutdown: func(_ bool, cause error) error {
			agents, start := srv.AgentCount(), time.Now()
			stopServing(srv, o.gracefulShutdown, false, &serving, log)
			stopLeases(true)
			log.Info("shut down", "grace", o.gracefulShutdown.String(), "agents", agents, "took", time.Since(start).Round(time.Millisecond).String())
			if cause != nil && !errors.Is(cause, server.ErrClosed) {
				return cause
			}
			return nil
		},
		State: func() map[string]any {
			state := map[string]any{warnedState: o.warned.handed()}
			if o.reviewer != nil {
				state[reviewedTokens] = o.reviewer.Reviewed()
			}
			return state
		},
		Drain: func(trigger string) []daemon.Handed {
			log.Info("restarting in place: draining tunnels", "trigger", trigger, "grace", o.restartGrace.String(), "agents", srv.AgentCount())
			paused := stopServing(srv, o.restartGrace, true, &serving, log)
			// With a fixed server ID the new image renews the same Lease,
			// so agents never see the count dip; a random ID is a new
			// server, and the old one's Lease goes now.
			stopLeases(!o.serverIDFixed)
			stopMinting()
			return daemon.Hand("paused tunnels", paused, func(p *server.PausedTunnel) net.Conn { return p.Socket })
		},
		Exited:       removeSocket(sock, log),
		MemoryReady:  func() bool { return srv.AgentCount() > 0 },
		Metrics:      metrics,
		MetricPrefix: "konnectivity_network_proxy_server_",
	}))
}

// readyChecks is /readyz: an agent must be connected unless
// --readyz-requires-agent=false, which reports without failing.
func (o *serverOptions) readyChecks(srv *server.Server) []daemon.Check {
	if !o.readyzRequiresAgent {
		return []daemon.Check{{Name: "agents", Run: func() (bool, string) { _, msg := srv.Ready(); return true, msg }}}
	}
	return []daemon.Check{{Name: "agents", Run: srv.Ready}}
}

// stopServing sends GOAWAY to agents, lets tunnels finish within grace and
// waits for the accept loops to return. For a self-restart (handOver) the
// tunnels that can move to the next image are paused and returned.
func stopServing(srv *server.Server, grace time.Duration, handOver bool, serving *sync.WaitGroup, log *slog.Logger) (paused []*server.PausedTunnel) {
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	var err error
	if handOver {
		paused, err = srv.HandOver(ctx)
	} else {
		err = srv.Shutdown(ctx)
	}
	if err != nil {
		log.Warn("grace period over; open tunnels closed", "err", err)
	}
	serving.Wait()
	return paused
}

// serverConfig turns the flags into the tunnel server's configuration.
func (o *serverOptions) serverConfig(agentTLS *tls.Config, metrics *promtext.Registry, log *slog.Logger) (server.Config, error) {
	strategies, _ := server.ParseStrategies(o.proxyStrategies)
	identify, nodeAddrs, err := o.agentAuthenticator(log, metrics)
	if err != nil {
		return server.Config{}, err
	}
	recheck, doubtGrace := o.tokenRecheck, o.tokenDoubtGrace
	if recheck <= 0 {
		recheck = -1
	}
	if doubtGrace <= 0 {
		doubtGrace = -1
	}
	cfg := server.Config{
		ID:                 o.serverID,
		Count:              o.serverCount,
		AgentTLS:           agentTLS,
		IdentifyAgent:      identify,
		Strategies:         strategies,
		AgentWait:          o.agentWait,
		DialTimeout:        o.backendDialTimeout,
		HeaderTimeout:      o.headerTimeout,
		KeepAlive:          o.keepaliveTime,
		PingTimeout:        o.pingTimeout,
		MaxStreamsPerAgent: o.maxStreamsPerAgent,
		MaxUnadmitted:      o.maxUnadmitted,
		MaxReviews:         o.maxAgentReviews,
		StalledBudget:      o.stalledBudgetMiB << 20,
		Metrics:            metrics,
		Logger:             log,

		MaxAgentsPerCredential: o.maxAgentsPerCred,
		MaxAgentConns:          o.agentDescriptors(log),
	}
	cfg.Identity = server.IdentityPolicy{
		IgnoreNodeClaims: !o.bindAgentIdentity,
		CertificateNames: o.agentIDFromCert,
		RouteAgents:      splitList(o.routeAgents),
		NodeAddresses:    nodeAddrs,
		Recheck:          recheck,
		DoubtGrace:       doubtGrace,
	}
	if o.udsName != "" {
		allowed := auth.DefaultAllowedUIDs()
		if o.frontendAllowedUIDs != "" {
			if allowed, err = auth.ParseUIDList(o.frontendAllowedUIDs); err != nil {
				return server.Config{}, fmt.Errorf("--frontend-allowed-uids: %w", err)
			}
		}
		cfg.CheckFrontendPeer = func(c net.Conn) error {
			if _, ok := c.(*net.UnixConn); !ok {
				return nil // the TCP frontend is guarded by mTLS
			}
			if err := allowed.CheckConn(c); err != nil {
				return &wire.StatusError{Code: http.StatusForbidden, Msg: err.Error()}
			}
			return nil
		}
	}
	return cfg, nil
}

// addCertificateMetric exports the expiry of the certificate a listener
// serves.
func addCertificateMetric(m *promtext.Registry, listener string, cert *certs.Reloader) {
	m.GaugeFunc("konnectivity_network_proxy_server_certificate_not_after_seconds", "Expiry of the certificate each listener serves, in seconds since the Unix epoch.",
		[]string{"listener"}, []string{listener}, func() float64 { return float64(cert.NotAfter().Unix()) })
}

// listenPorts opens (or adopts) the TCP frontend and the agent listener
// and has serve run an accept loop on each.
func (o *serverOptions) listenPorts(d *daemon.Daemon, srv *server.Server, minTLS uint16, metrics *promtext.Registry, serve func(func() error), log *slog.Logger) error {
	if o.serverPort != 0 {
		tcfg, frontCert, err := o.frontendTLSConfig(minTLS, log)
		if err != nil {
			return err
		}
		ln, err := d.ListenTCP("frontend-tcp", hostPort(o.serverBindAddress, o.serverPort))
		if err != nil {
			return fmt.Errorf("TCP frontend: %w", err)
		}
		log.Info("listening", "service", "frontend", "mode", o.mode, "addr", ln.Addr().String(), "tls", "mTLS", "not_after", frontCert.NotAfter().UTC().Format(time.RFC3339))
		addCertificateMetric(metrics, "frontend", frontCert)
		serve(func() error { return o.serveFrontend(srv)(tls.NewListener(ln, tcfg)) })
	}
	ln, err := d.ListenTCP("agents", hostPort(o.agentBindAddress, o.agentPort))
	if err != nil {
		return fmt.Errorf("agent listener: %w", err)
	}
	log.Info("listening", "service", "agents", "addr", ln.Addr().String(), "server_id", o.serverID, "server_count", o.serverCount)
	serve(func() error { return srv.ServeAgents(ln) })
	return nil
}

// listenSocket opens (or adopts) the frontend socket, once every port is
// bound: a second server started by mistake fails on a port before it
// comes near the first one's socket, and a socket is taken over only when
// nothing listens on it (daemon.ListenUnix). It returns what an exit
// removes.
func (o *serverOptions) listenSocket(d *daemon.Daemon, srv *server.Server, serve func(func() error), log *slog.Logger) (daemon.SocketFile, error) {
	if o.udsName == "" {
		return daemon.SocketFile{}, nil
	}
	ln, err := d.Listen("frontend-uds", "unix", o.udsName, func() (net.Listener, error) {
		ln, err := daemon.ListenUnix(o.udsName, o.udsMode.mode, o.deleteExistingUDS)
		if err != nil {
			return nil, fmt.Errorf("frontend socket (--delete-existing-uds-file=%t): %w", o.deleteExistingUDS, err)
		}
		return ln, nil
	})
	if err != nil {
		return daemon.SocketFile{}, err
	}
	if o.udsOwner != "" || o.udsGroup != "" {
		if err := auth.ApplySocketOwnership(o.udsName, o.udsMode.mode, o.udsOwner, o.udsGroup); err != nil {
			return daemon.SocketFile{}, fmt.Errorf("frontend socket %s: %w", o.udsName, err)
		}
	}
	sock, err := daemon.OwnSocketFile(o.udsName)
	if err != nil {
		return daemon.SocketFile{}, err
	}
	log.Info("listening", "service", "frontend", "mode", o.mode, "uds", o.udsName, "uds_mode", o.udsMode.String())
	serve(func() error { return o.serveFrontend(srv)(ln) })
	return sock, nil
}

// serveFrontend is the front door of --mode: HTTP CONNECT or gRPC, one
// data path behind both.
func (o *serverOptions) serveFrontend(srv *server.Server) func(net.Listener) error {
	if o.mode == "grpc" {
		return srv.ServeGRPC
	}
	return srv.ServeFrontend
}

// removeSocket returns what an exit does to the frontend socket: it is
// removed while it is still the one this process listens on.
func removeSocket(sock daemon.SocketFile, log *slog.Logger) func() {
	return func() {
		if err := sock.Remove(); err != nil {
			log.Warn("remove frontend socket", "err", err)
		}
	}
}

// agentTLSConfig serves --cluster-cert/--cluster-key and, with
// --cluster-ca-cert, verifies the client certificates agents present
// (token agents present none).
func (o *serverOptions) agentTLSConfig(minTLS uint16, log *slog.Logger) (*tls.Config, *certs.Reloader, error) {
	cfg, cert, err := certs.ReloadingServerConfig(certs.ServerFiles{Listener: "agents", CertFile: o.clusterCert, KeyFile: o.clusterKey, CAFile: o.clusterCACert, PairFlags: "--cluster-cert/--cluster-key", CAFlag: "--cluster-ca-cert"}, minTLS, log)
	if err != nil {
		return nil, nil, err
	}
	if o.clusterCACert != "" {
		cfg.ClientAuth = tls.VerifyClientCertIfGiven
	}
	// The agent port also accepts the protocols ALPN routers in front of it
	// route by (our agents offer them with --alpn-proto); h2 stays for
	// upstream's agents.
	cfg.NextProtos = splitList(o.alpnProto)
	cfg.CipherSuites = o.cipherSuiteIDs
	return cfg, cert, nil
}

// frontendTLSConfig is the TCP frontend's mTLS.
func (o *serverOptions) frontendTLSConfig(minTLS uint16, log *slog.Logger) (*tls.Config, *certs.Reloader, error) {
	cfg, cert, err := certs.ReloadingServerConfig(certs.ServerFiles{Listener: "frontend", CertFile: o.serverCert, KeyFile: o.serverKey, CAFile: o.serverCACert, PairFlags: "--server-cert/--server-key", CAFlag: "--server-ca-cert"}, minTLS, log)
	if err != nil {
		return nil, nil, err
	}
	cfg.NextProtos = []string{"http/1.1"}
	if o.mode == "grpc" {
		cfg.NextProtos = []string{"h2"}
	}
	cfg.CipherSuites = o.cipherSuiteIDs
	return cfg, cert, nil
}

// startMinting mints --cluster-cert/--cluster-key from --mint-ca-cert and
// --mint-ca-key when they are missing or no longer right, and keeps them
// renewed until stop; the agent listener's reloader picks up each new
// pair. stop waits for the renewals to end and may be called again.
func (o *serverOptions) startMinting(ctx context.Context, log *slog.Logger) (stop func(), err error) {
	if o.mintCAKey == "" {
		return func() {}, nil
	}
	ca, err := certs.LoadCA(o.mintCACert, o.mintCAKey)
	if err != nil {
		return nil, fmt.Errorf("--mint-ca-cert/--mint-ca-key: %w", err)
	}
	dns, ips, err := certs.ParseSANs(o.mintSANs)
	if err != nil {
		return nil, fmt.Errorf("--mint-sans: %w", err)
	}
	m, _, err := certs.NewMinter(certs.EnsureOptions{
		CertFile: o.clusterCert,
		KeyFile:  o.clusterKey,
		CA:       ca,
		Request:  certs.Request{CommonName: o.mintCN, DNSNames: dns, IPAddresses: ips},
	}, log)
	if err != nil {
		return nil, fmt.Errorf("mint the agent-listener certificate: %w", err)
	}
	return goUntilStopped(ctx, func(ctx context.Context) { m.Renew(ctx, o.mintCheckInterval) }), nil
}

// agentAuthenticator decides how agents prove themselves: a client
// certificate from --cluster-ca-cert, a ServiceAccount token checked with
// TokenReview, either of the two when both are configured. It also returns
// the lookup of a node's addresses that binds token agents' ipv4=/ipv6=
// identifiers (nil without token auth or identity binding).
func (o *serverOptions) agentAuthenticator(log *slog.Logger, metrics *promtext.Registry) (identify func(context.Context, server.AgentCredentials) (server.Principal, error), nodeAddrs func(context.Context, string) ([]netip.Addr, error), err error) {
	mtls := o.clusterCACert != ""
	var reviewer *auth.TokenReviewer
	if o.tokenAuth() {
		rc, err := o.restConfig()
		if err != nil {
			return nil, nil, fmt.Errorf("token auth: %w", err)
		}
		reviewer, err = auth.NewTokenReviewer(rc, auth.ReviewOptions{
			Audience:       o.authAudience,
			Namespace:      o.agentNamespace,
			ServiceAccount: o.agentServiceAccount,
			Timeout:        o.tokenReviewTimeout,
			CacheTTL:       o.tokenReviewCacheTTL,
			Rate:           o.tokenReviewRate,
			OnRateLimited: metrics.Counter("konnectivity_network_proxy_server_token_reviews_rate_limited_total",
				"Agent token checks refused at once because --max-token-reviews-per-second was reached (no TokenReview sent).", nil).Inc,
		})
		if err != nil {
			return nil, nil, fmt.Errorf("token auth: %w", err)
		}
		o.reviewer = reviewer
		if o.bindAgentIdentity {
			nodes, err := auth.NewNodeLookup(rc, o.tokenReviewTimeout, time.Minute)
			if err != nil {
				return nil, nil, fmt.Errorf("token auth: %w", err)
			}
			nodeAddrs = func(ctx context.Context, node string) ([]netip.Addr, error) {
				addrs, err := nodes.Addresses(ctx, node)
				switch {
				case err == nil:
					return addrs, nil
				case errors.Is(err, auth.ErrNodesForbidden):
					return nil, fmt.Errorf("%w: %v", server.ErrNodesForbidden, err)
				}
				return nil, &wire.StatusError{Code: auth.StatusOf(err), Msg: err.Error()}
			}
		}
		log.Info("agent token auth on", "apiserver", rc.Server(), "audience", o.authAudience, "service_account", o.agentNamespace+"/"+o.agentServiceAccount)
	}
	// Token reviews by result (cache hits included): what an operator
	// checks when agents cannot get in.
	reviews := map[int]*promtext.Counter{}
	for code, result := range map[int]string{http.StatusOK: "authenticated", http.StatusUnauthorized: "unauthorized", http.StatusForbidden: "forbidden", http.StatusServiceUnavailable: "error"} {
		reviews[code] = metrics.Counter("konnectivity_network_proxy_server_token_reviews_total", "Agent token checks, by result.", []string{"result"}, result)
	}
	switch {
	case mtls || reviewer != nil:
		if o.allowUnauthenticated {
			log.Warn("--allow-unauthenticated-agents is ignored: agent authentication is configured")
		}
	case o.allowUnauthenticated:
		log.Warn("AGENTS ARE NOT AUTHENTICATED: any host that reaches the agent port can serve this cluster's egress (--allow-unauthenticated-agents)")
		return nil, nil, nil
	default:
		log.Error("no agent authentication configured: every agent will be refused; set --cluster-ca-cert, the token flags, or --allow-unauthenticated-agents")
	}
	return func(ctx context.Context, c server.AgentCredentials) (server.Principal, error) {
		if mtls && len(c.TLS.VerifiedChains) > 0 {
			return server.CertificatePrincipal(c.TLS.VerifiedChains[0][0]), nil
		}
		if reviewer != nil && c.Token != "" {
			id, err := reviewer.Review(ctx, c.Token)
			if counter := reviews[auth.StatusOf(err)]; counter != nil {
				counter.Inc()
			}
			if err != nil {
				se := &wire.StatusError{Code: auth.StatusOf(err), Msg: err.Error()}
				if auth.Unsure(err) {
					return server.Principal{}, fmt.Errorf("%w (%w)", se, server.ErrReviewUnsure)
				}
				return server.Principal{}, se
			}
			return tokenPrincipal(id, o.agentNamespace+"/"+o.agentServiceAccount), nil
		}
		switch {
		case mtls && reviewer != nil:
			return server.Principal{}, &wire.StatusError{Code: http.StatusUnauthorized, Msg: "present a client certificate or a ServiceAccount token"}
		case mtls:
			return server.Principal{}, &wire.StatusError{Code: http.StatusUnauthorized, Msg: "a client certificate signed by the cluster CA is required"}
		case reviewer != nil:
			return server.Principal{}, &wire.StatusError{Code: http.StatusUnauthorized, Msg: "a ServiceAccount bearer token is required"}
		}
		return server.Principal{}, &wire.StatusError{Code: http.StatusUnauthorized, Msg: "this server has no agent authentication configured"}
	}, nodeAddrs, nil
}

// tokenPrincipal is what a reviewed token proves: the pod and node it was
// issued for when it is bound to a pod, else only its ServiceAccount.
func tokenPrincipal(id auth.Identity, account string) server.Principal {
	p := server.Principal{Kind: server.PrincipalToken, Node: id.Node, Pod: id.Pod, Account: account, Expires: id.Expires, Credential: "sa:" + id.Username}
	switch {
	case id.PodUID != "":
		p.Credential = "pod:" + id.PodUID
	case id.Pod != "":
		p.Credential = "pod:" + id.Node + "/" + id.Pod
	}
	return p
}

// restConfig is how the server reaches kube-apiserver (TokenReview,
// Leases): --kubeconfig, else the pod's ServiceAccount.
func (o *serverOptions) restConfig() (*kubeclient.Config, error) {
	if o.kubeconfig != "" {
		return kubeclient.LoadKubeconfig(o.kubeconfig, o.kubeCtx)
	}
	return kubeclient.InClusterConfig()
}

// nodeMap follows the apiserver's Nodes and EndpointSlices (and Pods with
// --node-strategy-pods) for the node strategy; nil when it is off.
func (o *serverOptions) nodeMap(log *slog.Logger) (*nodemap.Watcher, error) {
	if !strings.Contains(","+strings.ReplaceAll(o.proxyStrategies, " ", "")+",", ",node,") {
		return nil, nil
	}
	rc, err := o.restConfig()
	if err != nil {
		return nil, fmt.Errorf("--proxy-strategies=node reads Nodes from the apiserver: %w", err)
	}
	log.Info("node strategy: following nodes", "apiserver", rc.Server(), "pods", o.nodeStrategyPods)
	return nodemap.New(nodemap.Config{REST: rc, Pods: o.nodeStrategyPods, Logger: log})
}

// startLeases runs the lease controller until stop is called; stop waits
// for it and, if release, deletes the server's Lease. Only the first call
// of stop acts. Without apiserver
// access it logs why and the server runs without a Lease: leases never stop
// the data path.
func (o *serverOptions) startLeases(ctx context.Context, metrics *promtext.Registry, log *slog.Logger) (stop func(release bool)) {
	lease.RegisterServerMetrics(metrics)
	if !o.leases.enable {
		return func(bool) {}
	}
	fail := func(err error) func(bool) {
		log.Error("lease controller off: this server keeps no Lease, so agents that count leases do not count it", "err", err)
		return func(bool) {}
	}
	rc, err := o.restConfig()
	if err != nil {
		return fail(err)
	}
	client, err := lease.NewClient(rc, o.leaseNamespace)
	if err != nil {
		return fail(err)
	}
	ctl, err := lease.NewController(lease.ControllerConfig{
		Client:        client,
		ServerID:      o.serverID,
		Labels:        o.leases.labels,
		Duration:      o.leases.duration,
		RenewInterval: o.leases.renew,
		GCInterval:    o.leases.cull,
		Metrics:       metrics,
		Logger:        log,
	})
	if err != nil {
		return fail(err)
	}
	log.Info("lease controller on", "apiserver", rc.Server(), "lease", o.leaseNamespace+"/"+ctl.Name(), "labels", lease.FormatLabels(o.leases.labels),
		"duration", o.leases.duration.String(), "renew_interval", o.leases.renew.String())
	stopRunning := goUntilStopped(ctx, ctl.Run)
	var once sync.Once
	return func(release bool) {
		once.Do(func() {
			stopRunning()
			if !release {
				return
			}
			if err := ctl.Release(context.Background()); err != nil {
				log.Warn("server lease not deleted; it expires on its own", "err", err, "within", o.leases.duration.String())
				return
			}
			log.Info("server lease deleted", "lease", o.leaseNamespace+"/"+ctl.Name())
		})
	}
}

// reviewedTokens names, in the state a restart hands over, the token
// reviews the running image accepted (auth.Reviewed): the next image
// re-admits those agents while the apiserver cannot review their tokens
// (docs/security.md).
const reviewedTokens = "reviewed-tokens"

// trustReviewed takes over the accepted token reviews a previous image
// handed over, if any.
func (o *serverOptions) trustReviewed(data json.RawMessage, log *slog.Logger) {
	if o.reviewer == nil || data == nil {
		return
	}
	var list []auth.Reviewed
	if err := json.Unmarshal(data, &list); err != nil {
		log.Warn("token reviews from the previous image unreadable; agents are reviewed again", "err", err)
		return
	}
	log.Info("token reviews taken over from the previous image", "tokens", o.reviewer.Trust(list), "of", len(list))
}

// agentDescriptors is the bound on agent-port connections that keeps
// --reserved-file-descriptors (and the descriptors open now) for the
// front door and the health and admin ports; 0 for no bound.
func (o *serverOptions) agentDescriptors(log *slog.Logger) int {
	if o.reservedFDs < 0 {
		return 0
	}
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil || lim.Cur == unix.RLIM_INFINITY || lim.Cur > 1<<30 {
		return 0
	}
	reserve := o.reservedFDs
	if reserve == 0 {
		reserve = min(int(lim.Cur)/4, 1024)
	}
	open := 0
	if fds, err := os.ReadDir("/proc/self/fd"); err == nil {
		open = len(fds)
	}
	n := int(lim.Cur) - reserve - open
	if n < 2*o.maxUnadmitted {
		log.Warn("descriptor limit too low for --reserved-file-descriptors: agent connections not bounded by it", "limit", lim.Cur, "reserved", reserve, "open", open)
		return 0
	}
	return n
}
