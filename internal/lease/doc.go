// Package lease keeps a konnectivity server's coordination.k8s.io/v1 Lease
// and lets agents count the live ones, so that agents learn how many server
// replicas exist without every agent's flags being re-rendered when the
// control plane scales.
//
// A server runs a Controller: it creates its Lease
// ("konnectivity-proxy-server-<server ID>", upstream's name, labels and
// timing), renews it on an interval, deletes expired Leases that carry the
// same labels (a server that died cannot delete its own) and deletes its own
// Lease when it stops. An agent runs a Counter: it lists the Leases that match
// a label selector, watches them, and reports how many are still valid
// (renewTime + leaseDurationSeconds in the future) whenever that number
// changes, including when a Lease simply runs out.
//
// The package speaks the Lease API itself (Client: get, create, update,
// delete, list, watch of Leases in one namespace, JSON only) through
// internal/kubeclient. Every answer is bounded in size; API errors keep
// the status code and reason the apiserver sent, which the lease metrics
// are labelled with.
//
// Nothing here is on the data path: a Lease that cannot be written or read
// is logged once per change of state and retried; tunnels are unaffected.
package lease
