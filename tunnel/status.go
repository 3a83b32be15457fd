package tunnel

import (
	"sort"
	"time"
)

// ServerStatus is what /debug/tunnels shows for a server.
type ServerStatus struct {
	Role        string        `json:"role"` // "server"
	ServerID    string        `json:"serverID"`
	ServerCount int           `json:"serverCount"`
	Agents      []AgentStatus `json:"agents"`
	// Tunnels counts the server's tunnels by state; Restarts what
	// restarts moved.
	Tunnels  map[string]int `json:"tunnels"`
	Restarts *RestartStatus `json:"restarts"`
}

// Status reports the connected agents, sorted by ID, the tunnels by
// state and what restarts moved.
func (s *Server) Status() ServerStatus {
	st := ServerStatus{Role: "server", ServerID: s.cfg.ID, ServerCount: s.cfg.Count, Agents: []AgentStatus{},
		Tunnels:  map[string]int{},
		Restarts: s.restartStatus(),
	}
	s.mu.Lock()
	for state := tunnelOpen; state < tunnelClosed; state++ {
		st.Tunnels[state.String()] = 0
	}
	for t := range s.tunnels {
		if t.state != tunnelDialing {
			st.Tunnels[t.state.String()]++
		}
	}
	s.mu.Unlock()
	for _, a := range s.agents.snapshot() {
		st.Agents = append(st.Agents, AgentStatus{
			ID:             a.id,
			Identifiers:    a.ids.String(),
			Remote:         a.remote,
			Since:          a.since,
			OpenStreams:    a.streams.Load(),
			BytesToAgent:   a.bytesTo.Load(),
			BytesFromAgent: a.bytesFrom.Load(),
			Draining:       a.draining.Load(),
		})
	}
	sort.Slice(st.Agents, func(i, j int) bool { return st.Agents[i].ID < st.Agents[j].ID })
	return st
}

// AgentSideStatus is what /debug/tunnels shows for an agent.
type AgentSideStatus struct {
	Role        string             `json:"role"` // "agent"
	AgentID     string             `json:"agentID"`
	Held        int                `json:"held"`
	Want        int                `json:"want"`
	LeaseCount  int                `json:"leaseCount,omitempty"` // valid server Leases, when counted
	OpenStreams int64              `json:"openStreams"`
	Servers     []ServerConnStatus `json:"servers"`
}

// ServerConnStatus is one server connection, as the agent sees it.
type ServerConnStatus struct {
	ServerID    string    `json:"serverID"`
	Addr        string    `json:"addr"`
	Since       time.Time `json:"since"`
	Count       int       `json:"serverCount"`
	OpenStreams int64     `json:"openStreams"`
}

// Status reports the agent's server connections, sorted by server ID.
func (a *Agent) Status() AgentSideStatus {
	a.mu.Lock()
	st := AgentSideStatus{Role: "agent", AgentID: a.cfg.ID, Held: len(a.conns), Want: a.maxCount, LeaseCount: a.leaseCount, Servers: []ServerConnStatus{}}
	for l := range a.conns {
		st.Servers = append(st.Servers, ServerConnStatus{ServerID: l.id, Addr: l.addr, Since: l.since, Count: l.count, OpenStreams: l.streams.Load()})
	}
	a.mu.Unlock()
	st.OpenStreams = a.Stats.OpenStreams.Load()
	sort.Slice(st.Servers, func(i, j int) bool { return st.Servers[i].ServerID < st.Servers[j].ServerID })
	return st
}
