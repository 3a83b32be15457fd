package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/server"
)

// runStatus prints a server's or an agent's /debug/tunnels as a table, so
// an operator on the node sees the fan-out at a glance.
func runStatus(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("konnectivity status", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("admin-address", "", "admin address of a server or agent (default: try 127.0.0.1:8095, then 127.0.0.1:8094)")
	asJSON := fs.Bool("json", false, "print the raw JSON")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	addrs := []string{*addr}
	if *addr == "" {
		addrs = []string{"127.0.0.1:8095", "127.0.0.1:8094"}
	}
	var body []byte
	var err error
	for _, a := range addrs {
		if body, err = fetchStatus(a); err == nil {
			break
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "konnectivity status: %v\n", err)
		return 1
	}
	if *asJSON {
		stdout.Write(body)
		return 0
	}
	if err := printStatus(stdout, body, time.Now()); err != nil {
		fmt.Fprintf(stderr, "konnectivity status: %v\n", err)
		return 1
	}
	return 0
}

func fetchStatus(addr string) ([]byte, error) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + addr + "/debug/tunnels")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s/debug/tunnels: %s", addr, resp.Status)
	}
	return io.ReadAll(io.LimitReader(resp.Body, 16<<20))
}

func printStatus(w io.Writer, body []byte, now time.Time) error {
	var role struct{ Role string }
	if err := json.Unmarshal(body, &role); err != nil {
		return fmt.Errorf("decode status: %w", err)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	defer tw.Flush()
	switch role.Role {
	case "server":
		var st server.Status
		if err := json.Unmarshal(body, &st); err != nil {
			return fmt.Errorf("decode server status: %w", err)
		}
		fmt.Fprintf(tw, "server %s (server count %d): %d agent(s)\n", st.ServerID, st.ServerCount, len(st.Agents))
		fmt.Fprintf(tw, "tunnels: %s\n", countsLine(st.Tunnels))
		if r := st.Restarts; r != nil {
			fmt.Fprintf(tw, "restarts: tunnels handed to the next image: %s; taken from the previous one: %s\n", countsLine(r.Paused), countsLine(r.Resumed))
		}
		fmt.Fprintln(tw, "AGENT\tREMOTE\tCONNECTED\tTUNNELS\tTO AGENT\tFROM AGENT\tDRAINING\tNODE\tIDENTIFIERS")
		for _, a := range st.Agents {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\n", a.ID, a.Remote, age(now, a.Since), a.OpenStreams,
				bytesHuman(a.BytesToAgent), bytesHuman(a.BytesFromAgent), yesNo(a.Draining), dashIfEmpty(a.Node), dashIfEmpty(a.Identifiers))
		}
	case "agent":
		var st agent.Status
		if err := json.Unmarshal(body, &st); err != nil {
			return fmt.Errorf("decode agent status: %w", err)
		}
		fmt.Fprintf(tw, "agent %s: connected %d/%d servers, %d open tunnel(s)\n", st.AgentID, st.Held, st.Want, st.OpenStreams)
		fmt.Fprintln(tw, "SERVER\tADDRESS\tCONNECTED\tSERVER COUNT\tTUNNELS")
		for _, l := range st.Servers {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\n", l.ServerID, l.Addr, age(now, l.Since), l.Count, l.OpenStreams)
		}
	default:
		return fmt.Errorf("unknown status role %q", role.Role)
	}
	return nil
}

// countsLine writes counts by key, in the keys' order: "0 draining, 3 open".
func countsLine[V int | uint64](counts map[string]V) string {
	parts := make([]string, 0, len(counts))
	for _, k := range slices.Sorted(maps.Keys(counts)) {
		parts = append(parts, fmt.Sprintf("%d %s", counts[k], k))
	}
	return strings.Join(parts, ", ")
}

func age(now, since time.Time) string {
	d := now.Sub(since)
	switch {
	case d < time.Minute:
		return d.Round(time.Second).String()
	case d < time.Hour:
		return d.Round(time.Minute).String()
	}
	return d.Round(time.Hour).String()
}

func bytesHuman(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func dashIfEmpty(s string) string {
	if strings.TrimSpace(s) == "" {
		return "-"
	}
	return s
}
