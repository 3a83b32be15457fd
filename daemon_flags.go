package main

import (
	"crypto/tls"
	"fmt"
	"net"
	"time"

	"github.com/spinifex/konnectivity/certs"
	"github.com/spinifex/konnectivity/internal/daemon"
)

// daemonOptions are the options the server and the agent share, each flag
// defined once (defineDaemonFlags): the health and admin services, the TLS
// floor, the HTTP/2 keepalive, the self-restart, and how the apiserver is
// reached for Leases.
type daemonOptions struct {
	healthHost, adminHost      string
	healthPort, adminPort      int
	enableProfiling            bool
	tlsMinVersion              string
	cipherSuites               string   // --cipher-suites as given
	cipherSuiteIDs             []uint16 // --cipher-suites, once complete has checked it; nil is Go's defaults
	keepaliveTime, pingTimeout time.Duration
	restartOnBinaryChange      bool
	restartCheckInterval       time.Duration
	kubeconfig                 string
	leaseNamespace             string
	// checkArgs is the configuration check of this command line
	// (runCheck), which a restart runs with the next image's executable.
	checkArgs []string
}

// daemonFlagNames is what upstream names or means differently in the two
// commands' shared flags.
type daemonFlagNames struct {
	healthHost, healthPort, adminPort string
	healthDefault, adminDefault       int
	peer                              string // where the keepalive PINGs go
	onPingTimeout                     string // what an unanswered PING ends in
	kubeconfigFor                     string // what the apiserver is called for
}

// defineDaemonFlags defines the shared flags on cf, and the upstream flags
// both commands accept without honouring.
func (cf *commandFlags) defineDaemonFlags(o *daemonOptions, n daemonFlagNames) {
	f := cf.FlagSet
	f.StringVar(&o.healthHost, n.healthHost, "", "address the health server binds to (default all)")
	f.IntVar(&o.healthPort, n.healthPort, n.healthDefault, "port of /healthz, /livez and /readyz; 0 disables it")
	f.StringVar(&o.adminHost, "admin-bind-address", "127.0.0.1", "address the admin server binds to")
	f.IntVar(&o.adminPort, n.adminPort, n.adminDefault, "port of the admin server (/debug/tunnels, pprof); 0 disables it")
	f.BoolVar(&o.enableProfiling, "enable-profiling", false, "serve /debug/pprof on the admin port")
	f.StringVar(&o.tlsMinVersion, "tls-min-version", "VersionTLS12", "minimum TLS version: VersionTLS12 or VersionTLS13")
	f.StringVar(&o.cipherSuites, "cipher-suites", "", "TLS 1.2 cipher suites, a comma list of Go's names (TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, ...); empty: Go's. TLS 1.3 suites are not configurable in Go")
	f.DurationVar(&o.keepaliveTime, "keepalive-time", 30*time.Second, "idle time before an HTTP/2 PING to "+n.peer)
	f.DurationVar(&o.pingTimeout, "ping-timeout", 15*time.Second, "how long a PING may go unanswered before "+n.onPingTimeout)
	f.BoolVar(&o.restartOnBinaryChange, "restart-on-binary-change", false, "re-execute in place (after draining) when the executable on disk is replaced; SIGHUP does the same")
	f.DurationVar(&o.restartCheckInterval, "restart-check-interval", 2*time.Second, "how often --restart-on-binary-change looks at the executable")
	f.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig for "+n.kubeconfigFor+" (default: the pod's ServiceAccount)")
	f.StringVar(&o.leaseNamespace, "lease-namespace", "kube-system", "namespace of the server Leases")
	cf.tolerate("xfr-channel-size", false, "not needed: every tunnel has its own HTTP/2 flow-control window")
	cf.tolerate("warn-on-channel-limit", true, "not needed: there are no shared channels")
	cf.tolerate("enable-contention-profiling", true, "not supported; --enable-profiling serves pprof")
}

// complete checks the shared flags.
func (o *daemonOptions) complete(cf *commandFlags) error {
	if err := checkTLSVersion(cf, o.tlsMinVersion); err != nil {
		return err
	}
	// Go's names of the suites (tls.CipherSuites); none is Go's defaults.
	var err error
	if o.cipherSuiteIDs, err = certs.CipherSuiteIDs(splitList(o.cipherSuites)); err != nil {
		return fmt.Errorf("--cipher-suites: %w", err)
	}
	return nil
}

// services fills in s where the health and admin services listen.
func (o *daemonOptions) services(s daemon.Services) daemon.Services {
	s.HealthAddr = servicePort(o.healthHost, o.healthPort)
	s.AdminAddr = servicePort(o.adminHost, o.adminPort)
	s.Profiling = o.enableProfiling
	return s
}

// restarts fills in w when the executable's replacement restarts it.
func (o *daemonOptions) restarts(w daemon.Work) daemon.Work {
	w.RestartOnBinaryChange, w.RestartCheckInterval = o.restartOnBinaryChange, o.restartCheckInterval
	w.Check = o.checkArgs
	return w
}

// minTLS is --tls-min-version, once complete has checked it.
func (o *daemonOptions) minTLS() uint16 {
	v, _ := tlsVersion(o.tlsMinVersion)
	return v
}

// tlsVersion reads --tls-min-version. Upstream's VersionTLS10 and
// VersionTLS11 are read as TLS 1.2: 1.0 and 1.1 are deprecated (RFC 8996)
// and every kube-apiserver and agent speaks 1.2.
func tlsVersion(s string) (uint16, error) {
	switch s {
	case "VersionTLS10", "VersionTLS11", "VersionTLS12", "":
		return tls.VersionTLS12, nil
	case "VersionTLS13":
		return tls.VersionTLS13, nil
	}
	return 0, fmt.Errorf("--tls-min-version=%q: want VersionTLS12 or VersionTLS13 (VersionTLS10 and VersionTLS11 are read as VersionTLS12)", s)
}

// checkTLSVersion checks --tls-min-version and warns when an upstream
// value is read as TLS 1.2.
func checkTLSVersion(cf *commandFlags, s string) error {
	if _, err := tlsVersion(s); err != nil {
		return err
	}
	if s == "VersionTLS10" || s == "VersionTLS11" {
		cf.warn("--tls-min-version below TLS 1.2 is not offered (RFC 8996 deprecates 1.0 and 1.1); using VersionTLS12", "tls_min_version", s)
	}
	return nil
}

// servicePort is the address of a health or admin service, "" when its
// port is 0 (the service is off).
func servicePort(host string, port int) string {
	if port == 0 {
		return ""
	}
	return hostPort(host, port)
}

func hostPort(host string, port int) string {
	return net.JoinHostPort(host, fmt.Sprint(port))
}
