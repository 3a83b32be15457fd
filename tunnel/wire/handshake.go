package wire

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
	HandshakePath       = "/konnectivity/v1/tunnel"
	UpgradeToken        = "konnectivity-h2"
	HdrAgentID          = "Konnectivity-Agent-Id"
	hdrIdentifiers      = "Konnectivity-Agent-Identifiers"
	HdrConnectedServers = "Konnectivity-Held-Servers" // the servers the agent is connected to (the name servers of every version read)
	HdrServerID         = "Konnectivity-Server-Id"
	HdrServerCount      = "Konnectivity-Server-Count"
	hdrFeatures         = "Konnectivity-Agent-Features"  // what the agent can do beyond tunnels, comma-separated
	featurePause        = "pause"                        // it answers PausePath and resumes paused tunnels (handover.go)
	hdrServerFeatures   = "Konnectivity-Server-Features" // what the server can do beyond tunnels, comma-separated
	// featureAgentRestart: the server understands ControlRestartIn, pausing
	// the agent's tunnels for its next image (agent_restart.go).
	featureAgentRestart = "agent-restart"
	MaxHandshakeHead    = 16 << 10
	maxIDLen            = 256
)

// HdrRetryAfterMs is the agent port's answer to a connection refused at the
// unadmitted limit, written in plain text before any TLS: when to come
// back, in milliseconds (Retry-After beside it has whole seconds, for other
// clients). The server spaces these so a fleet's retries arrive no faster
// than it admits; the agent reads it from the bytes its TLS handshake got.
const HdrRetryAfterMs = "Konnectivity-Retry-After-Ms"

// Bounds on that delay: not sooner than a handshake can start again, and
// never so long that an agent stays away for long.
const (
	MinRetryAfter = 10 * time.Millisecond
	MaxRetryAfter = 2 * time.Minute
)

// RetryAfterHeader reads HdrRetryAfterMs, within its bounds; 0 if absent.
func RetryAfterHeader(h http.Header) time.Duration {
	ms, err := strconv.ParseInt(h.Get(HdrRetryAfterMs), 10, 64)
	if err != nil || ms <= 0 {
		return 0
	}
	return min(time.Duration(ms)*time.Millisecond, MaxRetryAfter)
}

// What the server asks an agent, on the agent's link, when a restart
// moves a tunnel (handover.go has the protocol; agent_pause.go the
// agent's half), and the token that names the destination the agent holds
// for it.
const (
	PausePath      = "/konnectivity/v1/pause"
	HdrPauseStream = "Konnectivity-Pause-Stream" // the tunnel's stream ID
	HdrPauseSent   = "Konnectivity-Pause-Sent"   // bytes the sender sent on the tunnel
	HdrResumeToken = "Konnectivity-Resume-Token" // names a paused tunnel
	// HdrAgentRestarting marks an agent's refusal of a resume while it
	// restarts in place: it keeps the destination for its next image.
	HdrAgentRestarting = "Konnectivity-Agent-Restarting"
	MaxResumeToken     = 64
)

// The control line an agent sends a rotated token on: "token <jwt>".
const ControlToken = "token"

// MaxControlLine bounds one control line (a token is at most 64 KiB).
const MaxControlLine = 64<<10 + 64

// AgentHello is what an agent says about itself when it connects.
type AgentHello struct {
	ID          string
	Claimed     string // the ID the agent asked for, when admit gave it another (checkIdentity)
	Identifiers string
	Connected   []string // server IDs the agent is already connected to
	Token       string   // bearer token, if any; never logged
	CanPause    bool     // it named featurePause
}

func ValidID(id string) error {
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

func WriteHello(w io.Writer, host string, h AgentHello) error {
	var b strings.Builder
	fmt.Fprintf(&b, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: %s\r\n", HandshakePath, host, UpgradeToken)
	fmt.Fprintf(&b, "%s: %s\r\n", HdrAgentID, h.ID)
	if h.Identifiers != "" {
		fmt.Fprintf(&b, "%s: %s\r\n", hdrIdentifiers, h.Identifiers)
	}
	if len(h.Connected) > 0 {
		fmt.Fprintf(&b, "%s: %s\r\n", HdrConnectedServers, strings.Join(h.Connected, ","))
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

// ReadHello parses an agent's Upgrade request. Errors are *StatusError.
func ReadHello(br *bufio.Reader) (AgentHello, error) {
	var h AgentHello
	req, err := http.ReadRequest(br)
	if err != nil {
		// No detail from the parser: its text quotes request bytes, which
		// could include a bearer token.
		return h, StatusErrorf(http.StatusBadRequest, "malformed handshake request")
	}
	if req.Method != http.MethodGet || req.URL.Path != HandshakePath {
		return h, StatusErrorf(http.StatusNotFound, "not a konnectivity agent handshake (%s %s)", req.Method, CleanErr(fmt.Errorf("%s", req.URL.Path)))
	}
	if !strings.EqualFold(req.Header.Get("Upgrade"), UpgradeToken) {
		return h, StatusErrorf(http.StatusUpgradeRequired, "want Upgrade: %s", UpgradeToken)
	}
	h.ID = req.Header.Get(HdrAgentID)
	if err := ValidID(h.ID); err != nil {
		return h, StatusErrorf(http.StatusBadRequest, "agent %v", err)
	}
	h.Identifiers = req.Header.Get(hdrIdentifiers)
	if ids := req.Header.Get(HdrConnectedServers); ids != "" {
		h.Connected = strings.Split(ids, ",")
	}
	for _, f := range strings.Split(req.Header.Get(hdrFeatures), ",") {
		h.CanPause = h.CanPause || strings.TrimSpace(f) == featurePause
	}
	if auth := req.Header.Get("Authorization"); auth != "" {
		token, ok := strings.CutPrefix(auth, "Bearer ")
		if !ok || strings.TrimSpace(token) == "" {
			return h, StatusErrorf(http.StatusUnauthorized, "Authorization header is not a bearer token")
		}
		h.Token = strings.TrimSpace(token)
	}
	return h, nil
}

// Switching is the server's answer that admits an agent.
func Switching(serverID string, count int) []byte {
	return fmt.Appendf(nil, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n%s: %s\r\n%s: %d\r\n%s: %s\r\n\r\n",
		UpgradeToken, HdrServerID, serverID, HdrServerCount, count, hdrServerFeatures, featureAgentRestart)
}

// ServerReply is what the agent learns from the server's answer.
type ServerReply struct {
	ServerID     string
	Count        int
	AgentRestart bool // it named featureAgentRestart
}

// ReadReply reads the server's answer. A refusal comes back as a *StatusError
// whose message is the server's text body.
func ReadReply(br *bufio.Reader) (ServerReply, error) {
	var r ServerReply
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return r, fmt.Errorf("read handshake answer: %w", err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		resp.Body.Close()
		r.ServerID = resp.Header.Get(HdrServerID)
		return r, &StatusError{Code: resp.StatusCode, Msg: CleanErr(fmt.Errorf("%s", strings.TrimSpace(string(body)))), RetryAfter: RetryAfterHeader(resp.Header)}
	}
	r.ServerID = resp.Header.Get(HdrServerID)
	if err := ValidID(r.ServerID); err != nil {
		return r, fmt.Errorf("server %v", err)
	}
	r.Count, err = strconv.Atoi(resp.Header.Get(HdrServerCount))
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
	ControlPath      = "/konnectivity/v1/control"
	ControlDrain     = "drain"
	ControlDrainIn   = "drain-in"
	ControlRestartIn = "restart-in"
	// MaxDrainIn bounds the time a drain-in line may announce.
	MaxDrainIn = time.Hour
)

// GoAwayReplaced is the debug data of the GOAWAY with which a server ends
// an agent's connection because another login of the same agent ID took
// its place. An agent that did not make that login itself is one of two
// processes sharing an ID (a cloned node): it waits, backing off, before
// it logs in again (docs/agent.md#one-id-one-process).
const GoAwayReplaced = "replaced by another connection of this agent ID"

// OurHello is this agent's hello: it names every feature this package has.
func OurHello(id, identifiers string, connected []string) AgentHello {
	return AgentHello{ID: id, Identifiers: identifiers, Connected: connected, CanPause: true}
}

// ResumeWindow is how long a paused destination connection waits for its
// tunnel to resume: long enough for a server to re-execute and the agent to
// log in again (about a second), short enough that a server that never
// comes back does not hold a kubelet's or webhook's connection for long.
const ResumeWindow = 30 * time.Second
