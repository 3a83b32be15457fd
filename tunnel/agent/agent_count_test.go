package agent

import (
	"testing"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
)

// The server count an agent wants: what live servers announce, combined
// with the count of server Leases as CountSource says.
func TestAgentCountSources(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	for _, tc := range []struct {
		name      string
		source    CountSource
		announced []int // counts of live connections
		lease     int
		want      int
	}{
		{"no connections, no leases", CountMax, nil, 0, 1},
		{"announced only", CountMax, []int{2, 3}, 0, 3},
		{"max: leases above", CountMax, []int{1}, 3, 3},
		{"max: announced above", CountMax, []int{4}, 2, 4},
		{"leases: below announced", CountLeases, []int{4}, 2, 2},
		{"leases: unknown yet", CountLeases, []int{4}, 0, 4},
		{"max: leases without connections", CountMax, nil, 3, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, err := New(Config{ServerAddrs: []string{"127.0.0.1:1"}, ID: "a", CountSource: tc.source, TLS: neverTLS})
			if err != nil {
				t.Fatal(err)
			}
			a.mu.Lock()
			for _, n := range tc.announced {
				a.conns[&connToServer{count: n}] = struct{}{}
			}
			a.recountLocked()
			changed := a.changed
			a.mu.Unlock()
			a.SetLeaseCount(tc.lease)
			if _, want := a.connected(); want != tc.want {
				t.Fatalf("want %d servers, got %d", tc.want, want)
			}
			if tc.lease != 0 {
				select {
				case <-changed:
				default:
					t.Fatal("a new lease count did not wake the seekers")
				}
			}
			if st := a.Status(); st.LeaseCount != tc.lease || st.Want != tc.want {
				t.Fatalf("status: %+v", st)
			}
			// Forgetting the lease count goes back to the announced one.
			a.SetLeaseCount(0)
			announced := 1
			for _, n := range tc.announced {
				announced = max(announced, n)
			}
			if _, want := a.connected(); want != announced {
				t.Fatalf("without a lease count: want %d, got %d", announced, want)
			}
		})
	}
}
