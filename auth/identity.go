package auth

import (
	"time"
)

// The keys under which kube-apiserver (1.30 and later) puts the pod and
// node a bound ServiceAccount token was issued for into the TokenReview's
// status.user.extra.
const (
	ExtraNodeName = "authentication.kubernetes.io/node-name"
	ExtraPodName  = "authentication.kubernetes.io/pod-name"
	ExtraPodUID   = "authentication.kubernetes.io/pod-uid"
)

// maxClaimLen bounds a claim taken from the apiserver's answer: a node
// name is a DNS subdomain (253), a pod UID 36.
const maxClaimLen = 253

// Identity is what a TokenReview says about an accepted token.
type Identity struct {
	Username string // system:serviceaccount:<namespace>:<name>
	// Node, Pod and PodUID name the node and pod a bound token was issued
	// for. They are empty for a token not bound to a pod (a TokenRequest
	// without a bound object) and on apiservers before Kubernetes 1.30.
	Node, Pod, PodUID string
	// Expires is the token's exp claim; zero if it has none.
	Expires time.Time
}

// boundIdentity reads the node and pod claims from a TokenReview's user.
// A claim that is missing, repeated or not a plain name is treated as
// absent: the token then proves no node, and nothing is bound to one.
func boundIdentity(u userInfo) Identity {
	id := Identity{Username: u.Username}
	id.Node = claim(u.Extra, ExtraNodeName)
	id.Pod = claim(u.Extra, ExtraPodName)
	id.PodUID = claim(u.Extra, ExtraPodUID)
	return id
}

func claim(extra map[string][]string, key string) string {
	vals := extra[key]
	if len(vals) != 1 {
		return ""
	}
	v := vals[0]
	if v == "" || len(v) > maxClaimLen {
		return ""
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c <= ' ' || c >= 0x7f || c == ',' {
			return ""
		}
	}
	return v
}
