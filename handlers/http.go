package handlers

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/leashq/leash/pool"
)

// HTTP handler limits.
const (
	HTTPTimeoutDefault = 30 * time.Second
	HTTPTimeoutMax     = 10 * time.Minute
	httpBodyKept       = 1024
)

// HTTPArgs is the payload of an "http" (webhook) job.
type HTTPArgs struct {
	// URL to call; http or https. Required.
	URL string `json:"url"`
	// Method, default POST.
	Method string `json:"method,omitempty"`
	// Headers to send.
	Headers map[string]string `json:"headers,omitempty"`
	// Body: a JSON string is sent as is; any other JSON value is sent as JSON
	// (Content-Type application/json unless a header says otherwise).
	Body json.RawMessage `json:"body,omitempty"`
	// Timeout of the request, default 30s, at most 10m.
	Timeout Duration `json:"timeout,omitempty"`
}

// HTTPError describes a webhook response that was not 2xx.
type HTTPError struct {
	Status int
	Body   string // the start of the response body: at most 1 kB, valid UTF-8, NUL bytes replaced
}

// Error describes the response.
func (e *HTTPError) Error() string {
	if e.Body == "" {
		return fmt.Sprintf("webhook answered %d", e.Status)
	}
	return fmt.Sprintf("webhook answered %d: %s", e.Status, e.Body)
}

// HTTP calls a webhook. It sends Leash-Job-Id, Leash-Lease-Token, Leash-Attempt and an
// Idempotency-Key (the job id, the same for every attempt) so receivers can deduplicate. 2xx
// completes; 408 and 429 retry (after Retry-After when given); other 4xx fail permanently; 5xx
// and network errors retry. The request is bound to the job's context: a revocation aborts it.
// A connection refused by the client's [HTTPPolicy] fails the job permanently. Kind "http".
// client may be nil: then HTTPPolicy{}.Client() is used (no link-local or metadata addresses).
// A client of your own is used with its transport, which decides which addresses it may reach.
//
// Redirects are followed (at most 10, or as the client's CheckRedirect says), but the payload's
// headers go only where the payload sent them: once a redirect leads to another host or port,
// or from https to http, every header but those the handler sets itself (Leash-*,
// Idempotency-Key, User-Agent, Content-Type) is dropped for the rest of the chain, Referer
// included. Go's client alone would drop only Authorization, Cookie and WWW-Authenticate, and
// forward an X-Api-Key to wherever the receiver redirects.
func HTTP(client *http.Client) pool.Handler {
	if client == nil {
		client = HTTPPolicy{}.Client()
	}
	client = keepHeadersHome(client)
	return pool.Args(func(ctx context.Context, job *pool.Job, a HTTPArgs) error {
		req, timeout, err := a.request(ctx, job)
		if err != nil {
			return pool.Permanent(err)
		}
		rctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		log := pool.Logger(ctx).With(slog.String("method", req.Method), slog.String("url", logURL(req.URL)))
		sent := time.Now()
		resp, err := client.Do(req.WithContext(rctx))
		if err != nil {
			if cause := context.Cause(ctx); cause != nil {
				return cause
			}
			log.InfoContext(ctx, "webhook not delivered", slog.Any("err", err), slog.Duration("took", time.Since(sent)))
			werr := &cleanError{fmt.Sprintf("webhook %s %s", req.Method, redact(req.URL)), err}
			var aerr *AddressError
			if errors.As(err, &aerr) {
				return pool.Permanent(werr)
			}
			return werr
		}
		defer resp.Body.Close()
		head, _ := io.ReadAll(io.LimitReader(resp.Body, httpBodyKept))
		io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		// The job's output: the status and the start of the body, as clean text (any bytes the
		// receiver sent: NUL, invalid UTF-8, binary), whatever the outcome.
		job.SetOutput(HTTPOutput{Status: resp.StatusCode, Body: strings.TrimSpace(headText(head, httpBodyKept))})
		level := slog.LevelDebug
		if resp.StatusCode < 200 || resp.StatusCode >= 300 {
			level = slog.LevelInfo
		}
		log.Log(ctx, level, "webhook answered", slog.Int("status", resp.StatusCode), slog.Duration("took", time.Since(sent)))
		if resp.StatusCode >= 200 && resp.StatusCode < 300 {
			return nil
		}
		herr := &HTTPError{Status: resp.StatusCode, Body: strings.TrimSpace(headText(head, httpBodyKept))}
		switch {
		case resp.StatusCode == http.StatusRequestTimeout || resp.StatusCode == http.StatusTooManyRequests:
			if d, ok := retryAfter(resp.Header.Get("Retry-After"), time.Now()); ok {
				return pool.RetryAfter(d, herr)
			}
			return herr
		case resp.StatusCode >= 400 && resp.StatusCode < 500:
			return pool.Permanent(herr)
		}
		return herr
	})
}

func (a *HTTPArgs) request(ctx context.Context, job *pool.Job) (*http.Request, time.Duration, error) {
	u, err := url.Parse(a.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, 0, fmt.Errorf("http: url %q must be an absolute http or https URL", a.URL)
	}
	method := strings.ToUpper(a.Method)
	if method == "" {
		method = http.MethodPost
	}
	timeout := time.Duration(a.Timeout)
	if timeout == 0 {
		timeout = HTTPTimeoutDefault
	}
	if timeout < 0 || timeout > HTTPTimeoutMax {
		return nil, 0, fmt.Errorf("http: timeout %s must be between 0 and %s", timeout, HTTPTimeoutMax)
	}
	var body io.Reader
	jsonBody := false
	if len(a.Body) > 0 && string(a.Body) != "null" {
		var s string
		if json.Unmarshal(a.Body, &s) == nil {
			body = strings.NewReader(s)
		} else {
			body, jsonBody = bytes.NewReader(a.Body), true
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), body)
	if err != nil {
		return nil, 0, fmt.Errorf("http: %w", err)
	}
	for k, v := range a.Headers {
		if !validHeaderName(k) {
			return nil, 0, fmt.Errorf("http: header name %s is not valid", quoteName(k))
		}
		if !validHeaderValue(v) {
			return nil, 0, fmt.Errorf("http: header %s has a control character in its value", k)
		}
		req.Header.Set(k, v)
	}
	if jsonBody && req.Header.Get("Content-Type") == "" {
		req.Header.Set("Content-Type", "application/json")
	}
	id := strconv.FormatInt(job.ID, 10)
	req.Header.Set("Leash-Job-Id", id)
	req.Header.Set("Leash-Lease-Token", strconv.FormatInt(job.Token, 10))
	req.Header.Set("Leash-Attempt", strconv.Itoa(job.Attempt))
	if req.Header.Get("Idempotency-Key") == "" {
		req.Header.Set("Idempotency-Key", "leash-job-"+id)
	}
	return req, timeout, nil
}

// keptOnRedirect are the headers the handler sets itself: the only ones that follow a redirect
// to another host.
var keptOnRedirect = map[string]bool{
	"Leash-Job-Id": true, "Leash-Lease-Token": true, "Leash-Attempt": true,
	"Idempotency-Key": true, "User-Agent": true, "Content-Type": true,
}

// keepHeadersHome returns a copy of c whose redirects drop the payload's headers once the chain
// has left the first request's host (see [HTTP]); c's own CheckRedirect, if any, runs after.
func keepHeadersHome(c *http.Client) *http.Client {
	cc := *c
	next := c.CheckRedirect
	cc.CheckRedirect = func(req *http.Request, via []*http.Request) error {
		// Go copies the first request's headers onto every redirect, so a chain that left the
		// host and came back must be caught too: compare each hop with the first.
		left := leavesHost(via[0].URL, req.URL)
		for _, r := range via[1:] {
			left = left || leavesHost(via[0].URL, r.URL)
		}
		if left {
			for k := range req.Header {
				if !keptOnRedirect[http.CanonicalHeaderKey(k)] {
					delete(req.Header, k)
				}
			}
		}
		if next != nil {
			return next(req, via)
		}
		if len(via) >= 10 {
			return errors.New("stopped after 10 redirects")
		}
		return nil
	}
	return &cc
}

// leavesHost reports whether a redirect from "from" to "to" goes to another host name or port, or
// from https to http. From http to https on the same host (default ports both) is not leaving.
func leavesHost(from, to *url.URL) bool {
	if !strings.EqualFold(strings.TrimSuffix(from.Hostname(), "."), strings.TrimSuffix(to.Hostname(), ".")) {
		return true
	}
	if from.Scheme == "https" && to.Scheme != "https" {
		return true
	}
	return (from.Port() != "" || to.Port() != "") && urlPort(from) != urlPort(to)
}

// urlPort is u's port, the scheme's default when none is given.
func urlPort(u *url.URL) string {
	if p := u.Port(); p != "" {
		return p
	}
	if u.Scheme == "https" {
		return "443"
	}
	return "80"
}

// retryAfter reads a Retry-After header: seconds or an HTTP date.
func retryAfter(v string, now time.Time) (time.Duration, bool) {
	if v == "" {
		return 0, false
	}
	if s, err := strconv.Atoi(strings.TrimSpace(v)); err == nil && s >= 0 {
		return time.Duration(s) * time.Second, true
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(t.Sub(now), 0), true
	}
	return 0, false
}

func validHeaderName(k string) bool {
	if k == "" {
		return false
	}
	for _, c := range []byte(k) {
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

func validHeaderValue(v string) bool {
	for _, c := range []byte(v) {
		if (c < ' ' && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// cleanError is a network error as clean text (valid UTF-8, no NUL, bounded), unwrapping to
// the original.
type cleanError struct {
	prefix string
	err    error
}

func (e *cleanError) Error() string {
	return headText([]byte(e.prefix+": "+e.err.Error()), httpBodyKept)
}

func (e *cleanError) Unwrap() error { return e.err }

// redact drops credentials from a URL for logs and errors.
func redact(u *url.URL) string {
	c := *u
	c.User = nil
	return c.String()
}

// HTTPOutput is what the http handler records as a job's output: the response's status and the
// start of its body (at most 1 kB, valid UTF-8 without NUL).
type HTTPOutput struct {
	Status int    `json:"status"`
	Body   string `json:"body"`
}

// logURL is u for logs, which travel further than the job's row: without user info, query or
// fragment, where tokens live.
func logURL(u *url.URL) string {
	c := *u
	c.User, c.RawQuery, c.ForceQuery, c.Fragment, c.RawFragment = nil, "", false, "", ""
	return c.String()
}
