package kubeclient

import (
	"strings"
	"testing"
)

// insecure-skip-tls-verify reads as yaml.v3 decodes a bool: YAML's booleans
// when plain, and YAML 1.1's yes/no/on/off also when quoted.
func TestKubeconfigBooleans(t *testing.T) {
	for in, want := range map[string]any{
		"true": true, "True": true, "FALSE": false, "yes": true, "'on'": true, `"No"`: false,
		"~": false, "": false, "'true'": "error", "!!str true": "error", "1": "error", "maybe": "error",
	} {
		y := "current-context: c\ncontexts: [{name: c, context: {cluster: k}}]\nclusters:\n- name: k\n  cluster:\n    server: https://x\n    insecure-skip-tls-verify: " + in + "\n"
		cfg, err := ParseKubeconfig([]byte(y), "", "")
		switch {
		case want == "error":
			if err == nil || !strings.Contains(err.Error(), "insecure-skip-tls-verify: line 7: expected true or false") {
				t.Errorf("%q: got %v, want an error", in, err)
			}
		case err != nil:
			t.Errorf("%q: %v", in, err)
		case cfg.insecure != want:
			t.Errorf("%q: got %t, want %v", in, cfg.insecure, want)
		}
	}
}
