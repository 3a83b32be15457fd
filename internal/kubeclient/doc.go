// Package kubeclient is konnectivity's client of the Kubernetes API
// server: where the apiserver is and how to reach it, and how one call to
// it is made. It is the only code that opens connections to the apiserver;
// auth (TokenReview, Node lookups), internal/lease and internal/nodemap
// call through it, so the binary does not depend on client-go.
//
// Where and how (Config): the context of a kubeconfig (LoadKubeconfig), of
// which only what a client of one apiserver needs is read (server, CA or
// insecure-skip-tls-verify, tls-server-name, proxy-url, client
// certificate, token, tokenFile), or the pod's ServiceAccount
// (InClusterConfig). A tokenFile is read again for every request, as the
// kubelet rotates projected tokens. What cannot be honoured (exec plugins,
// auth providers, basic auth, impersonation) is refused rather than
// calling the apiserver as somebody else, and no error or formatted Config
// ever shows a token or key.
//
// One call (Client): the request carries JSON and the konnectivity
// User-Agent; an answer other than a 2xx becomes a *kubeapi.Error (its
// Status code, reason and message), read up to kubeapi.MaxErrorBody; an
// answer read whole (Call) is bounded by the caller's limit, and one read
// as a stream (Do: lists, watches) is bounded per object by the caller
// with a kubeapi.BoundedReader. Timeouts, retries and what an error means
// belong to the callers.
//
// Rules: every file this package reads is a regular file read up to a
// bound (kubeconfig 4 MiB, a credential 1 MiB); the package owns no
// goroutine and keeps no package-level mutable state.
package kubeclient
