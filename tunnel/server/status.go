package server

import (
	"sort"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
	"github.com/spinifex/konnectivity/tunnel/wire"
)

// Status is what /debug/tunnels shows for a server.
type Status struct {
	Role        string        `json:"role"` // "server"
	ServerID    string        `json:"serverID"`
	ServerCount int           `json:"serverCount"`
	Agents      []AgentStatus `json:"agents"`
	// Tunnels counts the server's tunnels by state; Restarts what
	// restarts moved.
	Tunnels  map[string]int `json:"tunnels"`
	Restarts *RestartStatus `json:"restarts"`
}

// AgentStatus is one connected agent, as the server sees it.
type AgentStatus struct {
	ID string `json:"id"`
	// ClaimedID is the ID the agent asked for, when its credential gave it
	// ID instead (an ID that names neither its token's node nor its pod).
	ClaimedID   string `json:"claimedID,omitempty"`
	Identifiers string `json:"identifiers,omitempty"`
	// Node is the node the agent's credential binds it to, whose dials the
	// node strategy sends it; empty when it proves none.
	Node           string    `json:"node,omitempty"`
	Remote         string    `json:"remote"`
	Since          time.Time `json:"since"`
	OpenStreams    int64     `json:"openStreams"`
	BytesToAgent   int64     `json:"bytesToAgent"`
	BytesFromAgent int64     `json:"bytesFromAgent"`
	Draining       bool      `json:"draining"`
	// CreditStalls counts the credit stalls seen on the agent's link;
	// SendWaiting is how many of its tunnels wait for send credit now
	// toward the agent, and SendWaits the longest waits
	// (wire.MaxSendWaits). docs/slow-links.md says what they tell.
	CreditStalls uint64          `json:"creditStalls"`
	SendWaiting  int             `json:"sendWaiting"`
	SendWaits    []wire.SendWait `json:"sendWaits,omitempty"`
}

// Status reports the connected agents, sorted by ID, the tunnels by
// state and what restarts moved.
func (s *Server) Status() Status {
	st := Status{Role: "server", ServerID: s.cfg.ID, ServerCount: s.cfg.Count, Agents: []AgentStatus{},
		Tunnels:  map[string]int{},
		Restarts: s.hand.restartStatus(),
	}
	s.mu.Lock()
	for _, state := range shownStates {
		st.Tunnels[state.String()] = s.inState[state]
	}
	s.mu.Unlock()
	now := time.Now()
	waits := map[sendWaitKey]*wire.SendWait{}
	for _, a := range s.agents.snapshot() {
		var cs h2link.CreditStatus
		if l := a.ourLink(); l != nil {
			cs = l.CheckCredit(wire.MaxSendWaits)
		}
		sw := wire.SendWaits(cs, now)
		for i := range sw {
			waits[sendWaitKey{a, sw[i].Stream}] = &sw[i]
		}
		st.Agents = append(st.Agents, AgentStatus{
			ID:             a.id,
			ClaimedID:      a.claimedID,
			Identifiers:    a.ids.String(),
			Node:           a.node,
			Remote:         a.remote,
			Since:          a.since,
			OpenStreams:    a.tunnels.Load(),
			BytesToAgent:   a.bytesTo.Load(),
			BytesFromAgent: a.bytesFrom.Load(),
			Draining:       a.draining.Load(),
			CreditStalls:   cs.Stalls,
			SendWaiting:    cs.Waiting,
			SendWaits:      sw,
		})
	}
	sort.Slice(st.Agents, func(i, j int) bool { return st.Agents[i].ID < st.Agents[j].ID })
	s.nameSendWaits(waits)
	return st
}

// sendWaitKey is a tunnel by its agent's connection and stream.
type sendWaitKey struct {
	agent  *agentConn
	stream uint32
}

// nameSendWaits gives each tunnel waiting for send credit the
// destination its client dialled, from the tunnel table.
func (s *Server) nameSendWaits(waits map[sendWaitKey]*wire.SendWait) {
	if len(waits) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for t := range s.tunnels {
		switch t.state {
		case tunnelOpen, tunnelDraining, tunnelPausing: // agent, body and addr are set, and read-only
		default:
			continue
		}
		if b, ok := t.body.(*h2link.Body); ok {
			if w := waits[sendWaitKey{t.agent, b.StreamID()}]; w != nil {
				w.Destination = t.addr
			}
		}
	}
}
