package e2e

import (
	"net/http"
	"strings"
	"testing"
)

// TestLoginRefusalsLogged: two logins from one address refused for two
// reasons within the log interval (a token the apiserver does not
// authenticate, a token for another audience) are both answered 401, as
// kube-apiserver answers either, and both logged at WARN: the limit on
// refusal lines is per source and reason, so the second reason is seen.
func TestLoginRefusalsLogged(t *testing.T) {
	p := newPKI(t, t.TempDir())
	api := startFakeAPIServer(t, p)
	s := startTokenServer(t, p, api, t.TempDir())
	addr, conf := agentPortTLS(t, p, s)

	for _, c := range []struct{ id, token string }{{"a-bad", "bad-token"}, {"a-audience", otherAudienceToken}} {
		code, err := rawTokenLogin(addr, conf, c.id, c.token)
		if err != nil {
			t.Fatalf("login %s: %v", c.id, err)
		}
		if code != http.StatusUnauthorized {
			t.Errorf("login %s with %q answered %d, want 401", c.id, c.token, code)
		}
	}
	waitFor(t, startTimeout, "both refusals logged", func() bool {
		out := s.proc.out.String()
		return strings.Contains(out, "agent=a-bad") && strings.Contains(out, "agent=a-audience")
	})
	out := s.proc.out.String()
	for _, id := range []string{"a-bad", "a-audience"} {
		line := lineWith(out, "agent="+id)
		t.Logf("%s", line)
		if !strings.Contains(line, "level=WARN") || !strings.Contains(line, "agent refused") {
			t.Errorf("refusal of %s not logged as a WARN 'agent refused' line: %s", id, line)
		}
	}
}
