package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/spinifex/konnectivity/certs"
	"github.com/spinifex/konnectivity/internal/daemon"
	"github.com/spinifex/konnectivity/internal/kubeclient"
	"github.com/spinifex/konnectivity/internal/lease"
	"github.com/spinifex/konnectivity/internal/promtext"
)

// runCheck loads the configuration a server or an agent would start with
// (its flags, and every certificate, key, CA bundle, token file and
// kubeconfig its start reads) and serves nothing: exit 0 when a start
// would get past loading it, 1 when it would not (the line names the flag
// and the file), 2 for bad flags, and daemon.CheckExitCertificate when it
// loads but a certificate it would present is expired or not yet valid
// (a start only warns of that). A restart runs it with the executable it
// would run and refuses to hand over when it fails (docs/restart.md); an
// operator can run it before a reload. It contacts nothing: whether the
// apiserver answers is no reason to refuse a restart.
func runCheck(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && (args[0] == "--version" || args[0] == "-version") {
		writeVersion(stdout)
		return 0
	}
	if len(args) == 0 || args[0] != "server" && args[0] != "agent" {
		fmt.Fprintln(stderr, "usage: konnectivity check server|agent [the command's flags]")
		return 2
	}
	var (
		cf       *commandFlags
		complete func() error
		check    func(*slog.Logger) error
	)
	switch args[0] {
	case "server":
		o, f := newServerFlags()
		cf, complete, check = f, func() error { return o.complete(f) }, o.check
	case "agent":
		o, f := newAgentFlags()
		cf, complete, check = f, func() error { return o.complete(f) }, o.check
	}
	name := "konnectivity check " + args[0]
	_, err := cf.parseArgs(args[1:])
	if code, done := flagsParsed(cf.FlagSet, err, "", stdout, stderr); done {
		return code
	}
	if err := complete(); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return 2
	}
	// What a start would only warn about is shown, and is no failure.
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	if err := check(log); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		if errors.As(err, new(*validityError)) {
			return daemon.CheckExitCertificate
		}
		return 1
	}
	fmt.Fprintf(stdout, "%s: configuration loads\n", name)
	return 0
}

// check loads what the server's start loads before it serves, and fails
// where that start would fail.
func (o *serverOptions) check(log *slog.Logger) error {
	minTLS := o.minTLS()
	if o.mintCAKey != "" {
		// The agent listener's pair is minted at start when it does not
		// load; the CA that mints it must.
		if _, err := certs.LoadCA(o.mintCACert, o.mintCAKey); err != nil {
			return fmt.Errorf("--mint-ca-cert/--mint-ca-key: %w", err)
		}
		if _, _, err := certs.ParseSANs(o.mintSANs); err != nil {
			return fmt.Errorf("--mint-sans: %w", err)
		}
		if o.clusterCACert != "" {
			if _, err := certs.NewCAPoolReloader(o.clusterCACert, nil); err != nil {
				return fmt.Errorf("--cluster-ca-cert: %w", err)
			}
		}
	} else if _, pair, err := o.agentTLSConfig(minTLS, log); err != nil {
		return err
	} else if err := pair.CheckValidity(time.Now()); err != nil {
		return &validityError{flag: "--cluster-cert", file: o.clusterCert, err: err}
	}
	if o.serverPort != 0 {
		_, pair, err := o.frontendTLSConfig(minTLS, log)
		if err != nil {
			return err
		}
		if err := pair.CheckValidity(time.Now()); err != nil {
			return &validityError{flag: "--server-cert", file: o.serverCert, err: err}
		}
	}
	// Token auth's kubeconfig, the node lookup, the frontend's UIDs.
	if _, err := o.serverConfig(nil, promtext.NewRegistry(), log); err != nil {
		return err
	}
	if strings.Contains(","+strings.ReplaceAll(o.proxyStrategies, " ", "")+",", ",node,") {
		if _, err := o.restConfig(); err != nil {
			return fmt.Errorf("--proxy-strategies=node reads Nodes from the apiserver: %w", err)
		}
	}
	if o.leases.enable { // a start without its Lease goes on: a warning
		rc, err := o.restConfig()
		if err == nil {
			_, err = lease.NewClient(rc, o.leaseNamespace)
		}
		if err != nil {
			log.Warn("lease controller would be off", "err", err)
		}
	}
	return nil
}

// check loads what the agent reads to log in to each server: the CA, its
// client pair and its token file; its start fails on nothing else it
// reads (the node rule's kubeconfig is read in complete).
func (o *agentOptions) check(log *slog.Logger) error {
	for _, addr := range o.serverAddrs() {
		host, _, _ := net.SplitHostPort(addr)
		cfg, err := o.tlsConfig(host)
		if err != nil {
			return err
		}
		if err := clientPairValid(cfg.Certificates); err != nil {
			return &validityError{flag: "--agent-cert", file: o.agentCert, err: err}
		}
	}
	if o.tokenPath != "" {
		if _, err := o.token(); err != nil {
			return fmt.Errorf("--service-account-token-path: %w", err)
		}
	}
	if o.leases.count { // an agent that cannot count Leases goes on: a warning
		rc, err := kubeclient.LoadKubeconfig(o.kubeconfig, "")
		if err == nil {
			_, err = lease.NewClient(rc, o.leaseNamespace)
		}
		if err != nil {
			log.Warn("server leases would not be counted", "err", err)
		}
	}
	return nil
}

// validityError is a check's failure for a certificate that loads but is
// outside its validity: peers refuse it, so a restart into it would lose
// every peer the running image holds, though a start only warns.
type validityError struct {
	flag, file string
	err        error
}

func (e *validityError) Error() string {
	return fmt.Sprintf("%s: certificate %s %v: peers refuse it until it is replaced", e.flag, e.file, e.err)
}

// clientPairValid checks the client pair an agent logs in with, if any.
func clientPairValid(pairs []tls.Certificate) error {
	if len(pairs) == 0 {
		return nil
	}
	leaf := pairs[0].Leaf
	if leaf == nil { // GODEBUG=x509keypairleaf=0 does not set Leaf
		var err error
		if leaf, err = x509.ParseCertificate(pairs[0].Certificate[0]); err != nil {
			return err
		}
	}
	return certs.CheckValidity(leaf, time.Now())
}
