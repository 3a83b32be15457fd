package kubeapi

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strings"
)

// Bounds on what one Node object adds: a kubelet reports a handful of
// addresses and at most two pod CIDRs, so what is past these is a broken
// or hostile object and is left out.
const (
	MaxNodeAddrs = 32 // status.addresses kept per Node
	MaxPodCIDRs  = 8  // spec.podCIDRs kept per Node
)

// Node is what konnectivity reads of a core/v1 Node: its name and the
// addresses the apiserver says are its own.
type Node struct {
	Name      string
	Addresses []netip.Addr   // InternalIP and ExternalIP addresses
	Hostnames []string       // Hostname addresses, lower case, no trailing dot
	PodCIDRs  []netip.Prefix // spec.podCIDRs (or spec.podCIDR), masked
}

// DecodeNode reads one Node object and its resourceVersion. Only the
// fields of Node are decoded. Addresses are kept once each, IPv4 in its
// 4-byte form and without a zone, at most MaxNodeAddrs addresses and
// hostnames and MaxPodCIDRs CIDRs; what does not parse is left out. An
// object without a valid metadata.name, or with a namespace, is an error.
func DecodeNode(data []byte) (n *Node, resourceVersion string, err error) {
	var obj struct {
		Metadata struct {
			Name            string `json:"name"`
			Namespace       string `json:"namespace"`
			ResourceVersion string `json:"resourceVersion"`
		} `json:"metadata"`
		Spec struct {
			PodCIDR  string   `json:"podCIDR"`
			PodCIDRs []string `json:"podCIDRs"`
		} `json:"spec"`
		Status struct {
			Addresses []struct {
				Type    string `json:"type"`
				Address string `json:"address"`
			} `json:"addresses"`
		} `json:"status"`
	}
	if err := json.Unmarshal(data, &obj); err != nil {
		return nil, "", fmt.Errorf("decode Node: %w", err)
	}
	if m := obj.Metadata; m.Name == "" || len(m.Name) > 253 || m.Namespace != "" {
		return nil, "", errors.New("decode Node: no valid metadata.name")
	}
	n = &Node{Name: obj.Metadata.Name}
	for _, a := range obj.Status.Addresses {
		if len(n.Addresses)+len(n.Hostnames) >= MaxNodeAddrs {
			break
		}
		switch a.Type {
		case "InternalIP", "ExternalIP":
			if ip, err := netip.ParseAddr(a.Address); err == nil {
				n.Addresses = appendNew(n.Addresses, ip.Unmap().WithZone(""))
			}
		case "Hostname":
			if h := strings.ToLower(strings.TrimSuffix(a.Address, ".")); h != "" && len(h) <= 253 {
				n.Hostnames = appendNew(n.Hostnames, h)
			}
		}
	}
	cidrs := obj.Spec.PodCIDRs
	if len(cidrs) == 0 && obj.Spec.PodCIDR != "" {
		cidrs = []string{obj.Spec.PodCIDR}
	}
	for _, c := range cidrs {
		if len(n.PodCIDRs) >= MaxPodCIDRs {
			break
		}
		if p, err := netip.ParsePrefix(c); err == nil {
			if p.Addr().Is4In6() {
				continue // a CIDR the apiserver would not accept
			}
			n.PodCIDRs = appendNew(n.PodCIDRs, p.Masked())
		}
	}
	return n, obj.Metadata.ResourceVersion, nil
}

func appendNew[T comparable](s []T, v T) []T {
	for _, x := range s {
		if x == v {
			return s
		}
	}
	return append(s, v)
}
