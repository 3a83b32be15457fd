package wire

import (
	"log/slog"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// A link's credit stalls (what they are, and when one is seen: h2link's
// stall.go) are counted in a family of each process by kind, logged once
// each, and shown per link in /debug/tunnels with the tunnels that wait
// for send credit, so that an operator finds the link whose tunnels hang
// (docs/slow-links.md).

// CreditStalls counts a process's credit stalls by kind.
type CreditStalls struct {
	byKind [h2link.NumCreditStallKinds]*promtext.Counter
}

// Register makes the family name{kind}.
func (c *CreditStalls) Register(m *promtext.Registry, name string) {
	const help = "Credit stalls seen on agent links, by kind: connection_credit (tunnels waited for connection credit and none of them was given any for 10 s), credit_owed (credit for bytes already read was not returned to the peer for 10 s)."
	for k := range h2link.NumCreditStallKinds {
		c.byKind[k] = m.Counter(name, help, []string{"kind"}, k.String())
	}
}

// Told counts s and logs it, one line with its figures; args name the
// link. A stall is told once (h2link.Config.OnCreditStall).
func (c *CreditStalls) Told(log *slog.Logger, s h2link.CreditStall, args ...any) {
	c.byKind[s.Kind].Inc()
	log.Warn("credit stall", append(args, s.LogArgs()...)...)
}

// MaxSendWaits bounds the tunnels /debug/tunnels lists per link as
// waiting for send credit: the longest waits.
const MaxSendWaits = 20

// SendWait is a tunnel whose writer waits for send credit, as
// /debug/tunnels shows it.
type SendWait struct {
	Stream      uint32 `json:"stream"`                // the HTTP/2 stream, the same at both ends
	Destination string `json:"destination,omitempty"` // the server's: what the client dialled
	// For is what it waits for: "stream" (its own window: a reader that
	// does not read) or "connection" (the link's window).
	For     string    `json:"for"`
	Since   time.Time `json:"since"`
	Seconds float64   `json:"seconds"` // how long it has waited
}

// SendWaits is how /debug/tunnels shows cs's longest waits at now.
func SendWaits(cs h2link.CreditStatus, now time.Time) []SendWait {
	if len(cs.Longest) == 0 {
		return nil
	}
	out := make([]SendWait, 0, len(cs.Longest))
	for _, w := range cs.Longest {
		what := "stream"
		if w.ForConnection {
			what = "connection"
		}
		out = append(out, SendWait{Stream: w.StreamID, For: what, Since: w.Since, Seconds: now.Sub(w.Since).Seconds()})
	}
	return out
}
