package server

import (
	"sort"
	"time"
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
	for _, a := range s.agents.snapshot() {
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
		})
	}
	sort.Slice(st.Agents, func(i, j int) bool { return st.Agents[i].ID < st.Agents[j].ID })
	return st
}
