package lease

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeapi"
	"github.com/spinifex/konnectivity/internal/kubeclient"
)

// Bounds on what the apiserver may send: a Lease is a few hundred bytes, so
// these are generous and still keep a broken or hostile endpoint from
// exhausting memory.
const (
	maxObjectSize = 1 << 20  // one Lease, one Status, one watch event
	maxListSize   = 16 << 20 // one LeaseList
)

// Client reads and writes Leases in one namespace.
type Client struct {
	api       *kubeclient.Client
	base      string // the path of the namespace's Leases: .../namespaces/<ns>/leases
	namespace string
}

// NewClient returns a client for the Leases of namespace on the apiserver
// cfg describes. Credentials come from cfg on every request (a token file is
// re-read, so a rotated ServiceAccount token is used).
func NewClient(cfg *kubeclient.Config, namespace string) (*Client, error) {
	if cfg == nil {
		return nil, errors.New("lease client: no apiserver config")
	}
	if err := CheckName(namespace, ""); err != nil {
		return nil, err
	}
	return &Client{
		api:       kubeclient.New(cfg),
		base:      "/apis/coordination.k8s.io/v1/namespaces/" + namespace + "/leases",
		namespace: namespace,
	}, nil
}

// Namespace is the namespace the client works in.
func (c *Client) Namespace() string { return c.namespace }

// do sends one request and returns the body of a 2xx answer, read up to
// limit bytes; any other answer is a *kubeapi.Error.
func (c *Client) do(ctx context.Context, method, path string, body []byte, limit int64) ([]byte, error) {
	data, err := c.api.Call(ctx, method, path, body, limit)
	if err != nil {
		return nil, fmt.Errorf("%s leases: %w", method, err)
	}
	return data, nil
}

func (c *Client) objectPath(name string) string { return c.base + "/" + url.PathEscape(name) }

// Get returns the named Lease.
func (c *Client) Get(ctx context.Context, name string) (*Lease, error) {
	data, err := c.do(ctx, http.MethodGet, c.objectPath(name), nil, maxObjectSize)
	if err != nil {
		return nil, err
	}
	return decodeLease(data)
}

// Create creates l and returns the stored Lease.
func (c *Client) Create(ctx context.Context, l *Lease) (*Lease, error) {
	return c.write(ctx, http.MethodPost, c.base, l)
}

// Update replaces l; it fails with 409 Conflict when the stored Lease is no
// longer at l.ResourceVersion.
func (c *Client) Update(ctx context.Context, l *Lease) (*Lease, error) {
	return c.write(ctx, http.MethodPut, c.objectPath(l.Name), l)
}

// write sends l with method to path and returns the Lease the apiserver
// stored.
func (c *Client) write(ctx context.Context, method, path string, l *Lease) (*Lease, error) {
	body, err := l.encode()
	if err != nil {
		return nil, err
	}
	data, err := c.do(ctx, method, path, body, maxObjectSize)
	if err != nil {
		return nil, err
	}
	return decodeLease(data)
}

// Delete deletes the named Lease. A non-empty resourceVersion is a
// precondition: the Lease is deleted only if it was not changed since (a
// renewal in between makes it 409 Conflict).
func (c *Client) Delete(ctx context.Context, name, resourceVersion string) error {
	var body []byte
	if resourceVersion != "" {
		body, _ = json.Marshal(map[string]any{
			"apiVersion":    "v1",
			"kind":          "DeleteOptions",
			"preconditions": map[string]string{"resourceVersion": resourceVersion},
		})
	}
	_, err := c.do(ctx, http.MethodDelete, c.objectPath(name), body, maxObjectSize)
	return err
}

// List returns the Leases matching selector and the list's resourceVersion,
// from which a watch continues.
func (c *Client) List(ctx context.Context, selector string) ([]*Lease, string, error) {
	q := url.Values{}
	if selector != "" {
		q.Set("labelSelector", selector)
	}
	path := c.base
	if len(q) > 0 {
		path += "?" + q.Encode()
	}
	data, err := c.do(ctx, http.MethodGet, path, nil, maxListSize)
	if err != nil {
		return nil, "", err
	}
	var list struct {
		Metadata struct {
			ResourceVersion string `json:"resourceVersion"`
		} `json:"metadata"`
		Items []json.RawMessage `json:"items"`
	}
	if err := json.Unmarshal(data, &list); err != nil {
		return nil, "", fmt.Errorf("decode LeaseList: %w", err)
	}
	leases := make([]*Lease, 0, len(list.Items))
	for _, item := range list.Items {
		l, err := decodeLease(item)
		if err != nil {
			return nil, "", err
		}
		leases = append(leases, l)
	}
	return leases, list.Metadata.ResourceVersion, nil
}

// Event is one watch event. Type is ADDED, MODIFIED, DELETED or BOOKMARK;
// Lease is nil for a BOOKMARK, which only carries ResourceVersion.
type Event struct {
	Type            string
	Lease           *Lease
	ResourceVersion string
}

// Watch streams changes to the Leases matching selector after
// resourceVersion, for at most timeout (the apiserver ends the watch then).
// Events arrive on the returned channel, which is closed when the watch ends;
// after that, the error function says why (nil for a normal end, an
// *kubeapi.Error with code 410 when resourceVersion is too old and the caller
// must list again). Cancelling ctx ends the watch.
func (c *Client) Watch(ctx context.Context, selector, resourceVersion string, timeout time.Duration) (<-chan Event, func() error, error) {
	q := url.Values{}
	q.Set("watch", "true")
	q.Set("allowWatchBookmarks", "true")
	if selector != "" {
		q.Set("labelSelector", selector)
	}
	if resourceVersion != "" {
		q.Set("resourceVersion", resourceVersion)
	}
	q.Set("timeoutSeconds", strconv.Itoa(int(timeout/time.Second)))
	// The apiserver ends the watch at timeout; the client deadline is a
	// backstop against one that never does.
	wctx, cancel := context.WithTimeout(ctx, timeout+30*time.Second)
	resp, err := c.api.Do(wctx, http.MethodGet, c.base+"?"+q.Encode(), nil)
	if err != nil {
		cancel()
		return nil, nil, fmt.Errorf("watch leases: %w", err)
	}
	events := make(chan Event)
	var werr error // written by the reader goroutine before it closes events
	go func() {
		defer close(events)
		defer cancel()
		defer resp.Body.Close()
		werr = readEvents(wctx, resp.Body, events)
	}()
	return events, func() error { return werr }, nil
}

// readEvents decodes watch events from body until it ends. Each event may
// take at most maxObjectSize bytes.
func readEvents(ctx context.Context, body io.Reader, out chan<- Event) error {
	br := kubeapi.NewBoundedReader(body, maxObjectSize)
	dec := json.NewDecoder(br)
	for {
		br.Renew()
		var ev struct {
			Type   string          `json:"type"`
			Object json.RawMessage `json:"object"`
		}
		if err := dec.Decode(&ev); err != nil {
			if errors.Is(err, io.EOF) || ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("watch leases: %w", err)
		}
		var e Event
		switch ev.Type {
		case "ADDED", "MODIFIED", "DELETED":
			l, err := decodeLease(ev.Object)
			if err != nil {
				return fmt.Errorf("watch leases: %w", err)
			}
			e = Event{Type: ev.Type, Lease: l, ResourceVersion: l.ResourceVersion}
		case "BOOKMARK":
			var b struct {
				Metadata struct {
					ResourceVersion string `json:"resourceVersion"`
				} `json:"metadata"`
			}
			if err := json.Unmarshal(ev.Object, &b); err != nil {
				return fmt.Errorf("watch leases: bookmark: %w", err)
			}
			e = Event{Type: ev.Type, ResourceVersion: b.Metadata.ResourceVersion}
		case "ERROR":
			return kubeapi.EventError(ev.Object)
		default:
			return fmt.Errorf("watch leases: unknown event type %q", truncate(ev.Type, 32))
		}
		select {
		case out <- e:
		case <-ctx.Done():
			return nil
		}
	}
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// CheckName checks that namespace (and name, unless empty) are what the
// apiserver accepts for a Lease, so a bad flag fails at start, not at every
// renewal.
func CheckName(namespace, name string) error {
	if err := validName(namespace, 63); err != nil || strings.Contains(namespace, ".") {
		if err == nil {
			err = errors.New("must not contain '.'")
		}
		return fmt.Errorf("lease namespace %q: %w", truncate(namespace, 64), err)
	}
	if name == "" {
		return nil
	}
	if err := validName(name, 253); err != nil {
		return fmt.Errorf("lease name %q: %w", truncate(name, 260), err)
	}
	return nil
}

// validName checks a DNS-1123 subdomain (a Lease or namespace name), up to
// max characters.
func validName(s string, max int) error {
	if s == "" {
		return errors.New("empty")
	}
	if len(s) > max {
		return fmt.Errorf("longer than %d characters", max)
	}
	for _, part := range strings.Split(s, ".") {
		if part == "" {
			return errors.New("must be lower-case letters, digits, '-' and '.', not starting or ending with '-' or '.'")
		}
		for i := 0; i < len(part); i++ {
			ch := part[i]
			alnum := ch >= 'a' && ch <= 'z' || ch >= '0' && ch <= '9'
			if !alnum && (ch != '-' || i == 0 || i == len(part)-1) {
				return errors.New("must be lower-case letters, digits, '-' and '.', not starting or ending with '-' or '.'")
			}
		}
	}
	return nil
}
