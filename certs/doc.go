// Package certs mints, checks and hot-reloads the TLS material konnectivity
// needs, replacing the separate eks-konnectivity-cert tool.
//
// The pieces are:
//
//   - [CA], [NewCA] and [LoadCA]: a signing CA, either throwaway (tests,
//     "konnectivity demo") or loaded from PEM files in the formats common
//     distributions write (PKCS#1 RSA, SEC1 EC as used by k3s, PKCS#8).
//   - [CA.Issue] and [Request]: serving or client certificates with SANs.
//   - [Ensure]: idempotent "make sure this pair exists and is what I asked
//     for" used by "konnectivity cert" and by [Minter] inside the server.
//   - [Reloader] and [CAPoolReloader]: hot reload of a cert/key pair and a CA
//     bundle on the TLS handshake path, so rotated files are picked up by new
//     connections without a restart while existing connections keep working.
//   - [ReloadingServerConfig], [LoadCAPool] and [CipherSuiteIDs]: the TLS
//     configurations the commands build from their flags, so that every
//     listener reloads the same way and refuses the same suites.
//
// File replacement order: [Ensure] writes the new key and certificate whole
// beside the old pair (temporary files, fsynced) and keeps the old key under
// a second name; only then does it rename the key into place, then the
// certificate, and if the certificate's rename fails it renames the old key
// back. A full disk or any failure before the renames leaves the old pair
// as it was. [Reloader] reads the certificate first and the key second, so
// a reader can observe (old cert, old key), (old cert, new key) or (new
// cert, new key), never a new certificate with the old key. The middle state
// lasts between two renames (or for good after a crash there); it is a key
// mismatch, which the Reloader refuses (keeping the previous pair), which
// [NewReloader] waits out while the files are fresh, and which [Ensure]
// repairs by minting again.
package certs
