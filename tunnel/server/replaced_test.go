package server

import (
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
)

// Replacements of one ID form a run while each comes within replaceRun
// of the one before: the first is ordinary, the second reports the run,
// later ones are counted into the next report, due a replaceRun after
// the last; a gap longer than replaceRun starts a new run.
func TestReplacementRuns(t *testing.T) {
	r := newReplacements(promtext.NewRegistry())
	t0 := time.Unix(1000, 0)
	steps := []struct {
		at   time.Duration
		want replaceReport
	}{
		{0, replaceReport{}},
		{time.Second, replaceReport{inRun: true, report: true, count: 2, runFor: time.Second}},
		{30 * time.Second, replaceReport{inRun: true, count: 1, runFor: 30 * time.Second}},
		{61 * time.Second, replaceReport{inRun: true, report: true, count: 2, runFor: 61 * time.Second}},
		{3 * time.Minute, replaceReport{}}, // more than replaceRun since the last: a new run
		{3*time.Minute + time.Second, replaceReport{inRun: true, report: true, count: 2, runFor: time.Second}},
	}
	for i, st := range steps {
		if got := r.note("clone", t0.Add(st.at)); got != st.want {
			t.Fatalf("step %d (%v): %+v, want %+v", i, st.at, got, st.want)
		}
	}
	if got := r.note("other", t0.Add(10*time.Minute)); got.inRun {
		t.Fatalf("another ID's first replacement is in a run: %+v", got)
	}
	r.mu.Lock()
	n := len(r.byID)
	r.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d IDs kept, want 1: ended runs are forgotten", n)
	}
	if got := r.total.Value(); got != uint64(len(steps)+1) {
		t.Fatalf("agent_replaced_total %v, want %d", got, len(steps)+1)
	}
}
