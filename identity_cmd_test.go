package main

import (
	"bytes"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/auth"
	"github.com/spinifex/konnectivity/tunnel/server"
)

func TestRouteAgentsFlag(t *testing.T) {
	base := []string{"--mode=http-connect", "--uds-name=/x", "--server-port=0", "--cluster-cert=c", "--cluster-key=k"}
	for _, bad := range []string{"serviceaccount:kube-system", "serviceaccount:/name", "node a", "a/b"} {
		var errb bytes.Buffer
		code := runServer(append(base, "--route-agents="+bad), io.Discard, &errb)
		if code != 2 || !strings.Contains(errb.String(), "--route-agents") {
			t.Errorf("--route-agents=%q: exit %d, stderr %q; want 2 naming the flag", bad, code, errb.String())
		}
	}
	for _, good := range []string{"*", "node-a", "serviceaccount:kube-system/konnectivity-agent", "node-a, node-b"} {
		for _, v := range splitList(good) {
			if !validRouteAgent(v) {
				t.Errorf("%q refused", v)
			}
		}
	}
}

func TestTokenPrincipal(t *testing.T) {
	exp := time.Unix(1900000000, 0)
	bound := tokenPrincipal(auth.Identity{Username: "system:serviceaccount:kube-system:konnectivity-agent", Node: "node-a", Pod: "p1", PodUID: "uid-1", Expires: exp}, "kube-system/konnectivity-agent")
	want := server.Principal{Kind: server.PrincipalToken, Credential: "pod:uid-1", Node: "node-a", Pod: "p1", Account: "kube-system/konnectivity-agent", Expires: exp}
	if bound.Kind != want.Kind || bound.Credential != want.Credential || bound.Node != want.Node || bound.Pod != want.Pod || bound.Account != want.Account || !bound.Expires.Equal(exp) {
		t.Errorf("bound token: %+v, want %+v", bound, want)
	}
	unbound := tokenPrincipal(auth.Identity{Username: "system:serviceaccount:kube-system:konnectivity-agent"}, "kube-system/konnectivity-agent")
	if unbound.Node != "" || unbound.Credential != "sa:system:serviceaccount:kube-system:konnectivity-agent" {
		t.Errorf("unbound token: %+v", unbound)
	}
}
