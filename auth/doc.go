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
// Node binding: a token bound to a pod names its node, and NodeLookup
// reads that Node's addresses, so that an agent's ipv4=/ipv6= identifiers
// can be checked against the node its token was issued for. Both calls go
// to the apiserver through internal/kubeclient, with the Config the
// server was given.
//
// Frontend socket guard: the Unix socket that kube-apiserver connects to is
// the door into every cluster network the agents can reach. Besides file
// mode and ownership (ApplySocketOwnership), each accepted connection can be
// checked against a UID allow list using the kernel-reported peer
// credentials (PeerCredentials, UIDAllowList.CheckConn), which also covers
// the short window between creating the socket and changing its mode.
package auth
