package tunnel

import "testing"

// TestTunnelMoves checks the one table of a tunnel's states: every state
// can close, closed is the end, a drain and a handover take only open
// tunnels (so they never meet on one), and a closed tunnel leaves the
// table.
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
		}
	}
}
