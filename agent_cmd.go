package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/spinifex/konnectivity/certs"
	"github.com/spinifex/konnectivity/internal/daemon"
	"github.com/spinifex/konnectivity/internal/kubeclient"
	"github.com/spinifex/konnectivity/internal/lease"
	"github.com/spinifex/konnectivity/internal/nodemap"
	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/internal/proxydial"
	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/wire"
)

type agentOptions struct {
	daemonOptions
	warned                 *onceWarnings // the process's one-time warnings
	serverHost, caCert     string
	serverPort             int
	agentCert, agentKey    string
	agentID, identifiers   string
	tokenPath              string
	tokenRefresh           time.Duration
	dialTimeout            time.Duration
	drainTimeout           time.Duration
	syncInterval, syncCap  time.Duration
	maxStreams             uint
	maxStreamsTotal        uint
	expandDNS, syncForever bool
	readyzAll              bool
	allowDestinations      string
	denyDestinations       string
	openDestinations       string
	destinations           *agent.DestinationPolicy
	nodeName               string
	ownNode                *nodemap.Watcher // follows the agent's Node and its pods for --allow-destinations=node; nil without
	leases                 agentLeaseOptions
	// serverDialer reaches the servers through the egress proxy the
	// environment names (HTTPS_PROXY, NO_PROXY), or directly.
	serverDialer *proxydial.Dialer
	alpnProto    string   // --alpn-proto as given
	alpnProtos   []string // --alpn-proto as a list
}

// agentLeaseOptions are upstream's lease-counting flags.
type agentLeaseOptions struct {
	count       bool
	selector    string
	source      string
	parsed      lease.Selector
	countSource agent.CountSource

	deprecatedLabel bool // --lease-label was given
}

// deprecatedAlias is a string flag that sets another flag's value and
// remembers it was used, so the command can say which name to use.
type deprecatedAlias struct {
	target *string
	set    *bool
}

func (d *deprecatedAlias) String() string {
	if d.target == nil {
		return ""
	}
	return *d.target
}

func (d *deprecatedAlias) Set(v string) error {
	*d.target, *d.set = v, true
	return nil
}

func newAgentFlags() (*agentOptions, *commandFlags) {
	o := &agentOptions{warned: newOnceWarnings()}
	cf := newCommandFlags("konnectivity agent")
	cf.defineDaemonFlags(&o.daemonOptions, daemonFlagNames{
		healthHost: "health-server-host", healthPort: "health-server-port", adminPort: "admin-server-port",
		healthDefault: 8093, adminDefault: 8094,
		peer: "the server", onPingTimeout: "reconnecting", kubeconfigFor: "counting Leases",
	})
	f := cf.FlagSet
	f.StringVar(&o.serverHost, "proxy-server-host", "127.0.0.1", "server or load balancer host to dial (also the TLS server name); a comma list holds a tunnel to each")
	f.BoolVar(&o.expandDNS, "proxy-server-resolve", false, "resolve each --proxy-server-host to all its A/AAAA records and hold a tunnel to each address (no load balancer needed)")
	f.BoolVar(&o.syncForever, "sync-forever", false, "keep probing a load-balanced address after the server count is reached, to find added servers")
	f.BoolVar(&o.readyzAll, "readyz-requires-all-servers", false, "/readyz fails until the agent holds a tunnel to every server (as /readyz?all does)")
	f.IntVar(&o.serverPort, "proxy-server-port", 8091, "server agent port")
	f.StringVar(&o.caCert, "ca-cert", "", "CA that signs the server's certificate (read again on every connect; default: system roots)")
	f.StringVar(&o.agentCert, "agent-cert", "", "client certificate for mTLS (read again on every connect)")
	f.StringVar(&o.agentKey, "agent-key", "", "client key for mTLS")
	f.StringVar(&o.agentID, "agent-id", "", "agent ID (default: $PROXY_AGENT_ID, else the host name)")
	f.StringVar(&o.identifiers, "agent-identifiers", "", "identifiers for destHost routing, e.g. host=node1&ipv4=10.0.0.5 (cidr= and default-route=true need the server's --route-agents)")
	f.StringVar(&o.tokenPath, "service-account-token-path", "", "ServiceAccount token file sent as a bearer token (read again on every connect)")
	f.DurationVar(&o.tokenRefresh, "token-refresh-interval", 30*time.Second, "how often the token file is read again; a new token is presented to every server without dropping tunnels")
	f.DurationVar(&o.dialTimeout, "dial-timeout", 5*time.Second, "bound on dialling a destination")
	f.DurationVar(&o.drainTimeout, "drain-timeout", 30*time.Second, "on SIGTERM, how long open tunnels may finish")
	f.DurationVar(&o.syncInterval, "sync-interval", time.Second, "first reconnect delay")
	f.DurationVar(&o.syncCap, "sync-interval-cap", 10*time.Second, "reconnect delay cap")
	f.UintVar(&o.maxStreams, "max-streams", 0, "concurrent tunnels accepted per server connection; 0: no bound of its own (--max-streams-total bounds them all)")
	f.UintVar(&o.maxStreamsTotal, "max-streams-total", 0, "concurrent tunnels accepted from all servers together, past which a CONNECT gets 503; 0: derived from the descriptor limit, (limit - 256) / 2 (a tunnel takes a descriptor, and one more while kept for a restarting server)")
	f.StringVar(&o.allowDestinations, "allow-destinations", "", "comma list of destinations the agent may dial (CIDR or address, optional :port or :lo-hi; \":10250\" is any address); empty allows all but denied ones")
	f.StringVar(&o.denyDestinations, "deny-destinations", "", "comma list of destinations the agent must not dial (same syntax); wins over every other rule")
	f.StringVar(&o.nodeName, "node-name", os.Getenv("NODE_NAME"), "the agent's node, for the --allow-destinations keyword node (default $NODE_NAME)")
	f.StringVar(&o.openDestinations, "open-destinations", "", "comma list of rules (same syntax, with an address) that open parts of the built-in denied ranges: 169.254.0.0/16, fe80::/10 and the cloud metadata addresses; --deny-destinations still wins and --allow-destinations still limits")

	cf.tolerate("probe-interval", false, "not needed: HTTP/2 PING (--keepalive-time, --ping-timeout) checks each connection")
	f.StringVar(&o.alpnProto, "alpn-proto", "", "ALPN protocols to offer the server besides the agent's own (comma list), for a port an ALPN router shares")
	f.BoolVar(&o.leases.count, "count-server-leases", false, "count the servers' coordination.k8s.io/v1 Leases (servers run --enable-lease-controller) and want a tunnel to that many servers")
	f.StringVar(&o.leases.selector, "lease-label-selector", "k8s-app=konnectivity-server", "label selector of the server Leases to count")
	f.Var(&deprecatedAlias{target: &o.leases.selector, set: &o.leases.deprecatedLabel}, "lease-label", "deprecated: use --lease-label-selector")
	f.StringVar(&o.leases.source, "server-count-source", "max", "how the lease count and the count servers announce combine: max (the larger) or default (the lease count alone, once known)")
	cf.tolerate("kube-api-content-type", false, "Leases are read as JSON")
	return o, cf
}

func runAgent(args []string, stdout, stderr io.Writer) int {
	o, cf := newAgentFlags()
	o.checkArgs = append([]string{"check", "agent"}, args...)
	return runDaemon("agent", cf, o.warned, args, stdout, stderr, func() error { return o.complete(cf) }, o.run)
}

func (o *agentOptions) complete(cf *commandFlags) error {
	if o.agentID == "" {
		o.agentID = os.Getenv("PROXY_AGENT_ID")
	}
	if o.agentID == "" {
		host, err := os.Hostname()
		if err != nil || host == "" {
			return fmt.Errorf("no --agent-id and no host name: %v", err)
		}
		o.agentID = host
	}
	ids, err := wire.ParseIdentifiers(o.identifiers)
	if err != nil {
		return fmt.Errorf("--agent-identifiers: %w", err)
	}
	for _, why := range ids.Ignored {
		cf.warn("--agent-identifiers: value ignored; upstream checks keys only, and it names nothing a dial can match", "identifier", why)
	}
	if len(o.serverAddrs()) == 0 {
		return fmt.Errorf("--proxy-server-host is empty")
	}
	// As upstream's agent offers its own protocol (h2) after the given
	// ones, ours offers its own after them: HTTP/1.1, which it speaks until
	// the Upgrade. A server that knows none of the given ones settles on
	// it (Go's servers, which offer h2, accept an http/1.1 client without
	// ALPN), so the flag upstream's manifests still pass never
	// stops an agent from connecting.
	if o.alpnProtos = splitList(o.alpnProto); len(o.alpnProtos) > 0 && !slices.Contains(o.alpnProtos, "http/1.1") {
		o.alpnProtos = append(o.alpnProtos, "http/1.1")
	}
	o.serverDialer = proxydial.FromEnvironment()
	for _, addr := range o.serverAddrs() {
		if _, err := o.serverDialer.Proxy(addr); err != nil {
			return fmt.Errorf("HTTPS_PROXY/NO_PROXY: %w", err)
		}
	}
	if (o.agentCert == "") != (o.agentKey == "") {
		return fmt.Errorf("--agent-cert and --agent-key go together")
	}
	if err := o.daemonOptions.complete(cf); err != nil {
		return err
	}
	rules := agent.DestinationRules{Allow: o.allowDestinations, Deny: o.denyDestinations, Open: o.openDestinations}
	if agent.HasNodeRule(o.allowDestinations) {
		if err := o.followOwnNode(&rules); err != nil {
			return fmt.Errorf("--allow-destinations=node: %w", err)
		}
	}
	if o.destinations, err = agent.NewDestinationPolicy(rules); err != nil {
		return err
	}
	if o.leases.parsed, err = lease.ParseSelector(o.leases.selector); err != nil {
		return fmt.Errorf("--lease-label-selector: %w", err)
	}
	switch o.leases.source {
	case "max":
		o.leases.countSource = agent.CountMax
	case "default", "":
		o.leases.countSource = agent.CountLeases
	default:
		return fmt.Errorf("--server-count-source=%q: want default or max", o.leases.source)
	}
	if err := lease.CheckName(o.leaseNamespace, ""); err != nil {
		return fmt.Errorf("--lease-namespace: %w", err)
	}
	if o.maxStreams > 1<<31 || o.maxStreamsTotal > 1<<31 {
		return fmt.Errorf("--max-streams=%d, --max-streams-total=%d: out of range", o.maxStreams, o.maxStreamsTotal)
	}
	return nil
}

// tlsConfig reads the CA and client certificate from disk, so that each
// new connection uses what is there now.
func (o *agentOptions) tlsConfig(serverName string) (*tls.Config, error) {
	cfg := &tls.Config{ServerName: serverName, MinVersion: o.minTLS(), CipherSuites: o.cipherSuiteIDs, NextProtos: o.alpnProtos}
	if o.caCert != "" {
		pool, err := certs.LoadCAPool(o.caCert)
		if err != nil {
			return nil, fmt.Errorf("--ca-cert: %w", err)
		}
		cfg.RootCAs = pool
	}
	if o.agentCert != "" {
		cert, err := tls.LoadX509KeyPair(o.agentCert, o.agentKey)
		if err != nil {
			return nil, fmt.Errorf("--agent-cert/--agent-key: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// serverAddrs turns the host list and port into dial addresses.
func (o *agentOptions) serverAddrs() []string {
	var addrs []string
	for _, h := range strings.Split(o.serverHost, ",") {
		if h = strings.TrimSpace(h); h != "" {
			addrs = append(addrs, net.JoinHostPort(h, fmt.Sprint(o.serverPort)))
		}
	}
	return addrs
}

func (o *agentOptions) token() (string, error) {
	data, err := os.ReadFile(o.tokenPath)
	if err != nil {
		return "", fmt.Errorf("read %s: %w", o.tokenPath, err)
	}
	token := strings.TrimSpace(string(data))
	if token == "" {
		return "", fmt.Errorf("%s is empty", o.tokenPath)
	}
	return token, nil
}

func (o *agentOptions) run(ctx context.Context, log *slog.Logger) error {
	kept := daemon.Inherit("kept destinations", func(h *agent.KeptDest, c net.Conn) { h.Socket = c }, log) // before anything can fail: their sockets close with the process
	o.warned.start(daemon.InheritedState(log)[warnedState], log)
	cfg := agent.Config{
		ServerAddrs:     o.serverAddrs(),
		ExpandDNS:       o.expandDNS,
		SyncForever:     o.syncForever,
		CountSource:     o.leases.countSource,
		ID:              o.agentID,
		Identifiers:     o.identifiers,
		TLS:             o.tlsConfig,
		ServerDialer:    o.serverDialer.DialContext,
		DialTimeout:     o.dialTimeout,
		KeepAlive:       o.keepaliveTime,
		PingTimeout:     o.pingTimeout,
		DrainTimeout:    o.drainTimeout,
		SyncInterval:    o.syncInterval,
		SyncCap:         o.syncCap,
		MaxStreams:      uint32(o.maxStreams),
		MaxStreamsTotal: uint32(o.maxStreamsTotal),
		Destinations:    o.destinations,
		Logger:          log,
	}
	if o.tokenPath != "" {
		cfg.Token = o.token
		cfg.TokenRefresh = o.tokenRefresh
	}
	metrics := promtext.NewRegistry()
	daemon.AddProcessMetrics(metrics, "konnectivity_network_proxy_agent_", versionString())
	cfg.Metrics = metrics
	a, err := agent.New(cfg)
	if err != nil {
		return err
	}
	a.AdoptKept(kept)
	d := daemon.New(log)
	defer d.Close()
	ready := []daemon.Check{{Name: "server-connected", Run: a.Ready}}
	readyAll := []daemon.Check{{Name: "all-servers-connected", Run: a.ReadyAll}}
	if o.readyzAll {
		ready = readyAll
	}
	if err := d.StartServices(o.services(daemon.Services{
		Ready:    ready,
		ReadyAll: readyAll,
		Metrics:  metrics,
		Status:   func() any { return a.Status() },
	})); err != nil {
		return err
	}
	stopCounting := o.startLeaseCounter(ctx, a, metrics, log)
	defer stopCounting()
	if o.ownNode != nil {
		o.ownNode.SetLogger(log)
		defer goUntilStopped(context.WithoutCancel(ctx), o.ownNode.Run)()
		log.Info("destinations limited to this node", "node", o.nodeName)
	}
	log.Info("agent starting", "agent_id", o.agentID, "servers", strings.Join(cfg.ServerAddrs, ","), "identifiers", o.identifiers)
	for _, addr := range cfg.ServerAddrs {
		p, _ := o.serverDialer.Proxy(addr) // checked in complete
		log.Info("server route", "server", addr, "proxy", proxydial.Name(p))
	}

	// The agent runs until ctx ends (SIGTERM) or a restart is asked for; in
	// both cases it drains first (servers prefer other agents meanwhile).
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	runDone := make(chan error, 1)
	go func() { runDone <- a.Run(runCtx) }()
	stop := func() error { stopRun(); return <-runDone }
	return d.Run(ctx, o.restarts(daemon.Work{
		Done: runDone,
		Shutdown: func(ended bool, cause error) error {
			if ended {
				return cause
			}
			return stop()
		},
		Drain: func(trigger string) []daemon.Handed {
			// Servers that can pause the tunnels for the next image do;
			// the rest drain.
			log.Info("restarting in place: draining tunnels; servers pause what can move to the next image", "trigger", trigger, "drain_timeout", o.drainTimeout.String())
			a.Restarting()
			stop()
			return daemon.Hand("kept destinations", a.KeptForNextImage(), func(h *agent.KeptDest) net.Conn { return h.Socket })
		},
		State:        func() map[string]any { return map[string]any{warnedState: o.warned.handed()} },
		MemoryReady:  func() bool { ok, _ := a.ReadyAll(); return ok },
		Metrics:      metrics,
		MetricPrefix: "konnectivity_network_proxy_agent_",
	}))
}

// followOwnNode makes the watcher of the agent's own Node and pods, read
// with its own credential (--kubeconfig, else in-cluster), that the node
// rule checks destinations against.
func (o *agentOptions) followOwnNode(rules *agent.DestinationRules) error {
	if o.nodeName == "" {
		return errors.New("the agent's node is not known: set --node-name or $NODE_NAME (spec.nodeName)")
	}
	rc, err := kubeclient.LoadKubeconfig(o.kubeconfig, "")
	if err != nil {
		return err
	}
	if o.ownNode, err = nodemap.New(nodemap.Config{REST: rc, Node: o.nodeName}); err != nil {
		return err
	}
	rules.OwnNode = o.nodeName
	rules.Owns = func(a netip.Addr) bool { n, _ := o.ownNode.Table().LookupAddr(a); return n == o.nodeName }
	return nil
}

// startLeaseCounter counts the server Leases and gives the count to the
// agent until ctx ends; stop waits for it. An agent that cannot reach the
// apiserver warns once and goes on with the count the servers announce.
func (o *agentOptions) startLeaseCounter(ctx context.Context, agent *agent.Agent, metrics *promtext.Registry, log *slog.Logger) (stop func()) {
	if o.leases.deprecatedLabel && o.warned.first("lease-label deprecated") {
		log.Warn("--lease-label is deprecated on the agent: use --lease-label-selector")
	}
	if !o.leases.count {
		return func() {}
	}
	fail := func(err error) func() {
		if o.warned.first("cannot count server leases") {
			log.Warn("cannot count server leases: using the server count the servers announce", "err", err)
		}
		return func() {}
	}
	rc, err := kubeclient.LoadKubeconfig(o.kubeconfig, "")
	if err != nil {
		return fail(err)
	}
	client, err := lease.NewClient(rc, o.leaseNamespace)
	if err != nil {
		return fail(err)
	}
	counter, err := lease.NewCounter(lease.CounterConfig{
		Client:       client,
		Selector:     o.leases.parsed,
		PollInterval: o.syncCap,
		OnChange:     agent.SetLeaseCount,
		Metrics:      metrics,
		Logger:       log,
	})
	if err != nil {
		return fail(err)
	}
	log.Info("counting server leases", "apiserver", rc.Server(), "namespace", o.leaseNamespace, "selector", o.leases.parsed.String(), "server_count_source", o.leases.source)
	return goUntilStopped(ctx, counter.Run)
}
