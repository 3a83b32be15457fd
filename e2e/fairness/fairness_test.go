package main

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"
)

// TestRelayHoldsEveryByte: the relay's copy writes each byte no sooner
// than its hold after it was read, keeps every byte in order, and passes
// the end on. (A lower bound only: a busy machine can make it later.)
func TestRelayHoldsEveryByte(t *testing.T) {
	in, feed := net.Pipe()
	out, drain := net.Pipe()
	t.Cleanup(func() { feed.Close(); drain.Close() })
	drain.SetReadDeadline(time.Now().Add(30 * time.Second))
	const hold = 30 * time.Millisecond
	start := time.Now() // before anything is read: no byte may come before start+hold
	done := make(chan struct{})
	go func() { defer close(done); delayCopy(out, in, hold); out.Close() }()
	want := bytes.Repeat([]byte("konnectivity"), 10000)
	go func() {
		for p := want; len(p) > 0; p = p[min(len(p), 4096):] {
			feed.Write(p[:min(len(p), 4096)])
		}
		feed.Close()
	}()
	first := make([]byte, 1)
	if _, err := io.ReadFull(drain, first); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < hold {
		t.Errorf("the first byte came after %v, before the %v hold", took, hold)
	}
	rest, err := io.ReadAll(drain)
	if err != nil {
		t.Fatal(err)
	}
	if got := append(first, rest...); !bytes.Equal(got, want) {
		t.Errorf("%d bytes through the relay, want the %d sent, in order", len(got), len(want))
	}
	<-done
}

// TestProbeKeepsItsPaceOnALongLink: probes go every probeGap whatever the
// round trip, so a link held 30 ms each way still gives about one sample
// per gap, each at least the round trip; and a wrong echo is an error.
func TestProbeKeepsItsPaceOnALongLink(t *testing.T) {
	client, far := net.Pipe()
	t.Cleanup(func() { client.Close(); far.Close() })
	const hold = 30 * time.Millisecond
	go delayCopy(far, far, hold) // an echo that holds every byte
	const d = 400 * time.Millisecond
	rtts, err := probeFor(t.Context(), client, d)
	if err != nil {
		t.Fatal(err)
	}
	if n, least := len(rtts), int(d/probeGap)*3/4; n < least {
		t.Errorf("%d probes in %v, want at least %d: the probe waited for each echo", n, d, least)
	}
	for i, rtt := range rtts {
		if rtt < hold {
			t.Fatalf("probe %d timed %v, below the %v hold", i, rtt, hold)
		}
	}

	// An echo that changes a byte.
	bad, badFar := net.Pipe()
	t.Cleanup(func() { bad.Close(); badFar.Close() })
	go func() {
		buf := make([]byte, 64)
		for {
			if _, err := io.ReadFull(badFar, buf); err != nil {
				return
			}
			buf[10]++
			if _, err := badFar.Write(buf); err != nil {
				return
			}
		}
	}()
	if _, err := probeFor(t.Context(), bad, 50*time.Millisecond); err == nil {
		t.Error("an echo that came back different was not an error")
	}
}

// TestVerdictNamesANoisyRun: a p99 target missed by the probe alone is
// the machine's; the verdict says so, and says nothing more when the
// probe alone was within it.
func TestVerdictNamesANoisyRun(t *testing.T) {
	rw := row{p99: 10 * time.Millisecond}
	for _, tc := range []struct {
		res  result
		want string
	}{
		{result{p99: 9 * time.Millisecond, alone99: 12 * time.Millisecond}, "p99 ≤ 10.0: met"},
		{result{p99: 12 * time.Millisecond, alone99: 2 * time.Millisecond}, "p99 ≤ 10.0: NOT met"},
		{result{p99: 12 * time.Millisecond, alone99: 11 * time.Millisecond}, "p99 ≤ 10.0: NOT met (the probe alone misses it too: a noisy run)"},
	} {
		if got := rw.verdict([]result{tc.res}); got != tc.want {
			t.Errorf("verdict(p99 %v, alone %v) = %q, want %q", tc.res.p99, tc.res.alone99, got, tc.want)
		}
	}
}
