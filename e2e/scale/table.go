package main

import (
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"time"
)

// printTable prints one column per front door, markdown.
func printTable(out io.Writer, cfg config, doors []*doorRun) {
	if len(doors) == 0 {
		return
	}
	n, m := cfg.agents, cfg.tunnels
	head := "| figure |"
	sep := "|---|"
	for _, d := range doors {
		head += " " + d.label + " |"
		sep += "---|"
	}
	fmt.Fprintln(out)
	fmt.Fprintln(out, head)
	fmt.Fprintln(out, sep)
	row := func(figure string, f func(d *doorRun) string) {
		line := "| " + figure + " |"
		for _, d := range doors {
			line += " " + f(d) + " |"
		}
		fmt.Fprintln(out, line)
	}
	row(fmt.Sprintf("time until %d agents are connected (last agent's connection event; fleet seen by polling)", n), func(d *doorRun) string {
		if d.connectTime == 0 {
			return "–"
		}
		return fmt.Sprintf("%s (%s)", secs(d.connectTime), secs(d.connectPolled))
	})
	row("agents' failed connections (each one retried): total / agents that needed ≥ 2 retries / most by one agent", func(d *doorRun) string {
		if d.fleet.agents == 0 {
			return "–"
		}
		return fmt.Sprintf("%d / %d / %d", d.fleet.failures, d.fleet.retried2, d.fleet.maxFailures)
	})
	row(fmt.Sprintf("connections made in each %v from the start", curveStep), func(d *doorRun) string {
		if len(d.connectCurve) == 0 {
			return "–"
		}
		c := make([]string, len(d.connectCurve))
		for i, v := range d.connectCurve {
			c[i] = strconv.FormatInt(v, 10)
		}
		return strings.Join(c, " ")
	})
	row("CPU while they connected: server / agent simulators", func(d *doorRun) string {
		if d.connectTime == 0 {
			return "–"
		}
		return fmt.Sprintf("%.2f s / %.2f s", d.connectCPU, d.connectSimCPU)
	})
	row("server's refusals while they connected (agents_refused_total)", func(d *doorRun) string {
		if d.refused < 0 {
			return "not counted"
		}
		return fmt.Sprintf("%.0f", d.refused)
	})
	row(fmt.Sprintf("server RSS with 1 agent → %d agents", n), func(d *doorRun) string {
		return fmt.Sprintf("%s → %s", mibStr(d.rss1), mibStr(d.rssN))
	})
	row("server RSS per agent", func(d *doorRun) string {
		if d.rssN == 0 || n < 2 {
			return "–"
		}
		return kibStr(float64(d.rssN-d.rssPre) / float64(n-1))
	})
	row(fmt.Sprintf("server idle CPU over %s, %d agents / with tunnels held", cfg.idleCPU, n), func(d *doorRun) string {
		return fmt.Sprintf("%s / %s", pct(d.cpuN), pct(d.cpuM))
	})
	row("dial p50 / p99, 1 agent (× the reference)", func(d *doorRun) string { return latStr(d.lat1, d.ref1) })
	row(fmt.Sprintf("dial p50 / p99, %d agents (× the reference)", n), func(d *doorRun) string { return latStr(d.latN, d.refN) })
	row(fmt.Sprintf("dial p50 / p99, %d agents + tunnels held (× the reference)", n), func(d *doorRun) string { return latStr(d.latM, d.refM) })
	row("the reference's dial p50 / p99 (a server with 1 agent, dials interleaved with each row above)", func(d *doorRun) string {
		return fmt.Sprintf("%s; %s; %s", latStr(d.ref1, latency{}), latStr(d.refN, latency{}), latStr(d.refM, latency{}))
	})
	row(fmt.Sprintf("idle tunnels held (of %d requested), time to open them", m), func(d *doorRun) string {
		if d.heldWanted == 0 && m > 0 {
			return "–"
		}
		s := fmt.Sprintf("%d, %s", d.held, secs(d.openTime))
		if d.heldWhy != "" {
			s += " (" + d.heldWhy + ")"
		}
		return s
	})
	row("server RSS with agents + tunnels held", func(d *doorRun) string { return mibStr(d.rssM) })
	row("server RSS per idle tunnel", func(d *doorRun) string {
		if d.rssM == 0 || d.held == 0 {
			return "–"
		}
		return kibStr(float64(d.rssM-d.rssN) / float64(d.held))
	})
	row("server goroutines: 1 agent / agents / + tunnels", func(d *doorRun) string {
		return fmt.Sprintf("%.0f / %.0f / %.0f", d.g1, d.gN, d.gM)
	})
	row("agent simulators: processes; goroutines, RSS with agents / + tunnels", func(d *doorRun) string {
		return fmt.Sprintf("%d; %d, %s / %d, %s", len(d.sims), d.fleet.goroutines, mibStr(d.fleet.rssKiB), d.fleetM.goroutines, mibStr(d.fleetM.rssKiB))
	})
	row("echo destinations: processes, RSS with tunnels held", func(d *doorRun) string {
		return fmt.Sprintf("%d, %s", len(d.echoes), mibStr(d.echoRSS))
	})
	fmt.Fprintln(out)
	for _, d := range doors {
		if len(d.fleet.errors) > 0 {
			var kinds []string
			for k, n := range d.fleet.errors {
				kinds = append(kinds, fmt.Sprintf("%q %d×", k, n))
			}
			sort.Strings(kinds)
			fmt.Fprintf(out, "%s: agents' connection errors (the most frequent kind of each simulator, logged ones): %s\n", d.label, strings.Join(kinds, "; "))
		}
	}
	for _, d := range doors {
		if d.door == "grpc" && d.held > 0 {
			fmt.Fprintf(out, "gRPC door: the held tunnels are calls multiplexed on gRPC connections of up to %d calls; kube-apiserver's konnectivity-client opens a connection per tunnel, whose cost the figure per idle tunnel leaves out. The latency dials are made as kube-apiserver makes them (one connection each).\n", grpcStreamsPerConn)
			break
		}
	}
	var usims []string
	for _, d := range doors {
		if d.simRole == "upstream-agents" {
			usims = append(usims, d.label)
		}
	}
	if len(usims) > 0 {
		fmt.Fprintf(out, "%s: the agents speak upstream's agent protocol (gRPC AgentService/Connect, one TLS connection each) with this benchmark's code, grpc-go and konnectivity-client's packets, retrying as upstream's proxy-agent defaults pace it (1 s doubling to 10 s, jittered); upstream's agent code itself is not a dependency of the e2e module.\n", strings.Join(usims, ", "))
	}
}

func secs(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }

func mibStr(k int64) string {
	if k == 0 {
		return "–"
	}
	return fmt.Sprintf("%.1f MiB", float64(k)/1024)
}

func kibStr(k float64) string { return fmt.Sprintf("%.1f KiB", k) }

func pct(p float64) string {
	if p < 0 {
		return "–"
	}
	return fmt.Sprintf("%.1f %%", p)
}

func msStr(d time.Duration) string { return fmt.Sprintf("%.2f", float64(d)/float64(time.Millisecond)) }

// latStr is "p50 / p99 ms", with ratios to base when base is measured.
func latStr(l, base latency) string {
	if l.n == 0 {
		return "–"
	}
	s := fmt.Sprintf("%s / %s ms", msStr(l.p50), msStr(l.p99))
	if base.n > 0 && base.p50 > 0 && base.p99 > 0 {
		s += fmt.Sprintf(" (%.2f× / %.2f×)", float64(l.p50)/float64(base.p50), float64(l.p99)/float64(base.p99))
	}
	return s
}
