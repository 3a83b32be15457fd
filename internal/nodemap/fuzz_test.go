package nodemap

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"testing"

	"github.com/spinifex/konnectivity/internal/kubeapi"
)

// FuzzDecode feeds arbitrary bytes to the list and watch decoders of every
// kind and applies what they accept to a table. Nothing may panic, every
// object must respect the per-object bounds, and removing every object
// again must leave the table empty (no entry outlives its object).
func FuzzDecode(f *testing.F) {
	for _, seed := range []string{
		`{"kind":"NodeList","metadata":{"resourceVersion":"7","continue":"x"},"items":[{"metadata":{"name":"a"},"spec":{"podCIDRs":["10.244.0.0/24","fd10::/64"]},"status":{"addresses":[{"type":"InternalIP","address":"192.168.0.1"},{"type":"Hostname","address":"Node-A."}]}}]}`,
		`{"items":[{"metadata":{"name":"s","namespace":"n"},"addressType":"IPv4","endpoints":[{"addresses":["10.0.0.1"],"nodeName":"a"},{"addresses":["10.0.0.1"],"nodeName":"b"}]}],"metadata":{}}`,
		`{"items":[{"metadata":{"name":"p","namespace":"n"},"spec":{"nodeName":"a"},"status":{"phase":"Running","podIPs":[{"ip":"::ffff:10.1.1.1"},{"ip":"fe80::1%eth0"}]}}]}`,
		`{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"9"},"spec":{"podCIDR":"10.0.0.0/8"}}}` + "\n" + `{"type":"DELETED","object":{"metadata":{"name":"a"}}}`,
		`{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"12"}}}`,
		`{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired"}}`,
		`{"items":[{"metadata":{"name":""}}]}`,
		`{"items":[1,2,3]}`,
		`[]`,
		``,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		for _, k := range []kindID{kindNodes, kindSlices, kindPods} {
			tb := NewTable()
			var keys []string
			apply := func(r record) {
				keys = append(keys, r.key)
				if k == kindNodes {
					n := r.node
					if len(n.Addresses)+len(n.Hostnames) > kubeapi.MaxNodeAddrs || len(n.PodCIDRs) > kubeapi.MaxPodCIDRs {
						t.Fatalf("node over bounds: %+v", n)
					}
					tb.setNode(n)
					tb.Lookup(n.Name)
					return
				}
				if len(r.claims) > maxClaimsPerItem {
					t.Fatalf("%d claims in one object", len(r.claims))
				}
				tb.setClaims(k.source(), r.key, r.claims)
				for _, c := range r.claims {
					tb.LookupAddr(c.addr)
				}
			}
			_, _ = decodeList(bytes.NewReader(in), func(item []byte) error {
				r, err := k.decode(item)
				if err == nil {
					apply(r)
				}
				return err
			})
			br := kubeapi.NewBoundedReader(bytes.NewReader(in), maxObjectSize)
			dec := json.NewDecoder(br)
			for range 100 {
				ev, err := nextEvent(dec, br, k)
				var ae *kubeapi.Error
				if errors.Is(err, io.EOF) || errors.As(err, &ae) || err != nil {
					break
				}
				if ev.typ != "BOOKMARK" {
					apply(ev.rec)
				}
			}
			for _, key := range keys {
				if k == kindNodes {
					tb.deleteNode(key)
				} else {
					tb.dropClaims(k.source(), key)
				}
			}
			if len(tb.nodes)+len(tb.addrs)+len(tb.hosts)+len(tb.cidrs)+len(tb.pods)+len(tb.claims[0])+len(tb.claims[1]) != 0 {
				t.Fatalf("table not empty after every object went: %d nodes, %d addrs, %d hosts, %d cidrs, %d pods",
					len(tb.nodes), len(tb.addrs), len(tb.hosts), len(tb.cidrs), len(tb.pods))
			}
			if len(tb.lens[0])+len(tb.lens[1]) != 0 {
				t.Fatalf("prefix lengths left: %v", tb.lens)
			}
		}
	})
}
