package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/server"
	"github.com/spinifex/konnectivity/tunnel/wire"
)

// defaultAdminAddrs are where `konnectivity status` looks without
// --admin-address: the server's admin port as the Kubernetes docs, the
// OpenRC service and the static pod set it (8133) and as upstream's default
// (8095), and the agent's (8094, upstream's default and the DaemonSet's).
var defaultAdminAddrs = []string{"127.0.0.1:8133", "127.0.0.1:8095", "127.0.0.1:8094"}

// runStatus prints a server's or an agent's /debug/tunnels as a table, so
// an operator on the node sees the fan-out at a glance. Without
// --admin-address it shows every server and agent found on the default
// admin ports (a control-plane node runs both), each under the address it
// came from.
func runStatus(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("konnectivity status")
	addr := fs.String("admin-address", "", "admin address of a server or agent (default: each of "+strings.Join(defaultAdminAddrs, ", ")+" that answers)")
	asJSON := fs.Bool("json", false, "print the raw JSON (of the first one found)")
	if code, done := parseFlags(fs, args, stdout, stderr); done {
		return code
	}
	addrs := []string{*addr}
	if *addr == "" {
		addrs = defaultAdminAddrs
	}
	var failed []string
	shown := 0
	for _, a := range addrs {
		body, err := fetchStatus(a)
		if err != nil {
			failed = append(failed, err.Error())
			continue
		}
		if *asJSON {
			stdout.Write(body)
			return 0
		}
		if shown > 0 {
			fmt.Fprintln(stdout)
		}
		if err := printStatus(stdout, a, body, time.Now()); err != nil {
			failed = append(failed, fmt.Sprintf("%s: %v", a, err))
			continue
		}
		shown++
	}
	if shown == 0 {
		hint := ""
		if *addr == "" {
			hint = " (--admin-address names another admin port)"
		}
		fmt.Fprintf(stderr, "konnectivity status: no server or agent answers%s: %s\n", hint, strings.Join(failed, "; "))
		return 1
	}
	return 0
}

func fetchStatus(addr string) ([]byte, error) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + addr + "/debug/tunnels")
	if errors.Is(err, syscall.ECONNREFUSED) {
		return nil, fmt.Errorf("%s: nothing listens", addr)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s/debug/tunnels: %s (not a konnectivity admin port?)", addr, resp.Status)
	}
	return io.ReadAll(io.LimitReader(resp.Body, 16<<20))
}

// printStatus writes the status body from the admin port at addr, under
// a line naming what answered there.
func printStatus(w io.Writer, addr string, body []byte, now time.Time) error {
	var role struct{ Role string }
	if err := json.Unmarshal(body, &role); err != nil {
		return fmt.Errorf("not a konnectivity status: %w", err)
	}
	if role.Role != "server" && role.Role != "agent" {
		return fmt.Errorf("unknown status role %q", role.Role)
	}
	fmt.Fprintf(w, "the %s on %s:\n", role.Role, addr)
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
		fmt.Fprintln(tw, "AGENT\tREMOTE\tCONNECTED\tTUNNELS\tTO AGENT\tFROM AGENT\tDRAINING\tSTALLS\tWAITING\tNODE\tIDENTIFIERS")
		for _, a := range st.Agents {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", a.ID, a.Remote, age(now, a.Since), a.OpenStreams,
				bytesHuman(a.BytesToAgent), bytesHuman(a.BytesFromAgent), yesNo(a.Draining), a.CreditStalls, waiting(a.SendWaiting, a.SendWaits),
				dashIfEmpty(a.Node), dashIfEmpty(a.Identifiers))
		}
	case "agent":
		var st agent.Status
		if err := json.Unmarshal(body, &st); err != nil {
			return fmt.Errorf("decode agent status: %w", err)
		}
		fmt.Fprintf(tw, "agent %s: connected %d/%d servers, %d open tunnel(s)\n", st.AgentID, st.Connected, st.Want, st.OpenStreams)
		fmt.Fprintln(tw, "SERVER\tADDRESS\tCONNECTED\tSERVER COUNT\tTUNNELS\tSTALLS\tWAITING")
		for _, l := range st.Servers {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%s\n", l.ServerID, l.Addr, age(now, l.Since), l.Count, l.OpenStreams,
				l.CreditStalls, waiting(l.SendWaiting, l.SendWaits))
		}
	}
	return nil
}

// waiting writes a link's tunnels waiting for send credit: how many, and
// the longest wait and what it waits for ("2 (longest 12s, connection)").
func waiting(n int, longest []wire.SendWait) string {
	if n == 0 {
		return "-"
	}
	if len(longest) == 0 {
		return strconv.Itoa(n)
	}
	w := longest[0]
	return fmt.Sprintf("%d (longest %s, %s)", n, (time.Duration(w.Seconds * float64(time.Second))).Round(time.Second), w.For)
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
