package e2e

import (
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestFaultTokenReviewUnsure: the TokenReview API answers every review for
// 6 s with "201, authenticated=false" and an error in status.error (what
// kube-apiserver answers when a lookup behind the review failed), six
// recheck intervals at --token-recheck-interval=1s. The open tunnels
// through both agents survive, new dials pause meanwhile, and once the
// reviews pass the agents take dials again. A plain refusal (no
// status.error) still closes the links at the next review; and with
// --token-doubt-grace=4s, unsure answers that go on close them once they
// have lasted 4 s.
func TestFaultTokenReviewUnsure(t *testing.T) {
	const recheck, outage = time.Second, 6 * time.Second
	p := newPKI(t, t.TempDir())
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	tokenServer := func(api *fakeAPIServer, extra ...string) *server {
		dir := t.TempDir()
		s := startTokenServer(t, p, api, dir, append([]string{"--token-recheck-interval=1s", "--token-review-cache-ttl=1ms", "--agent-wait=500ms"}, extra...)...)
		token := filepath.Join(dir, "token")
		writeFileAtomic(t, token, []byte(goodToken))
		startTokenAgent(t, s, p, "a1", token)
		startTokenAgent(t, s, p, "a2", token)
		s.waitAgents(t, 2, startTimeout)
		return s
	}

	api := startFakeAPIServer(t, p)
	s := tokenServer(api)
	var conns []net.Conn
	for range 20 {
		conns = append(conns, openEcho(t, s, echo))
	}
	api.answerUnsure(outage)
	waitFor(t, 3*recheck, "a re-review answered with status.error", func() bool { return api.unsureGiven.Load() > 0 })
	began := time.Now()
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
	waitFor(t, 2*recheck+time.Second, "both agents doubted", func() bool {
		fams, _, err := scrapeRaw(metricsURL)
		return err == nil && fams.value("konnectivity_network_proxy_server_agent_identity_refusals_total", "reason", "token_doubted") >= 2
	})
	el, err := dialErr(t, s.egressDialer(t), echo.addr(), 10*time.Second)
	t.Logf("a dial while both agents are doubted: %v after %v", err, el.Round(time.Millisecond))
	if err == nil {
		t.Error("a dial was served by an agent whose token's reviews are refused")
	}
	waitFor(t, outage+3*recheck, "the agents take dials again", func() bool {
		_, err := dialErr(t, s.egressDialer(t), echo.addr(), 5*time.Second)
		return err == nil
	})
	t.Logf("%d unsure answers; dials served again %v after the first", api.unsureGiven.Load(), time.Since(began).Round(time.Millisecond))
	checkTunnelsKept(t, conns, "after 6 s of unsure answers")
	if out := s.proc.out.String(); strings.Contains(out, "agent token no longer valid") {
		t.Fatalf("a link was closed over unsure answers:\n%s", lineWith(out, "agent token no longer valid"))
	}

	// A plain refusal acts at the next review.
	for _, c := range conns {
		c.Close()
	}
	api.refused.Store(true)
	revoked := time.Now()
	s.waitAgents(t, 0, recheck+10*time.Second)
	t.Logf("with a plain refusal both links closed %v after it", time.Since(revoked).Round(time.Millisecond))

	// Unsure answers that go on close the links at the doubt grace.
	const grace = 4 * time.Second
	api = startFakeAPIServer(t, p)
	s = tokenServer(api, "--token-doubt-grace=4s")
	api.answerUnsure(time.Hour)
	waitFor(t, 3*recheck, "a re-review answered with status.error", func() bool { return api.unsureGiven.Load() > 0 })
	first := time.Unix(0, api.unsureFrom.Load())
	s.waitAgents(t, 0, grace+3*recheck+10*time.Second)
	took := time.Since(first)
	t.Logf("with every answer unsure both links closed %v after the first (grace %v); %s", took.Round(time.Millisecond), grace, lineWith(s.proc.out.String(), "agent token no longer valid"))
	if took < grace {
		t.Errorf("the links closed %v after the first unsure answer, before the %v grace", took, grace)
	}
}
