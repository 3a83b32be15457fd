// Package proxydial reaches a TCP address the way the environment says:
// directly, or through an HTTP proxy with CONNECT. It reads HTTPS_PROXY,
// https_proxy, NO_PROXY and no_proxy as golang.org/x/net/http/httpproxy
// does (through net/http, and so as gRPC's clients do): NO_PROXY holds
// hosts, domains and CIDRs, and loopback addresses and "localhost" are
// never proxied.
//
// Rules:
//   - A proxy is http:// (the CONNECT request goes in the clear; what it
//     carries is the TLS to the target). Proxy refuses any other scheme
//     (https://, socks5://), so a caller that asks it at start refuses an
//     unusable environment there.
//   - Credentials in the proxy URL travel as Proxy-Authorization Basic and
//     never appear in an error or a log line: proxies are named by Name.
//   - The CONNECT exchange runs under the caller's context: its deadline
//     bounds the dial, the request and the reply, and the reply head is
//     bounded in bytes, so a slow or hostile proxy can neither hang the
//     caller nor grow its memory.
//   - A reply other than 2xx is an error naming the proxy and the status.
package proxydial
