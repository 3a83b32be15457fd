package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
)

// A restart is refused, and this image keeps serving, unless the next
// image would start: its executable is there and runnable (restartTarget),
// the configuration it will read (flags, certificates, keys, CA bundles,
// kubeconfig) loads in a check run by the new executable itself
// (checkNext), every certificate it would present is inside its validity
// (peers refuse it otherwise, and the running image's peers are lost on
// the way: CheckExitCertificate), and the descriptors the handover needs
// are there. Only then does anything stop.

// checkTimeout bounds the next image's configuration check.
const checkTimeout = 10 * time.Second

// maxCheckOutput bounds what the check may print that is saved.
const maxCheckOutput = 16 << 10

// CheckExitCertificate is the exit status of a command's check when its
// configuration loads but a certificate it would present (a listener's
// pair, an agent's client pair) is expired or not yet valid, and the next
// image would not mint a fresh one: peers would refuse it.
const CheckExitCertificate = 3

// errCertificate marks a check that failed with CheckExitCertificate.
var errCertificate = errors.New("the next image would present a certificate its peers refuse")

// Reasons a restart is refused, the label of restarts_refused_total.
const (
	refusedTarget  = "executable"  // missing or not executable
	refusedCheck   = "config"      // the next image's configuration does not load
	refusedSockets = "sockets"     // the listeners or the socket list could not be prepared
	refusedCert    = "certificate" // the next image would present a certificate out of its validity
)

// countRefusals registers restarts_refused_total, by reason, in w's
// registry.
func (d *Daemon) countRefusals(w Work) {
	if w.Metrics == nil {
		return
	}
	d.refused = map[string]*promtext.Counter{}
	for _, r := range []string{refusedTarget, refusedCheck, refusedCert, refusedSockets} {
		d.refused[r] = w.Metrics.Counter(w.MetricPrefix+"restarts_refused_total", "Restarts (SIGHUP, a replaced executable) refused before anything stopped, by reason: executable (missing or not executable), config (the next image's configuration does not load), certificate (it would present a certificate that is expired or not yet valid), sockets (no descriptor for the handover).", []string{"reason"}, r)
	}
}

// restartPlan is what a restart needs once the command has drained.
type restartPlan struct {
	exe       string
	listeners string          // the environment entry naming the listeners
	files     *nextImageFiles // where the handed sockets and the state are written
}

// prepareRestart checks that the next image would start and prepares what
// it inherits; when any of that fails the restart is refused (logged and
// counted) and nothing has stopped.
func (d *Daemon) prepareRestart(why string, w Work) (*restartPlan, bool) {
	refuse := func(reason string, err error) (*restartPlan, bool) {
		d.log.Error("restart refused; still serving", "trigger", why, "reason", reason, "err", err)
		if c := d.refused[reason]; c != nil {
			c.Inc()
		}
		return nil, false
	}
	exe, err := restartTarget()
	if err != nil {
		return refuse(refusedTarget, err)
	}
	if w.Check != nil {
		if err := checkNext(exe, w.Check); errors.Is(err, errCertificate) {
			return refuse(refusedCert, err)
		} else if err != nil {
			return refuse(refusedCheck, err)
		}
	}
	files, err := newNextImageFiles()
	if err != nil {
		return refuse(refusedSockets, err)
	}
	env, err := d.listeners.handOver()
	if err != nil {
		files.discard()
		return refuse(refusedSockets, err)
	}
	return &restartPlan{exe: exe, listeners: env, files: files}, true
}

// checkNext runs exe with args (the command's check mode: the next
// image's flags, loaded as its start would load them, serving nothing) and
// returns its complaint when it fails. An executable too old to know the
// check mode is not refused for it: it says so and exits 2.
func checkNext(exe string, args []string) error {
	ctx, cancel := context.WithTimeout(context.Background(), checkTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, exe)
	cmd.Args = append([]string{"konnectivity"}, args...) // argv[0] is no alias: args name the command
	out := &capped{max: maxCheckOutput}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.WaitDelay = time.Second
	err := cmd.Run()
	if err == nil {
		return nil
	}
	text := strings.TrimSpace(out.String())
	var exit *exec.ExitError
	if errors.As(err, &exit) && exit.ExitCode() == 2 && strings.Contains(text, fmt.Sprintf("unknown command %q", args[0])) {
		return nil
	}
	if ctx.Err() != nil {
		err = fmt.Errorf("no answer within %s", checkTimeout)
	} else if errors.As(err, &exit) && exit.ExitCode() == CheckExitCertificate {
		return fmt.Errorf("%w: %s", errCertificate, lastLine(text))
	}
	if text == "" {
		return fmt.Errorf("the next image's configuration check failed: %w", err)
	}
	return fmt.Errorf("the next image's configuration check failed (%v): %s", err, lastLine(text))
}

// lastLine is the line that says why a check failed: its last.
func lastLine(s string) string {
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}

// capped keeps the first max bytes written to it.
type capped struct {
	bytes.Buffer
	max int
}

func (c *capped) Write(p []byte) (int, error) {
	if room := c.max - c.Len(); room > 0 {
		c.Buffer.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}
