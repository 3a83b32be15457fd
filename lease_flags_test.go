package main

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/spinifex/konnectivity/tunnel/agent"
)

// Lease flags that cannot work fail at start with exit 2 and say why,
// instead of failing every renewal later.
func TestLeaseFlagValidation(t *testing.T) {
	server := []string{"--mode=http-connect", "--uds-name=/x", "--cluster-cert=c", "--cluster-key=k", "--enable-lease-controller"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{append(server, "--lease-label=novalue"), "--lease-label: lease labels: \"novalue\": want key=value"},
		{append(server, "--lease-label=k8s-app=-bad"), "--lease-label"},
		{append(server, "--server-id=Upper_Case"), "--enable-lease-controller: lease name"},
		{append(server, "--lease-namespace=Kube.System"), "lease namespace"},
		{append(server, "--lease-renew-interval=30s"), "must be positive and shorter than --lease-duration"},
	} {
		var errb bytes.Buffer
		if code := runServer(c.args, io.Discard, &errb); code != 2 || !strings.Contains(errb.String(), c.want) {
			t.Errorf("server %v: exit %d, stderr %q; want 2 and %q", c.args, code, errb.String(), c.want)
		}
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--server-count-source=min"}, `--server-count-source="min": want default or max`},
		{[]string{"--lease-label-selector=a in (b"}, "--lease-label-selector"},
		{[]string{"--count-server-leases", "--lease-namespace=a_b"}, "--lease-namespace"},
	} {
		var errb bytes.Buffer
		if code := runAgent(c.args, io.Discard, &errb); code != 2 || !strings.Contains(errb.String(), c.want) {
			t.Errorf("agent %v: exit %d, stderr %q; want 2 and %q", c.args, code, errb.String(), c.want)
		}
	}
}

// The agent's lease flags parse as upstream's: --lease-label is the
// deprecated name of --lease-label-selector, and --server-count-source
// takes upstream's values.
func TestAgentLeaseFlags(t *testing.T) {
	for _, c := range []struct {
		args     []string
		selector string
		source   agent.CountSource
	}{
		{nil, "k8s-app=konnectivity-server", agent.CountMax},
		{[]string{"--server-count-source=default", "--lease-label-selector=app in (a,b)"}, "app in (a,b)", agent.CountLeases},
		{[]string{"--server-count-source=", "--lease-label=tier=cp"}, "tier=cp", agent.CountLeases},
		{[]string{"--server-count-source=max"}, "k8s-app=konnectivity-server", agent.CountMax},
	} {
		o, cf := newAgentFlags()
		if _, err := cf.parse(append([]string{"--agent-id=a"}, c.args...), io.Discard); err != nil {
			t.Fatal(err)
		}
		if err := o.complete(cf); err != nil {
			t.Fatalf("%v: %v", c.args, err)
		}
		if got := o.leases.parsed.String(); got != c.selector || o.leases.countSource != c.source {
			t.Errorf("%v: selector %q source %v, want %q %v", c.args, got, o.leases.countSource, c.selector, c.source)
		}
	}
}
