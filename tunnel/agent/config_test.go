package agent

import (
	"strings"
	"testing"
)

// TestNewNeedsTLS: an agent reaches its servers over TLS only; a Config
// without TLS is refused, naming the field.
func TestNewNeedsTLS(t *testing.T) {
	_, err := New(Config{ServerAddrs: []string{"127.0.0.1:1"}, ID: "a1"})
	if err == nil || !strings.Contains(err.Error(), "agent.Config.TLS") {
		t.Fatalf("New without TLS: %v, want a refusal naming agent.Config.TLS", err)
	}
}
