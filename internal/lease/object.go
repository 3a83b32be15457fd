package lease

import (
	"encoding/json"
	"fmt"
	"time"
)

// microTime is the wire form of metav1.MicroTime: RFC 3339, UTC, six
// fractional digits.
const microTime = "2006-01-02T15:04:05.000000Z07:00"

// Lease is the part of a coordination.k8s.io/v1 Lease this package reads.
// raw keeps the object as the apiserver sent it, so an update sends back
// every field this type does not know (annotations, owner references, ...).
type Lease struct {
	Name            string
	Namespace       string
	ResourceVersion string
	Labels          map[string]string
	Holder          string
	Duration        time.Duration // spec.leaseDurationSeconds; 0 when absent
	AcquireTime     time.Time     // zero when absent
	RenewTime       time.Time     // zero when absent

	raw []byte
}

// Expiry is when the Lease stops being valid: its last renewal (or, never
// renewed, its acquisition) plus its duration. ok is false when the Lease has
// neither time or no duration: such a Lease counts as expired, as upstream
// treats it.
func (l *Lease) Expiry() (t time.Time, ok bool) {
	base := l.RenewTime
	if base.IsZero() {
		base = l.AcquireTime
	}
	if base.IsZero() || l.Duration <= 0 {
		return time.Time{}, false
	}
	return base.Add(l.Duration), true
}

// Valid reports whether the Lease is still held at now (expiry strictly
// after now, as upstream compares).
func (l *Lease) Valid(now time.Time) bool {
	exp, ok := l.Expiry()
	return ok && exp.After(now)
}

type leaseJSON struct {
	Metadata struct {
		Name            string            `json:"name"`
		Namespace       string            `json:"namespace"`
		ResourceVersion string            `json:"resourceVersion"`
		Labels          map[string]string `json:"labels"`
	} `json:"metadata"`
	Spec struct {
		HolderIdentity       *string `json:"holderIdentity"`
		LeaseDurationSeconds *int32  `json:"leaseDurationSeconds"`
		AcquireTime          *string `json:"acquireTime"`
		RenewTime            *string `json:"renewTime"`
	} `json:"spec"`
}

// decodeLease parses one Lease object.
func decodeLease(data []byte) (*Lease, error) {
	var j leaseJSON
	if err := json.Unmarshal(data, &j); err != nil {
		return nil, fmt.Errorf("decode Lease: %w", err)
	}
	if j.Metadata.Name == "" {
		return nil, fmt.Errorf("decode Lease: no metadata.name")
	}
	l := &Lease{
		Name:            j.Metadata.Name,
		Namespace:       j.Metadata.Namespace,
		ResourceVersion: j.Metadata.ResourceVersion,
		Labels:          j.Metadata.Labels,
		raw:             data,
	}
	if j.Spec.HolderIdentity != nil {
		l.Holder = *j.Spec.HolderIdentity
	}
	if d := j.Spec.LeaseDurationSeconds; d != nil && *d > 0 {
		l.Duration = time.Duration(*d) * time.Second
	}
	var err error
	if l.AcquireTime, err = parseTime(j.Spec.AcquireTime); err != nil {
		return nil, fmt.Errorf("decode Lease %s: spec.acquireTime: %w", l.Name, err)
	}
	if l.RenewTime, err = parseTime(j.Spec.RenewTime); err != nil {
		return nil, fmt.Errorf("decode Lease %s: spec.renewTime: %w", l.Name, err)
	}
	return l, nil
}

func parseTime(s *string) (time.Time, error) {
	if s == nil || *s == "" {
		return time.Time{}, nil
	}
	return time.Parse(time.RFC3339Nano, *s)
}

func formatTime(t time.Time) string { return t.UTC().Format(microTime) }

// encode returns the JSON of l for a create (no raw) or an update (raw with
// our fields set). Labels replace the object's labels, as upstream's
// controller does.
func (l *Lease) encode() ([]byte, error) {
	obj := map[string]any{}
	if len(l.raw) > 0 {
		if err := json.Unmarshal(l.raw, &obj); err != nil {
			return nil, fmt.Errorf("encode Lease %s: %w", l.Name, err)
		}
	}
	obj["apiVersion"] = "coordination.k8s.io/v1"
	obj["kind"] = "Lease"
	meta, _ := obj["metadata"].(map[string]any)
	if meta == nil {
		meta = map[string]any{}
	}
	meta["name"] = l.Name
	if l.Namespace != "" {
		meta["namespace"] = l.Namespace
	}
	if l.ResourceVersion != "" {
		meta["resourceVersion"] = l.ResourceVersion
	}
	if l.Labels != nil {
		meta["labels"] = l.Labels
	}
	obj["metadata"] = meta
	spec, _ := obj["spec"].(map[string]any)
	if spec == nil {
		spec = map[string]any{}
	}
	if l.Holder != "" {
		spec["holderIdentity"] = l.Holder
	}
	if l.Duration > 0 {
		spec["leaseDurationSeconds"] = int32(l.Duration / time.Second)
	}
	if !l.AcquireTime.IsZero() {
		spec["acquireTime"] = formatTime(l.AcquireTime)
	}
	if !l.RenewTime.IsZero() {
		spec["renewTime"] = formatTime(l.RenewTime)
	}
	obj["spec"] = spec
	return json.Marshal(obj)
}
