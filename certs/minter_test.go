package certs

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"
)

func TestMinterRenewsBeforeExpiry(t *testing.T) {
	e := newEnsureEnv(t)
	clock := newFakeClock()
	o := e.opts()
	o.Now = clock.Now
	logs := &syncBuffer{}
	m, res, err := NewMinter(o, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	expectMinted(t, res, "no existing certificate")
	first := parseCertFile(t, e.certFile)

	r, err := NewReloader(e.certFile, e.keyFile, nil)
	if err != nil {
		t.Fatal(err)
	}
	rclock := newFakeClock()
	rclock.install(&r.t)

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		m.Renew(ctx, time.Millisecond)
	}()
	defer func() {
		cancel()
		wg.Wait()
	}()

	// Jump to within renew-before of expiry; the loop must re-mint.
	clock.Set(first.NotAfter.Add(-24 * time.Hour))
	deadline := time.Now().Add(30 * time.Second)
	for {
		rclock.Advance(checkInterval)
		if got := served(t, r); !got.Equal(first) {
			if got.NotAfter.Before(first.NotAfter) {
				t.Fatalf("renewed certificate expires earlier: %v", got.NotAfter)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Renew did not re-mint within 30s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	mustContain(t, logs.String(), "within renew-before")
}

func TestMinterStopsOnCancel(t *testing.T) {
	e := newEnsureEnv(t)
	m, _, err := NewMinter(e.opts(), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	m.Renew(ctx, 0) // returns because ctx is done
	o := e.opts()
	o.CA = nil
	if _, _, err := NewMinter(o, nil); err == nil {
		t.Fatal("NewMinter without CA succeeded")
	}
}
