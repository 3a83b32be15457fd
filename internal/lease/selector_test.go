package lease

import (
	"strings"
	"testing"
)

func TestParseSelector(t *testing.T) {
	labels := map[string]string{"k8s-app": "konnectivity-server", "tier": "control-plane", "gen": "3"}
	for _, tc := range []struct {
		sel, canonical string
		match          bool
	}{
		{"", "", true},
		{"k8s-app=konnectivity-server", "k8s-app=konnectivity-server", true},
		{" k8s-app == konnectivity-server ", "k8s-app=konnectivity-server", true},
		{"k8s-app!=konnectivity-server", "k8s-app!=konnectivity-server", false},
		{"k8s-app=konnectivity-server,tier=control-plane", "k8s-app=konnectivity-server,tier=control-plane", true},
		{"tier=control-plane,k8s-app=other", "k8s-app=other,tier=control-plane", false},
		{"tier in (control-plane, nodes)", "tier in (control-plane,nodes)", true},
		{"tier notin (control-plane)", "tier notin (control-plane)", false},
		{"missing notin (x)", "missing notin (x)", true},
		{"k8s-app", "k8s-app", true},
		{"!k8s-app", "!k8s-app", false},
		{"!missing", "!missing", true},
		{"gen>2", "gen>2", true},
		{"gen<3", "gen<3", false},
		{"example.com/role=x", "example.com/role=x", false},
		{"empty=", "empty=", false},
	} {
		s, err := ParseSelector(tc.sel)
		if err != nil {
			t.Errorf("%q: %v", tc.sel, err)
			continue
		}
		if s.String() != tc.canonical {
			t.Errorf("%q: canonical %q, want %q", tc.sel, s.String(), tc.canonical)
		}
		if got := s.Matches(labels); got != tc.match {
			t.Errorf("%q: Matches = %v, want %v", tc.sel, got, tc.match)
		}
		// The canonical form parses to the same selector.
		again, err := ParseSelector(s.String())
		if err != nil || again.String() != s.String() {
			t.Errorf("%q: canonical form %q does not round-trip: %v", tc.sel, s.String(), err)
		}
	}
	for _, bad := range []string{"=x", "a=b=c", "a in x", "a in (x", "a>x", "a,", ",a", "a b", "-a=b", "a=-b", "a=" + strings.Repeat("x", 64), "Bad_Prefix/a=b", "a in ()"} {
		if _, err := ParseSelector(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestParseLabels(t *testing.T) {
	got, err := ParseLabels("k8s-app=konnectivity-server, tier = cp")
	if err != nil || len(got) != 2 || got["k8s-app"] != "konnectivity-server" || got["tier"] != "cp" {
		t.Fatalf("got %v, %v", got, err)
	}
	if FormatLabels(got) != "k8s-app=konnectivity-server,tier=cp" {
		t.Fatalf("FormatLabels = %q", FormatLabels(got))
	}
	for _, bad := range []string{"", "novalue", "a=b=c", "=b", "a=b,", "a=b c"} {
		if _, err := ParseLabels(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// FuzzParseSelector: any input either fails cleanly or yields a selector
// whose canonical form parses to itself.
func FuzzParseSelector(f *testing.F) {
	for _, s := range []string{"k8s-app=konnectivity-server", "a in (b,c),!d", "x>1", "a!=b,c", "(", "a in (", "!", "a==", "example.com/x notin (y)"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		sel, err := ParseSelector(s)
		if err != nil {
			return
		}
		again, err := ParseSelector(sel.String())
		if err != nil || again.String() != sel.String() {
			t.Fatalf("%q: canonical %q does not round-trip: %v", s, sel.String(), err)
		}
		sel.Matches(map[string]string{"a": "b", "x": "2"})
	})
}

// FuzzReadEvents: a watch stream from a broken or hostile apiserver ends
// with an error, never a panic, and no event is larger than the bound.
func FuzzReadEvents(f *testing.F) {
	for _, s := range []string{
		`{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"2"},"spec":{"renewTime":"2026-01-01T00:00:00.000000Z","leaseDurationSeconds":30}}}`,
		`{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"9"}}}`,
		`{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired"}}`,
		`{"type":"ADDED","object":{"metadata":{}}}`,
		`{"type":"WHAT"}`,
		`{"type":"MODIFIED","object":{"metadata":{"name":"a"},"spec":{"renewTime":"yesterday"}}}`,
		`[`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		out := make(chan Event, 1)
		done := make(chan struct{})
		go func() {
			defer close(done)
			for range out {
			}
		}()
		readEvents(t.Context(), strings.NewReader(s), out)
		close(out)
		<-done
	})
}
