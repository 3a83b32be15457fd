package lease

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeapi"
	"github.com/spinifex/konnectivity/internal/promtext"
)

// Upstream's timing (cmd/server/app/server.go): a Lease is valid for 30s,
// renewed every 15s, and expired Leases are culled every 15s.
const (
	DefaultDuration      = 30 * time.Second
	DefaultRenewInterval = 15 * time.Second
	DefaultGCInterval    = 15 * time.Second

	// NamePrefix + server ID is the name of a server's Lease.
	NamePrefix = "konnectivity-proxy-server-"

	callTimeout = 10 * time.Second // one API call
	maxBackoff  = 7 * time.Second  // retries of a failed renewal, as upstream
)

// ControllerConfig configures a server's Controller.
type ControllerConfig struct {
	Client   *Client
	ServerID string            // holder identity; the Lease is NamePrefix+ServerID
	Labels   map[string]string // set on the Lease; expired Leases with these labels are culled

	Duration      time.Duration // default DefaultDuration (whole seconds)
	RenewInterval time.Duration // default DefaultRenewInterval
	GCInterval    time.Duration // default DefaultGCInterval

	Metrics *promtext.Registry // nil: a private registry
	Logger  *slog.Logger
	Now     func() time.Time // default time.Now
}

// Controller keeps a server's Lease renewed and culls expired ones. Run
// owns its goroutines; Release deletes the Lease once Run has returned.
type Controller struct {
	cfg      ControllerConfig
	name     string
	selector string
	log      *slog.Logger
	metrics  *serverMetrics

	renewLog, gcLog stateLog

	// latest is the Lease as last stored; owned by the renewing goroutine
	// while Run runs, then by Release.
	latest *Lease
}

// NewController checks cfg and returns a Controller that is not yet running.
func NewController(cfg ControllerConfig) (*Controller, error) {
	if cfg.Client == nil {
		return nil, errors.New("lease controller: no client")
	}
	if len(cfg.Labels) == 0 {
		return nil, errors.New("lease controller: no labels (culling would touch every Lease in the namespace)")
	}
	name := NamePrefix + cfg.ServerID
	if err := validName(name, 253); err != nil {
		return nil, fmt.Errorf("lease name %q (from the server ID): %w", name, err)
	}
	if cfg.Duration <= 0 {
		cfg.Duration = DefaultDuration
	}
	cfg.Duration = cfg.Duration.Truncate(time.Second)
	if cfg.Duration < time.Second {
		cfg.Duration = time.Second
	}
	if cfg.RenewInterval <= 0 {
		cfg.RenewInterval = DefaultRenewInterval
	}
	if cfg.GCInterval <= 0 {
		cfg.GCInterval = DefaultGCInterval
	}
	if cfg.RenewInterval >= cfg.Duration {
		return nil, fmt.Errorf("lease controller: renew interval %s must be shorter than the lease duration %s", cfg.RenewInterval, cfg.Duration)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	log := cfg.Logger.With("lease", cfg.Client.Namespace()+"/"+name)
	return &Controller{
		cfg:      cfg,
		name:     name,
		selector: FormatLabels(cfg.Labels),
		log:      log,
		metrics:  newServerMetrics(cfg.Metrics),
		renewLog: stateLog{log: log, what: "renew server lease"},
		gcLog:    stateLog{log: log, what: "cull expired server leases"},
	}, nil
}

// Name is the name of the server's Lease.
func (c *Controller) Name() string { return c.name }

// Run creates and renews the Lease and culls expired ones until ctx ends.
func (c *Controller) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); c.renewLoop(ctx) }()
	go func() { defer wg.Done(); c.gcLoop(ctx) }()
	wg.Wait()
}

// Release deletes the server's Lease, so agents stop counting this server at
// once instead of when it expires. Call it after Run returned.
func (c *Controller) Release(ctx context.Context) error {
	// Short: the process is stopping, and an unreleased Lease expires.
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	err := c.cfg.Client.Delete(ctx, c.name, "")
	if err != nil && !kubeapi.IsCode(err, http.StatusNotFound) {
		return fmt.Errorf("delete server lease %s: %w", c.name, err)
	}
	c.latest = nil
	return nil
}

func (c *Controller) renewLoop(ctx context.Context) {
	backoff := 100 * time.Millisecond
	for {
		err := c.renew(ctx)
		if ctx.Err() != nil {
			return
		}
		wait := kubeapi.Jitter(c.cfg.RenewInterval, 0.04)
		if err != nil {
			c.metrics.renewErr.Inc()
			c.renewLog.failed(err)
			// Retry soon, as upstream does, but never later than the
			// next renewal would be.
			backoff = min(2*backoff, maxBackoff)
			wait = min(backoff, wait)
		} else {
			c.metrics.renewOK.Inc()
			c.renewLog.ok("holder", c.cfg.ServerID)
			backoff = 100 * time.Millisecond
		}
		if !kubeapi.Sleep(ctx, wait) {
			return
		}
	}
}

// renew updates the stored Lease with a new renewTime, or creates it.
func (c *Controller) renew(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	if c.latest != nil {
		l, err := c.cfg.Client.Update(ctx, c.next(c.latest))
		if err == nil {
			c.latest = l
			return nil
		}
		if !kubeapi.IsCode(err, http.StatusConflict) && !kubeapi.IsCode(err, http.StatusNotFound) {
			return err
		}
		c.latest = nil // changed or deleted by someone else: start over
	}
	l, err := c.cfg.Client.Get(ctx, c.name)
	switch {
	case kubeapi.IsCode(err, http.StatusNotFound):
		l, err = c.cfg.Client.Create(ctx, c.next(nil))
		if err != nil {
			return err
		}
		c.latest = l
		c.log.Info("server lease created", "holder", c.cfg.ServerID, "duration", c.cfg.Duration.String())
		return nil
	case err != nil:
		return err
	}
	l, err = c.cfg.Client.Update(ctx, c.next(l))
	if err != nil {
		return err
	}
	c.latest = l
	return nil
}

// next is the Lease to write: base (nil for a new one) renewed now, with the
// configured labels and duration.
func (c *Controller) next(base *Lease) *Lease {
	var l Lease
	if base != nil {
		l = *base
	} else {
		l = Lease{Name: c.name, Namespace: c.cfg.Client.Namespace(), Holder: c.cfg.ServerID}
	}
	l.Labels = c.cfg.Labels
	l.Duration = c.cfg.Duration
	l.RenewTime = c.cfg.Now()
	return &l
}

func (c *Controller) gcLoop(ctx context.Context) {
	for {
		if err := c.gc(ctx); err != nil {
			c.gcLog.failed(err)
		} else {
			c.gcLog.ok()
		}
		if !kubeapi.Sleep(ctx, c.cfg.GCInterval) {
			return
		}
	}
}

// gc deletes the Leases with this server's labels that have expired. The
// delete carries the resourceVersion that was seen expired, so a Lease
// renewed in between is left alone.
func (c *Controller) gc(ctx context.Context) error {
	lctx, cancel := context.WithTimeout(ctx, callTimeout)
	start := time.Now()
	leases, _, err := c.cfg.Client.List(lctx, c.selector)
	cancel()
	c.metrics.observeList(err, time.Since(start))
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("list: %w", err)
	}
	now := c.cfg.Now()
	var failed error
	for _, l := range leases {
		if l.Valid(now) || ctx.Err() != nil {
			continue
		}
		dctx, cancel := context.WithTimeout(ctx, callTimeout)
		start := time.Now()
		err := c.cfg.Client.Delete(dctx, l.Name, l.ResourceVersion)
		cancel()
		c.metrics.observeDelete(err, time.Since(start))
		switch {
		case err == nil:
			c.metrics.culled.Inc()
			exp, _ := l.Expiry()
			c.log.Info("culled expired server lease", "culled", l.Name, "holder", l.Holder, "expired", exp.UTC().Format(time.RFC3339))
		case kubeapi.IsCode(err, http.StatusNotFound), kubeapi.IsCode(err, http.StatusConflict):
			// Deleted by another server, or renewed since the list.
		default:
			failed = fmt.Errorf("delete %s: %w", l.Name, err)
		}
	}
	return failed
}

// stateLog logs a failing task once per change: the first failure, a
// failure that differs from the last one logged, and the recovery.
type stateLog struct {
	log     *slog.Logger
	what    string
	lastErr string // owned by the goroutine that runs the task
}

func (s *stateLog) failed(err error) {
	if msg := err.Error(); msg != s.lastErr {
		s.lastErr = msg
		s.log.Warn(s.what+" failed; retrying", "err", err)
	}
}

func (s *stateLog) ok(args ...any) {
	if s.lastErr != "" {
		s.lastErr = ""
		s.log.Info(s.what+": working again", args...)
	}
}
