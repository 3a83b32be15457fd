// Package nodemap knows which node owns an address, as the apiserver says:
// a Node's own addresses (InternalIP, ExternalIP, Hostname), the pod
// addresses EndpointSlices (and, on request, Pods) place on it, and its
// spec.podCIDRs. A server routes a dial by it to the agent bound to that
// node; an agent limits its destinations by it to its own node.
//
// A Watcher lists and watches those objects with the credential it is
// given (JSON over the Kubernetes REST API, through internal/kubeclient;
// a Node read as kubeapi.DecodeNode reads it) and keeps a Table. Every
// answer is bounded: an object, a list item or a watch event over 2 MiB
// ends the call, a list is read page by page and item by item, and the
// table caps nodes, pod addresses and what one object may add. A watch
// that cannot continue (410 Gone) lists again; any other failure is
// retried with back-off and logged once per state (unreachable,
// forbidden, ...), never a crash; the table keeps what it last knew.
//
// A lookup tries, in order: a Node address, a pod address, the longest pod
// CIDR that holds the address (IPv4 and IPv6 alike). An address two nodes
// claim at the same rank routes nowhere: the answer must be the API's,
// never a guess. Lookups take a read lock that a change holds only for one
// object's map updates.
package nodemap
