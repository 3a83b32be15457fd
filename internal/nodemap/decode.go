package nodemap

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"

	"github.com/spinifex/konnectivity/internal/kubeapi"
)

// Bounds on what the apiserver may send. etcd refuses objects over 1.5 MiB,
// so one object, one watch event or one list item over maxObjectSize is a
// broken or hostile answer, never a real one.
const (
	maxObjectSize = 2 << 20
	maxListItems  = 1000 // per page: the client asks for pages of listPage
	listPage      = 500
)

// kindID names a kind of object the Watcher follows.
type kindID uint8

const (
	kindNodes kindID = iota
	kindSlices
	kindPods
)

func (k kindID) String() string {
	switch k {
	case kindNodes:
		return "nodes"
	case kindSlices:
		return "endpointslices"
	}
	return "pods"
}

// path is the collection's URL path on the apiserver.
func (k kindID) path() string {
	switch k {
	case kindNodes:
		return "/api/v1/nodes"
	case kindSlices:
		return "/apis/discovery.k8s.io/v1/endpointslices"
	}
	return "/api/v1/pods"
}

func (k kindID) source() source {
	if k == kindPods {
		return fromPods
	}
	return fromSlices
}

// record is one decoded object: a Node, or the pod addresses an
// EndpointSlice or a Pod places on nodes.
type record struct {
	key    string // name (Nodes) or namespace/name
	rv     string
	node   *kubeapi.Node // kindNodes
	claims []claim       // kindSlices, kindPods
}

type metaJSON struct {
	Name            string `json:"name"`
	Namespace       string `json:"namespace"`
	ResourceVersion string `json:"resourceVersion"`
}

func (m *metaJSON) key() (string, error) {
	if m.Name == "" || len(m.Name) > 253 || len(m.Namespace) > 63 {
		return "", errors.New("object without a valid metadata.name")
	}
	if m.Namespace == "" {
		return m.Name, nil
	}
	return m.Namespace + "/" + m.Name, nil
}

// decode turns one object of kind k into a record. Only the fields the
// table needs are decoded; everything else is skipped.
func (k kindID) decode(data []byte) (record, error) {
	switch k {
	case kindNodes:
		return decodeNode(data)
	case kindSlices:
		return decodeSlice(data)
	}
	return decodePod(data)
}

func decodeNode(data []byte) (record, error) {
	n, rv, err := kubeapi.DecodeNode(data)
	if err != nil {
		return record{}, err
	}
	return record{key: n.Name, rv: rv, node: n}, nil
}

func decodeSlice(data []byte) (record, error) {
	var s struct {
		Metadata    metaJSON `json:"metadata"`
		AddressType string   `json:"addressType"`
		Endpoints   []struct {
			Addresses []string `json:"addresses"`
			NodeName  string   `json:"nodeName"`
		} `json:"endpoints"`
	}
	if err := json.Unmarshal(data, &s); err != nil {
		return record{}, fmt.Errorf("decode EndpointSlice: %w", err)
	}
	key, err := s.Metadata.key()
	if err != nil {
		return record{}, fmt.Errorf("decode EndpointSlice: %w", err)
	}
	r := record{key: key, rv: s.Metadata.ResourceVersion}
	if s.AddressType != "IPv4" && s.AddressType != "IPv6" {
		return r, nil // FQDN endpoints name no pod address
	}
	for _, ep := range s.Endpoints {
		if ep.NodeName == "" {
			continue
		}
		for _, a := range ep.Addresses {
			if len(r.claims) >= maxClaimsPerItem {
				return r, nil
			}
			if ip, err := netip.ParseAddr(a); err == nil {
				r.claims = append(r.claims, claim{addr: ip.Unmap().WithZone(""), node: ep.NodeName})
			}
		}
	}
	return r, nil
}

func decodePod(data []byte) (record, error) {
	var p struct {
		Metadata metaJSON `json:"metadata"`
		Spec     struct {
			NodeName    string `json:"nodeName"`
			HostNetwork bool   `json:"hostNetwork"`
		} `json:"spec"`
		Status struct {
			Phase  string `json:"phase"`
			PodIP  string `json:"podIP"`
			PodIPs []struct {
				IP string `json:"ip"`
			} `json:"podIPs"`
		} `json:"status"`
	}
	if err := json.Unmarshal(data, &p); err != nil {
		return record{}, fmt.Errorf("decode Pod: %w", err)
	}
	key, err := p.Metadata.key()
	if err != nil {
		return record{}, fmt.Errorf("decode Pod: %w", err)
	}
	r := record{key: key, rv: p.Metadata.ResourceVersion}
	// A finished pod's address may already be another pod's; a host-network
	// pod's address is its node's, which the Node already gives.
	if p.Spec.NodeName == "" || p.Spec.HostNetwork || p.Status.Phase == "Succeeded" || p.Status.Phase == "Failed" {
		return r, nil
	}
	ips := make([]string, 0, 2)
	for _, ip := range p.Status.PodIPs {
		ips = append(ips, ip.IP)
	}
	if len(ips) == 0 && p.Status.PodIP != "" {
		ips = append(ips, p.Status.PodIP)
	}
	for _, s := range ips {
		if len(r.claims) >= maxPodIPs {
			break
		}
		if ip, err := netip.ParseAddr(s); err == nil {
			r.claims = append(r.claims, claim{addr: ip.Unmap().WithZone(""), node: p.Spec.NodeName})
		}
	}
	return r, nil
}

// listHead is the part of a list answer the Watcher needs besides its items.
type listHead struct {
	ResourceVersion string `json:"resourceVersion"`
	Continue        string `json:"continue"`
}

// decodeList reads a list answer from body, handing each item to each as
// soon as it is read, so a list is never held whole. Each item is read
// with a budget of maxObjectSize bytes (beyond what the decoder had read
// ahead), and a page may hold at most maxListItems items.
func decodeList(body io.Reader, each func(item []byte) error) (listHead, error) {
	br := kubeapi.NewBoundedReader(body, maxObjectSize)
	dec := json.NewDecoder(br)
	var head listHead
	if err := expectDelim(dec, '{'); err != nil {
		return head, err
	}
	items := 0
	for dec.More() {
		br.Renew()
		tok, err := dec.Token()
		if err != nil {
			return head, err
		}
		field, _ := tok.(string)
		switch field {
		case "metadata":
			if err := dec.Decode(&head); err != nil {
				return head, fmt.Errorf("list metadata: %w", err)
			}
		case "items":
			if err := expectDelim(dec, '['); err != nil {
				return head, err
			}
			for dec.More() {
				if items++; items > maxListItems {
					return head, fmt.Errorf("list page with more than %d items", maxListItems)
				}
				br.Renew()
				var item json.RawMessage
				if err := dec.Decode(&item); err != nil {
					return head, fmt.Errorf("list item: %w", err)
				}
				if err := each(item); err != nil {
					return head, err
				}
			}
			if err := expectDelim(dec, ']'); err != nil {
				return head, err
			}
		default:
			var skip json.RawMessage
			if err := dec.Decode(&skip); err != nil {
				return head, fmt.Errorf("list field %q: %w", truncate(field, 32), err)
			}
		}
	}
	return head, expectDelim(dec, '}')
}

func expectDelim(dec *json.Decoder, want json.Delim) error {
	tok, err := dec.Token()
	if err != nil {
		return fmt.Errorf("list: %w", err)
	}
	if d, ok := tok.(json.Delim); !ok || d != want {
		return fmt.Errorf("list: want %q, got %v", want, tok)
	}
	return nil
}

// watchEvent is one decoded watch event.
type watchEvent struct {
	typ string // ADDED, MODIFIED, DELETED or BOOKMARK
	rec record // for a BOOKMARK only rv is set
}

// nextEvent reads one watch event of kind k from dec. An ERROR event is
// returned as its *kubeapi.Error.
func nextEvent(dec *json.Decoder, br *kubeapi.BoundedReader, k kindID) (watchEvent, error) {
	br.Renew()
	var ev struct {
		Type   string          `json:"type"`
		Object json.RawMessage `json:"object"`
	}
	if err := dec.Decode(&ev); err != nil {
		return watchEvent{}, err
	}
	switch ev.Type {
	case "ADDED", "MODIFIED", "DELETED":
		r, err := k.decode(ev.Object)
		return watchEvent{typ: ev.Type, rec: r}, err
	case "BOOKMARK":
		var b struct {
			Metadata metaJSON `json:"metadata"`
		}
		if err := json.Unmarshal(ev.Object, &b); err != nil {
			return watchEvent{}, fmt.Errorf("bookmark: %w", err)
		}
		return watchEvent{typ: ev.Type, rec: record{rv: b.Metadata.ResourceVersion}}, nil
	case "ERROR":
		return watchEvent{}, kubeapi.EventError(ev.Object)
	}
	return watchEvent{}, fmt.Errorf("unknown watch event type %q", truncate(ev.Type, 32))
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}
