package server

import "testing"

// TestTunnelMoves checks the one table of a tunnel's states: every state
// can close, closed is the end, a drain and a handover take only open
// tunnels (so they never meet on one), only a connection no agent was
// asked for yet (reading, dialing) is passed on unasked, only such a one
// is left held by its goroutine (passing), a held tunnel moves only to
// closed, and a closed tunnel leaves the table.
func TestTunnelMoves(t *testing.T) {
	s := &Server{tunnels: map[*tunnel]struct{}{}}
	for st := range numTunnelStates {
		can := func(next tunnelState) bool {
			tt := &tunnel{s: s, state: st}
			s.tunnels[tt] = struct{}{}
			ok := tt.moveLocked(next)
			if ok && next == tunnelClosed {
				if _, in := s.tunnels[tt]; in {
					t.Errorf("%s -> closed: still in the table", st)
				}
			}
			delete(s.tunnels, tt)
			return ok
		}
		if st != tunnelClosed && !can(tunnelClosed) {
			t.Errorf("%s cannot close", st)
		}
		for next := range numTunnelStates {
			if st == tunnelClosed && can(next) {
				t.Errorf("closed moved to %s", next)
			}
			if (next == tunnelDraining || next == tunnelPausing) && st != tunnelOpen && can(next) {
				t.Errorf("%s moved to %s: only an open tunnel may", st, next)
			}
			if next == tunnelPassing && st != tunnelReading && st != tunnelDialing && can(next) {
				t.Errorf("%s moved to passing: only a connection no agent was asked for may", st)
			}
			if next == tunnelHeld && st != tunnelPassing && can(next) {
				t.Errorf("%s moved to held: only a passing connection may", st)
			}
			if st == tunnelHeld && next != tunnelClosed && can(next) {
				t.Errorf("held moved to %s: a held tunnel only leaves the table", next)
			}
		}
	}
}
