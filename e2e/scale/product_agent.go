package main

import (
	"context"
	"crypto/tls"
	"log/slog"
	"strconv"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/agent"
)

// failureSeries is the agent's own count of failed connections to a
// server.
const failureSeries = "konnectivity_network_proxy_agent_server_connection_failure_count"

// productAgent is the product's own agent code (agent.Agent) as a
// simulated agent: one per simulated node, each with its own TLS
// connection and link.
type productAgent struct {
	a    *agent.Agent
	fail *promtext.Counter
}

// newProductAgent is agent i as `konnectivity agent` configures it, with
// one server address and the default timings (retry pacing included);
// only the drain on shutdown is short, as the benchmark has closed its
// tunnels by then.
func newProductAgent(f *fleet, i int) (simAgent, error) {
	reg := promtext.NewRegistry()
	a, err := agent.New(agent.Config{
		ServerAddrs: []string{f.args.Server},
		ID:          "scale-" + strconv.Itoa(i),
		TLS: func(serverName string) (*tls.Config, error) {
			c := f.tls.Clone()
			c.ServerName = serverName
			return c, nil
		},
		DrainTimeout: 2 * time.Second,
		Metrics:      reg,
		Logger:       slog.New(&agentEvents{f: f}),
	})
	if err != nil {
		return nil, err
	}
	return &productAgent{a: a, fail: reg.Counter(failureSeries, "", []string{"direction"}, "to_server")}, nil
}

func (p *productAgent) run(ctx context.Context) { _ = p.a.Run(ctx) }

func (p *productAgent) connected() bool {
	ok, _ := p.a.Ready() // at least one server held
	return ok
}

func (p *productAgent) open() int64      { return p.a.Stats.Tunnels.Load() }
func (p *productAgent) failures() uint64 { return p.fail.Value() }

// agentEvents reads the agent's log events instead of printing them: a
// connection made, and the reason of a failed one (the agent rate-limits
// those lines, so a sample).
type agentEvents struct{ f *fleet }

func (h *agentEvents) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelInfo }

func (h *agentEvents) Handle(_ context.Context, r slog.Record) error {
	switch r.Message {
	case "connected to server":
		h.f.connectedNow()
	case "server connection failed":
		r.Attrs(func(a slog.Attr) bool {
			if a.Key != "err" {
				return true
			}
			h.f.errs.note(a.Value.String())
			return false
		})
	}
	return nil
}

func (h *agentEvents) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *agentEvents) WithGroup(string) slog.Handler      { return h }
