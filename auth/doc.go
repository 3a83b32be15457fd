// Package auth authenticates konnectivity agents and guards the frontend
// Unix socket.
//
// Agent authentication: an agent presents a projected ServiceAccount token
// as "Authorization: Bearer <jwt>". The server checks it with a TokenReview
// against the kube-apiserver (TokenReviewer.Review), requiring the
// configured audience and exactly the ServiceAccount
// system:serviceaccount:<namespace>:<name>. Failures carry the HTTP status the
// server should answer with (StatusOf): 401 for a missing or invalid token
// or one for another audience (as kube-apiserver answers it), 403 for a
// valid token that belongs to another ServiceAccount, and
// 503 when the TokenReview itself could not be done, so the agent retries.
// Results are cached briefly, keyed by the token's SHA-256, never beyond the
// token's own expiry. Token values never appear in errors.
//
// Talking to the apiserver needs only a small part of a kubeconfig
// (LoadKubeconfig) or the in-cluster ServiceAccount
// (InClusterConfig); this package reads those itself so the binary does not
// depend on client-go.
//
// Frontend socket guard: the Unix socket that kube-apiserver connects to is
// the door into every cluster network the agents can reach. Besides file
// mode and ownership (ApplySocketOwnership), each accepted connection can be
// checked against a UID allow list using the kernel-reported peer
// credentials (PeerCredentials, UIDAllowList.CheckConn), which also covers
// the short window between creating the socket and changing its mode.
package auth
