package auth

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"sync"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeapi"
	"github.com/spinifex/konnectivity/internal/kubeclient"
)

const (
	maxNodeBody      = 1 << 20
	maxNodeEntries   = 4096
	defaultNodeTTL   = time.Minute
	nodeLookupPrefix = "/api/v1/nodes/"
)

// ErrNodesForbidden is wrapped by the error of a lookup the apiserver
// answered 403: the server's identity may not get nodes (upstream's RBAC,
// system:auth-delegator, does not grant it).
var ErrNodesForbidden = errors.New("the apiserver forbids this server to get nodes")

// NodeLookup reads a Node's addresses (status.addresses) from the
// kube-apiserver, so that an agent's ipv4=/ipv6= identifiers can be checked
// against the node its token was issued for. The server's identity needs
// "get" on nodes. It is safe for concurrent use.
type NodeLookup struct {
	client  *kubeclient.Client
	timeout time.Duration
	ttl     time.Duration
	now     func() time.Time

	mu    sync.Mutex
	cache map[string]nodeEntry // by node name; at most maxNodeEntries; guarded by mu
}

type nodeEntry struct {
	addrs   []netip.Addr
	denied  bool // the apiserver answered 403: ErrNodesForbidden until expires
	expires time.Time
}

// NewNodeLookup returns a lookup through the apiserver described by cfg.
// Answers are reused for ttl (default one minute); timeout bounds one call
// (default 5s).
func NewNodeLookup(cfg *kubeclient.Config, timeout, ttl time.Duration) (*NodeLookup, error) {
	if cfg == nil {
		return nil, errors.New("node lookup: no apiserver config")
	}
	if timeout <= 0 {
		timeout = defaultReviewTimeout
	}
	if ttl <= 0 {
		ttl = defaultNodeTTL
	}
	return &NodeLookup{client: kubeclient.New(cfg), timeout: timeout, ttl: ttl, now: time.Now, cache: map[string]nodeEntry{}}, nil
}

// Addresses returns the node's addresses (every one the kubelet reports
// that is an IP: InternalIP, ExternalIP, and a Hostname that is an IP,
// as kubeapi.DecodeNode reads them). A node that does not exist
// is a 403 Error; a failed lookup a 503 Error, which wraps
// ErrNodesForbidden when the apiserver answered 403 (remembered for the
// TTL, as answers are, so agents logging in meanwhile cost no call).
func (n *NodeLookup) Addresses(ctx context.Context, node string) ([]netip.Addr, error) {
	if node == "" || len(node) > maxClaimLen {
		return nil, forbidden("no node to look up")
	}
	n.mu.Lock()
	if e, ok := n.cache[node]; ok && n.now().Before(e.expires) {
		n.mu.Unlock()
		if e.denied {
			return nil, unavailable("node lookup: apiserver answered 403 Forbidden (cached)", ErrNodesForbidden)
		}
		return e.addrs, nil
	}
	n.mu.Unlock()

	ctx, cancel := context.WithTimeout(ctx, n.timeout)
	defer cancel()
	addrs, err := n.get(ctx, node)
	denied := errors.Is(err, ErrNodesForbidden)
	if err != nil && !denied {
		return nil, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	now := n.now()
	if len(n.cache) >= maxNodeEntries {
		for k, e := range n.cache {
			if !now.Before(e.expires) {
				delete(n.cache, k)
			}
		}
		if len(n.cache) >= maxNodeEntries {
			clear(n.cache) // a cluster this large pays one lookup per node again
		}
	}
	n.cache[node] = nodeEntry{addrs: addrs, denied: denied, expires: now.Add(n.ttl)}
	return addrs, err
}

func (n *NodeLookup) get(ctx context.Context, node string) ([]netip.Addr, error) {
	data, err := n.client.Call(ctx, http.MethodGet, nodeLookupPrefix+url.PathEscape(node), nil, maxNodeBody)
	if e, ok := errors.AsType[*kubeapi.Error](err); ok {
		reason := "node lookup: apiserver answered " + statusLine(e.Code)
		switch e.Code {
		case http.StatusNotFound:
			return nil, forbidden("node %q does not exist", node)
		case http.StatusForbidden:
			// The server may not read nodes: our RBAC, not the agent's claim.
			return nil, unavailable(reason, fmt.Errorf("%w: %s", ErrNodesForbidden, oneLine(string(e.Body))))
		}
		return nil, unavailable(reason, errors.New(oneLine(string(e.Body))))
	}
	if err != nil {
		return nil, unavailable("node lookup request failed", err)
	}
	obj, _, err := kubeapi.DecodeNode(data)
	if err != nil {
		return nil, unavailable("node lookup: undecodable response", err)
	}
	// A Hostname address that is an IP is one of the node's addresses too.
	addrs := obj.Addresses
	for _, h := range obj.Hostnames {
		if ip, err := netip.ParseAddr(h); err == nil && !slices.Contains(addrs, ip.Unmap().WithZone("")) {
			addrs = append(addrs, ip.Unmap().WithZone(""))
		}
	}
	return addrs, nil
}
