package e2e

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	kserver "github.com/spinifex/konnectivity/tunnel/server"
)

// kubeUpstreamAgentEnv passes upstream's proxy-agent, built outside the
// test's network namespace (the build needs the module proxy), to the test
// inside it.
const kubeUpstreamAgentEnv = "KONNECTIVITY_KUBE_UPSTREAM_AGENT"

// upstreamAgentPodToken runs upstream's proxy-agent as its DaemonSet does:
// no --agent-id (upstream's agent then takes a random UUID) and the
// projected token the apiserver bound to the agent's pod. The server admits
// it under the identity the token proves, the pod's name, routes it as the
// token's node, and keeps the UUID it asked for as a label; every path
// through the tunnel works through it. Our agent is stopped meanwhile and
// started again at the end.
func (e *kubeEnv) upstreamAgentPodToken(t *testing.T) {
	bin := os.Getenv(kubeUpstreamAgentEnv)
	if bin == "" {
		t.Fatalf("%s is not set: upstream's proxy-agent was not built", kubeUpstreamAgentEnv)
	}
	arg := func(name string) string {
		for _, a := range e.agentArgs {
			if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
				return v
			}
		}
		t.Fatalf("our agent's arguments have no --%s", name)
		return ""
	}
	e.agent.proc.stop(t)
	e.s.waitAgents(t, 0, 10*time.Second)
	up := startProcEnv(t, bin, "upstream-proxy-agent", nil,
		"--proxy-server-host=127.0.0.1",
		"--proxy-server-port="+strconv.Itoa(e.s.agentPort),
		"--ca-cert="+arg("ca-cert"),
		"--service-account-token-path="+arg("service-account-token-path"),
		"--health-server-port="+strconv.Itoa(freePort(t)),
		"--admin-server-port="+strconv.Itoa(freePort(t)),
		"--sync-interval=200ms", "--sync-interval-cap=1s",
		"--logtostderr=true")
	e.s.waitAgents(t, 1, startTimeout)
	a := e.checkUpstreamAgentIdentity(t)
	t.Logf("upstream's proxy-agent (asked for ID %s) admitted as %s, node %s", a.ClaimedID, a.ID, a.Node)
	e.waitAll(t, "through upstream's proxy-agent", 90*time.Second, nil)
	up.stop(t)
	e.s.waitAgents(t, 0, 10*time.Second)
	e.startAgent(t)
}

var uuidRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// checkUpstreamAgentIdentity reads the server's /debug/tunnels: one agent,
// named for the pod its token is bound to, bound to the token's node, and
// labelled with the random ID it asked for.
func (e *kubeEnv) checkUpstreamAgentIdentity(t *testing.T) kserver.AgentStatus {
	t.Helper()
	var st kserver.Status
	getJSON(t, fmt.Sprintf("http://127.0.0.1:%d/debug/tunnels", e.s.adminPort), &st)
	if len(st.Agents) != 1 {
		t.Fatalf("server lists %d agents, want upstream's one: %+v", len(st.Agents), st.Agents)
	}
	a := st.Agents[0]
	if a.ID != "konnectivity-agent-"+kubeNode || a.Node != kubeNode || !uuidRE.MatchString(a.ClaimedID) {
		t.Fatalf("upstream's agent listed as %+v; want ID konnectivity-agent-%s (its token's pod), node %s, and the UUID it asked for as claimedID", a, kubeNode, kubeNode)
	}
	return a
}
