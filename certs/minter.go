package certs

import (
	"context"
	"log/slog"
	"time"
)

// DefaultRenewInterval is used by Minter.Renew when interval is not positive.
const DefaultRenewInterval = time.Hour

// Minter keeps a pair minted in-process (for a server that owns its CA).
// Serve the files through a Reloader, which picks up re-minted pairs.
type Minter struct {
	opts   EnsureOptions
	logger *slog.Logger
}

// NewMinter runs Ensure once and fails if it does.
func NewMinter(opts EnsureOptions, logger *slog.Logger) (*Minter, Result, error) {
	m := &Minter{opts: opts, logger: orDiscard(logger)}
	res, err := Ensure(opts)
	if err != nil {
		return nil, Result{}, err
	}
	m.log(res)
	return m, res, nil
}

// Renew calls Ensure every interval until ctx is done. Failures are logged
// and retried at the next tick; the pair on disk is left as it was.
func (m *Minter) Renew(ctx context.Context, interval time.Duration) {
	if interval <= 0 {
		interval = DefaultRenewInterval
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		res, err := Ensure(m.opts)
		if err != nil {
			m.logger.Error("certificate renewal failed", "cert", m.opts.CertFile, "err", err)
			continue
		}
		m.log(res)
	}
}

func (m *Minter) log(res Result) {
	if res.Minted {
		m.logger.Info("certificate minted", "cert", m.opts.CertFile, "reason", res.Reason, "notAfter", formatTime(res.NotAfter))
		return
	}
	m.logger.Debug("certificate reused", "cert", m.opts.CertFile, "reason", res.Reason)
}
