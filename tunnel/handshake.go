package tunnel

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// The agent's Upgrade request and the server's answer. Everything the two
// sides need to know about each other travels here, once per connection.
const (
	handshakePath     = "/konnectivity/v1/tunnel"
	upgradeToken      = "konnectivity-h2"
	hdrAgentID        = "Konnectivity-Agent-Id"
	hdrIdentifiers    = "Konnectivity-Agent-Identifiers"
	hdrHeldServers    = "Konnectivity-Held-Servers"
	hdrServerID       = "Konnectivity-Server-Id"
	hdrServerCount    = "Konnectivity-Server-Count"
	hdrFeatures       = "Konnectivity-Agent-Features"  // what the agent can do beyond tunnels, comma-separated
	featurePause      = "pause"                        // it answers pausePath and resumes paused tunnels (handover.go)
	hdrServerFeatures = "Konnectivity-Server-Features" // what the server can do beyond tunnels, comma-separated
	// featureAgentRestart: the server understands controlRestartIn, pausing
	// the agent's tunnels for its next image (agent_restart.go).
	featureAgentRestart = "agent-restart"
	maxHandshakeHead    = 16 << 10
	maxIDLen            = 256
)

// hdrRetryAfterMs is the agent port's answer to a connection refused at the
// unadmitted limit, written in plain text before any TLS: when to come
// back, in milliseconds (Retry-After beside it has whole seconds, for other
// clients). The server spaces these so a fleet's retries arrive no faster
// than it admits; the agent reads it from the bytes its TLS handshake got.
const hdrRetryAfterMs = "Konnectivity-Retry-After-Ms"

// Bounds on that delay: not sooner than a handshake can start again, and
// never so long that an agent stays away for long.
const (
	minRetryAfter = 10 * time.Millisecond
	maxRetryAfter = 2 * time.Minute
)

// retryAfterHeader reads hdrRetryAfterMs, within its bounds; 0 if absent.
func retryAfterHeader(h http.Header) time.Duration {
	ms, err := strconv.ParseInt(h.Get(hdrRetryAfterMs), 10, 64)
	if err != nil || ms <= 0 {
		return 0
	}
	return min(time.Duration(ms)*time.Millisecond, maxRetryAfter)
}

// What the server asks an agent, on the agent's link, when a restart
// moves a tunnel (handover.go has the protocol; agent_pause.go the
// agent's half), and the token that names the destination the agent holds
// for it.
const (
	pausePath      = "/konnectivity/v1/pause"
	hdrPauseStream = "Konnectivity-Pause-Stream" // the tunnel's stream ID
	hdrPauseSent   = "Konnectivity-Pause-Sent"   // bytes the sender sent on the tunnel
	hdrResumeToken = "Konnectivity-Resume-Token" // names a paused tunnel
	// hdrAgentRestarting marks an agent's refusal of a resume while it
	// restarts in place: it keeps the destination for its next image.
	hdrAgentRestarting = "Konnectivity-Agent-Restarting"
	maxResumeToken     = 64
)

// The control line an agent sends a rotated token on: "token <jwt>".
const controlToken = "token"

// maxControlLine bounds one control line (a token is at most 64 KiB).
const maxControlLine = 64<<10 + 64

// agentHello is what an agent says about itself when it connects.
type agentHello struct {
	ID          string
	Claimed     string // the ID the agent asked for, when admit gave it another (checkIdentity)
	Identifiers string
	Held        []string // server IDs the agent already holds a connection to
	Token       string   // bearer token, if any; never logged
	CanPause    bool     // it named featurePause
}

func validID(id string) error {
	if id == "" {
		return fmt.Errorf("empty ID")
	}
	if len(id) > maxIDLen {
		return fmt.Errorf("ID longer than %d bytes", maxIDLen)
	}
	for _, c := range id {
		if c <= ' ' || c == 0x7f || c == ',' {
			return fmt.Errorf("ID %q has a space, comma or control character", id)
		}
	}
	return nil
}

func writeHello(w io.Writer, host string, h agentHello) error {
	var b strings.Builder
	fmt.Fprintf(&b, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: %s\r\n", handshakePath, host, upgradeToken)
	fmt.Fprintf(&b, "%s: %s\r\n", hdrAgentID, h.ID)
	if h.Identifiers != "" {
		fmt.Fprintf(&b, "%s: %s\r\n", hdrIdentifiers, h.Identifiers)
	}
	if len(h.Held) > 0 {
		fmt.Fprintf(&b, "%s: %s\r\n", hdrHeldServers, strings.Join(h.Held, ","))
	}
	if h.CanPause {
		fmt.Fprintf(&b, "%s: %s\r\n", hdrFeatures, featurePause)
	}
	if h.Token != "" {
		fmt.Fprintf(&b, "Authorization: Bearer %s\r\n", h.Token)
	}
	b.WriteString("\r\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// readHello parses an agent's Upgrade request. Errors are *StatusError.
func readHello(br *bufio.Reader) (agentHello, error) {
	var h agentHello
	req, err := http.ReadRequest(br)
	if err != nil {
		// No detail from the parser: its text quotes request bytes, which
		// could include a bearer token.
		return h, statusErrorf(http.StatusBadRequest, "malformed handshake request")
	}
	if req.Method != http.MethodGet || req.URL.Path != handshakePath {
		return h, statusErrorf(http.StatusNotFound, "not a konnectivity agent handshake (%s %s)", req.Method, cleanErr(fmt.Errorf("%s", req.URL.Path)))
	}
	if !strings.EqualFold(req.Header.Get("Upgrade"), upgradeToken) {
		return h, statusErrorf(http.StatusUpgradeRequired, "want Upgrade: %s", upgradeToken)
	}
	h.ID = req.Header.Get(hdrAgentID)
	if err := validID(h.ID); err != nil {
		return h, statusErrorf(http.StatusBadRequest, "agent %v", err)
	}
	h.Identifiers = req.Header.Get(hdrIdentifiers)
	if held := req.Header.Get(hdrHeldServers); held != "" {
		h.Held = strings.Split(held, ",")
	}
	for _, f := range strings.Split(req.Header.Get(hdrFeatures), ",") {
		h.CanPause = h.CanPause || strings.TrimSpace(f) == featurePause
	}
	if auth := req.Header.Get("Authorization"); auth != "" {
		token, ok := strings.CutPrefix(auth, "Bearer ")
		if !ok || strings.TrimSpace(token) == "" {
			return h, statusErrorf(http.StatusUnauthorized, "Authorization header is not a bearer token")
		}
		h.Token = strings.TrimSpace(token)
	}
	return h, nil
}

// switching is the server's answer that admits an agent.
func switching(serverID string, count int) []byte {
	return fmt.Appendf(nil, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n%s: %s\r\n%s: %d\r\n%s: %s\r\n\r\n",
		upgradeToken, hdrServerID, serverID, hdrServerCount, count, hdrServerFeatures, featureAgentRestart)
}

func writeSwitching(w io.Writer, serverID string, count int) error {
	_, err := w.Write(switching(serverID, count))
	return err
}

// serverReply is what the agent learns from the server's answer.
type serverReply struct {
	ServerID     string
	Count        int
	AgentRestart bool // it named featureAgentRestart
}

// readReply reads the server's answer. A refusal comes back as a *StatusError
// whose message is the server's text body.
func readReply(br *bufio.Reader) (serverReply, error) {
	var r serverReply
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return r, fmt.Errorf("read handshake answer: %w", err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		resp.Body.Close()
		r.ServerID = resp.Header.Get(hdrServerID)
		return r, &StatusError{Code: resp.StatusCode, Msg: cleanErr(fmt.Errorf("%s", strings.TrimSpace(string(body)))), RetryAfter: retryAfterHeader(resp.Header)}
	}
	r.ServerID = resp.Header.Get(hdrServerID)
	if err := validID(r.ServerID); err != nil {
		return r, fmt.Errorf("server %v", err)
	}
	r.Count, err = strconv.Atoi(resp.Header.Get(hdrServerCount))
	if err != nil || r.Count < 1 {
		r.Count = 1
	}
	for _, f := range strings.Split(resp.Header.Get(hdrServerFeatures), ",") {
		r.AgentRestart = r.AgentRestart || strings.TrimSpace(f) == featureAgentRestart
	}
	return r, nil
}

// The control stream: the server opens it right after the handshake and
// the agent writes one line per event on it. A drain is two lines:
// "drain-in <duration>" (when the agent cuts what is left; a server that
// does not know the line ignores it) and then "drain". A drain for a
// restart in place is preceded by "restart-in <duration>", sent only to a
// server that named featureAgentRestart: the server pauses the agent's
// tunnels for its next image before the drain takes the rest.
const (
	controlPath      = "/konnectivity/v1/control"
	controlDrain     = "drain"
	controlDrainIn   = "drain-in"
	controlRestartIn = "restart-in"
	// maxDrainIn bounds the time a drain-in line may announce.
	maxDrainIn = time.Hour
)

// ourHello is this agent's hello: it names every feature this package has.
func ourHello(id, identifiers string, held []string) agentHello {
	return agentHello{ID: id, Identifiers: identifiers, Held: held, CanPause: true}
}
