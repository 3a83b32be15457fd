package nodemap

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeapi"
	"github.com/spinifex/konnectivity/internal/kubeclient"
)

// client lists and watches one kind of object.
type client struct {
	api           *kubeclient.Client
	kind          kindID
	fieldSelector string
	page          int // items asked for per list page
}

// path is the collection's path with the query q.
func (c *client) path(q url.Values) string {
	if c.fieldSelector != "" {
		q.Set("fieldSelector", c.fieldSelector)
	}
	return c.kind.path() + "?" + q.Encode()
}

func (c *client) get(ctx context.Context, path string) (*http.Response, error) {
	return c.api.Do(ctx, http.MethodGet, path, nil)
}

// listPage reads one page of the collection, handing each item to each,
// and returns the page's resourceVersion and continue token.
func (c *client) listPage(ctx context.Context, cont string, each func([]byte) error) (listHead, error) {
	q := url.Values{}
	q.Set("limit", strconv.Itoa(c.page))
	if cont != "" {
		q.Set("continue", cont)
	}
	resp, err := c.get(ctx, c.path(q))
	if err != nil {
		return listHead{}, fmt.Errorf("list %s: %w", c.kind, err)
	}
	defer resp.Body.Close()
	head, err := decodeList(resp.Body, each)
	if err != nil {
		return head, fmt.Errorf("list %s: %w", c.kind, err)
	}
	return head, nil
}

// watch opens a watch from rv for at most timeout. The caller reads events
// with next and closes the body.
func (c *client) watch(ctx context.Context, rv string, timeout time.Duration) (*watchStream, error) {
	q := url.Values{}
	q.Set("watch", "true")
	q.Set("allowWatchBookmarks", "true")
	q.Set("resourceVersion", rv)
	q.Set("timeoutSeconds", strconv.Itoa(int(timeout/time.Second)))
	resp, err := c.get(ctx, c.path(q))
	if err != nil {
		return nil, fmt.Errorf("watch %s: %w", c.kind, err)
	}
	br := kubeapi.NewBoundedReader(resp.Body, maxObjectSize)
	return &watchStream{body: resp.Body, br: br, dec: json.NewDecoder(br), kind: c.kind}, nil
}

// watchStream is one open watch; its reader is the goroutine that opened it.
type watchStream struct {
	body io.ReadCloser
	br   *kubeapi.BoundedReader
	dec  *json.Decoder
	kind kindID
}

// next returns the next event; io.EOF when the apiserver ended the watch.
func (w *watchStream) next() (watchEvent, error) {
	ev, err := nextEvent(w.dec, w.br, w.kind)
	if err != nil && !errors.Is(err, io.EOF) {
		err = fmt.Errorf("watch %s: %w", w.kind, err)
	}
	return ev, err
}

func (w *watchStream) close() { w.body.Close() }
