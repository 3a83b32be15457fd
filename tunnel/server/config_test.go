package server

import (
	"strings"
	"testing"
)

// TestNewNeedsAgentTLS: agents connect over TLS only; a Config without
// AgentTLS is refused, naming the field.
func TestNewNeedsAgentTLS(t *testing.T) {
	_, err := New(Config{ID: "s1"})
	if err == nil || !strings.Contains(err.Error(), "server.Config.AgentTLS") {
		t.Fatalf("New without AgentTLS: %v, want a refusal naming server.Config.AgentTLS", err)
	}
}
