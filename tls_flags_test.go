package main

import (
	"crypto/tls"
	"strings"
	"testing"
)

// --cipher-suites takes Go's names and refuses, at start and naming the
// suite, an insecure or unknown one; both commands read it the same way.
func TestCipherSuitesFlag(t *testing.T) {
	for _, cmd := range []string{"server", "agent"} {
		args := func(extra ...string) []string {
			if cmd == "server" {
				return serverArgs(extra...)
			}
			return extra
		}
		for _, tc := range []struct {
			value, want string
		}{
			{"TLS_RSA_WITH_RC4_128_SHA", "--cipher-suites: TLS_RSA_WITH_RC4_128_SHA is insecure"},
			{"TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,TLS_NO_SUCH_SUITE", "--cipher-suites: TLS_NO_SUCH_SUITE is not a cipher suite"},
		} {
			out, code := parseLogs(t, cmd, args("--cipher-suites="+tc.value))
			if code != 2 || !strings.Contains(out, tc.want) {
				t.Errorf("%s --cipher-suites=%s: exit %d, output %q; want 2 and %q", cmd, tc.value, code, out, tc.want)
			}
		}
		out, code := parseLogs(t, cmd, args("--cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256"))
		if code != 0 || len(warnLines(out)) != 0 {
			t.Errorf("%s: a TLS 1.2 and a TLS 1.3 name: exit %d, output %q; want 0 and no warning", cmd, code, out)
		}
	}
}

// The agent's TLS offers --alpn-proto, then its own protocol (http/1.1),
// and only the --cipher-suites.
func TestAgentTLSConfigFromFlags(t *testing.T) {
	o, cf := newAgentFlags()
	if _, err := cf.parse([]string{"--alpn-proto=x-one, x-two,x-three", "--cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256", "--agent-id=a"}, &strings.Builder{}); err != nil {
		t.Fatal(err)
	}
	if err := o.complete(cf); err != nil {
		t.Fatal(err)
	}
	cfg, err := o.tlsConfig("server.example")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(cfg.NextProtos, ","); got != "x-one,x-two,x-three,http/1.1" {
		t.Errorf("NextProtos %q, want x-one,x-two,x-three,http/1.1", got)
	}
	if len(cfg.CipherSuites) != 1 || cfg.CipherSuites[0] != tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 {
		t.Errorf("CipherSuites %v, want only TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256", cfg.CipherSuites)
	}
}
