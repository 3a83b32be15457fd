package e2e

import (
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestFaultTokenReviewUnsure: the TokenReview API answers the agents'
// re-reviews for one second with "201, authenticated=false" and an error in
// status.error (what kube-apiserver answers when a lookup behind the
// review failed). The open tunnels through both agents survive; the next
// reviews pass and the agents take dials again. Then a revoked token
// (two negative reviews in a row) still closes its link.
func TestFaultTokenReviewUnsure(t *testing.T) {
	p := newPKI(t, t.TempDir())
	api := startFakeAPIServer(t, p)
	dir := t.TempDir()
	const recheck = 2 * time.Second
	s := startTokenServer(t, p, api, dir, "--token-recheck-interval=2s", "--token-review-cache-ttl=1ms", "--agent-wait=500ms")
	token := filepath.Join(dir, "token")
	writeFileAtomic(t, token, []byte(goodToken))
	startTokenAgent(t, s, p, "a1", token)
	startTokenAgent(t, s, p, "a2", token)
	s.waitAgents(t, 2, startTimeout)
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	var conns []net.Conn
	for range 20 {
		conns = append(conns, openEcho(t, s, echo))
	}
	checkTunnelsKept(t, conns, "before the failing reviews")

	// The reviews of the next second (each agent's next recheck: they
	// logged in together) answer "unsure".
	api.answerUnsure(time.Second)
	waitFor(t, 3*recheck, "a re-review answered with status.error", func() bool { return api.unsureGiven.Load() > 0 })
	time.Sleep(200 * time.Millisecond)
	doubted := time.Now()
	if el, err := dialErr(t, s.egressDialer(t), echo.addr(), 10*time.Second); err == nil {
		t.Logf("a dial right after the negative reviews was served (%v): an agent's review passed again already", el)
	} else {
		t.Logf("a dial while both agents are doubted: %v after %v", err, el.Round(time.Millisecond))
	}
	checkTunnelsKept(t, conns, "after one negative review per agent")
	waitFor(t, 2*recheck+time.Second, "the agents take dials again", func() bool {
		_, err := dialErr(t, s.egressDialer(t), echo.addr(), 5*time.Second)
		return err == nil
	})
	t.Logf("dials served again %v after the negative reviews", time.Since(doubted).Round(time.Millisecond))
	time.Sleep(recheck) // another review of each, passing
	checkTunnelsKept(t, conns, "after the reviews passed again")
	if out := s.proc.out.String(); strings.Contains(out, "agent token no longer valid") {
		t.Fatalf("a link was closed over one negative review:\n%s", lineWith(out, "agent token no longer valid"))
	}

	// Revoked for good: every review answers no; the links close.
	api.answerUnsure(time.Hour)
	revoked := time.Now()
	s.waitAgents(t, 0, 3*recheck+10*time.Second)
	t.Logf("with every review negative the links closed %v after", time.Since(revoked).Round(time.Millisecond))
}
