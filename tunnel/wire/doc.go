// Package wire is what a konnectivity server and agent both speak: the
// HTTP/1.1 Upgrade that opens an agent connection and the control line on
// it, a CONNECT head and the answers to it (StatusError), identifiers,
// upstream's Packet counts and stream error codes, and the socket, buffer
// and log-limiting helpers both ends' byte paths share.
//
// It is the derp of Tailscale's derp and derp/derpserver: the vocabulary
// both ends import, so tunnel/server and tunnel/agent need not import each
// other. The tunnel's words, files, locks and rules are written once, in
// the doc of package tunnel (tunnel/doc.go).
package wire
