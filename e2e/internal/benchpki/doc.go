// Package benchpki mints the throwaway CA, server certificate and agent
// client certificate that the benchmark programs (bench, scale), the soak
// program and the e2e tests run with. Only the e2e module's programs and
// tests import it.
package benchpki
