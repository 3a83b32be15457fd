package server

import (
	"sync"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
)

// A login whose agent ID is connected already replaces that connection
// (register): the agent may have reconnected over a connection that died
// half-way. When the connection it replaces had not announced a drain or
// a restart, two processes may share one ID and one credential (a cloned
// node): they replace each other in turn. Our agent learns it was
// replaced (wire.GoAwayReplaced) and backs off before it logs in again;
// the server counts each such replacement (agent_replaced_total) and,
// when they recur for one ID (a run: each within replaceRun of the one
// before), reports the run once per replaceRun with its count instead of
// the "agent connected" and "agent disconnected" lines of each.
const replaceRun = time.Minute

// replacements counts the replacements of each agent ID in a run. Its
// lock is a leaf.
type replacements struct {
	total *promtext.Counter

	mu   sync.Mutex
	byID map[string]*replaceCount // guarded by mu: IDs replaced within replaceRun, pruned as new ones come
}

// replaceCount is one ID's run.
type replaceCount struct {
	start, last time.Time // the run's first and last replacement
	reported    time.Time // the run's last report; zero before the first
	unreported  int       // replacements since the last report (or the run's start)
}

func newReplacements(m *promtext.Registry) *replacements {
	return &replacements{
		total: m.Counter(serverPrefix+"agent_replaced_total", "Agent logins that replaced a connection of the same agent ID that had announced no drain or restart: an agent back over a connection that died half-way, or two processes sharing one ID and credential (a cloned node), which replace each other in turn.", nil),
		byID:  map[string]*replaceCount{},
	}
}

// replaceReport is what note tells its caller: whether the replacement is
// part of a run (its login and its end are then not logged one by one),
// and, when a report is due, what it says.
type replaceReport struct {
	inRun  bool
	report bool
	count  int           // replacements since the run's last report, this one included
	runFor time.Duration // since the run's first replacement
}

// note counts one replacement of id at now.
func (r *replacements) note(id string, now time.Time) replaceReport {
	r.total.Inc()
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.byID[id]
	if c == nil || now.Sub(c.last) > replaceRun {
		if c == nil {
			for k, old := range r.byID { // forget ended runs: the map holds the IDs in one
				if now.Sub(old.last) > replaceRun {
					delete(r.byID, k)
				}
			}
		}
		// The first replacement of a run is an ordinary one: its login
		// and its end are logged.
		r.byID[id] = &replaceCount{start: now, last: now, unreported: 1}
		return replaceReport{}
	}
	c.last = now
	c.unreported++
	rep := replaceReport{inRun: true, count: c.unreported, runFor: now.Sub(c.start)}
	if c.reported.IsZero() || now.Sub(c.reported) >= replaceRun {
		rep.report = true
		c.reported, c.unreported = now, 0
	}
	return rep
}
