package handlers_test

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/leashq/leash/handlers"
	"github.com/leashq/leash/pool"
)

// Link-local and cloud metadata addresses are refused when connecting, permanently, however the
// address is spelled or reached (a redirect, a name); refusal happens before any packet is sent.
func TestHTTPRefusesMetadataAddresses(t *testing.T) {
	t.Parallel()
	redirect := httptest.NewServer(http.RedirectHandler("http://169.254.169.254/latest/meta-data/", http.StatusFound))
	defer redirect.Close()
	h := handlers.HTTP(nil)
	for _, u := range []string{"http://169.254.169.254/latest/meta-data/", "http://169.254.1.1:8080/", "http://[fe80::1]/",
		"http://[fd00:ec2::254]/", "http://100.100.100.200/", "http://168.63.129.16/", "http://metadata.google.internal/computeMetadata/v1/",
		"http://METADATA.GOOGLE.INTERNAL./", "http://[::ffff:169.254.169.254]/", "http://[64:ff9b::a9fe:a9fe]/", redirect.URL,
		"http://192.0.0.192/opc/v2/instance/", "http://[fd20:ce::254]/computeMetadata/v1/", "http://[::ffff:192.0.0.192]/"} {
		err := handle(h, fmt.Sprintf(`{"url":%q,"timeout":"3s"}`, u))
		if err == nil || !pool.IsPermanent(err) || !strings.Contains(err.Error(), "refused") {
			t.Errorf("%s: %v", u, err)
		}
	}
	// Allowed on purpose.
	allow := handlers.HTTPPolicy{Allow: []netip.Prefix{netip.MustParsePrefix("169.254.169.254/32")}}
	if err := handle(handlers.HTTP(allow.Client()), `{"url":"http://metadata.google.internal/","timeout":"1s"}`); err != nil && strings.Contains(err.Error(), "refused: cloud metadata") {
		t.Errorf("allowed metadata name still refused: %v", err)
	}
}

// The worker's own endpoints (the admin page among them) cannot be the target of a webhook, by
// any local address or name; other local services can, unless BlockPrivate.
func TestHTTPRefusesTheWorkersOwnAddress(t *testing.T) {
	t.Parallel()
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1); w.WriteHeader(204) }))
	defer srv.Close()
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(204) }))
	defer other.Close()
	_, port, _ := net.SplitHostPort(srv.Listener.Addr().String())
	self := handlers.HTTP(handlers.HTTPPolicy{Self: srv.Listener.Addr().String()}.Client())
	for _, u := range []string{srv.URL + "/jobs/1/revoke", "http://localhost:" + port + "/", "http://0.0.0.0:" + port + "/",
		"http://127.0.0.2:" + port + "/", "http://[::1]:" + port + "/"} {
		err := handle(self, fmt.Sprintf(`{"url":%q,"timeout":"3s"}`, u))
		if err == nil || !pool.IsPermanent(err) || !strings.Contains(err.Error(), "own HTTP endpoints") {
			t.Errorf("%s: %v", u, err)
		}
	}
	if n := hits.Load(); n != 0 {
		t.Fatalf("the worker's own address was reached %d times", n)
	}
	if err := handle(self, fmt.Sprintf(`{"url":%q}`, other.URL)); err != nil {
		t.Fatalf("another local service: %v", err)
	}
	strict := handlers.HTTPPolicy{BlockPrivate: true}
	if err := handle(handlers.HTTP(strict.Client()), fmt.Sprintf(`{"url":%q}`, other.URL)); err == nil || !pool.IsPermanent(err) || !strings.Contains(err.Error(), "WORKER_WEBHOOK_BLOCK_PRIVATE") {
		t.Fatalf("loopback with BlockPrivate: %v", err)
	}
	strict.Allow = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	if err := handle(handlers.HTTP(strict.Client()), fmt.Sprintf(`{"url":%q}`, other.URL)); err != nil {
		t.Fatalf("loopback allowed with BlockPrivate: %v", err)
	}
}

// A webhook answering 500 with NUL bytes and invalid UTF-8 in its body gives a clean, bounded
// error, and the job is retried with it as last_error.
func TestHTTPErrorBodyIsCleanText(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(500)
		fmt.Fprint(w, "boom\x00\xff\xfe"+strings.Repeat("é", 2000))
	}))
	defer srv.Close()
	payload := fmt.Sprintf(`{"url":%q}`, srv.URL)
	err := handle(handlers.HTTP(nil), payload)
	if err == nil || pool.IsPermanent(err) || !strings.Contains(err.Error(), "webhook answered 500: boom") {
		t.Fatalf("got %v", err)
	}
	cleanForPostgres(t, "webhook error", err.Error(), 1100)

	h := newHarness(t, handlers.Options{})
	_, state, lastErr := h.run(t, "http", payload)
	if state != "retryable" || !strings.Contains(lastErr, "500") {
		t.Fatalf("job: %s %q", state, lastErr)
	}
	cleanForPostgres(t, "last_error", lastErr, 1100)

	if err := handle(handlers.HTTP(nil), fmt.Sprintf(`{"url":%q,"headers":{"X-A":"b\u0000c"}}`, srv.URL)); err == nil || !pool.IsPermanent(err) {
		t.Fatalf("NUL in a header value: %v", err)
	}
}

// A payload's headers go only to the host the payload named: once a redirect leads to another
// host or port, only the headers the handler sets itself follow it, for the rest of the chain.
func TestHTTPRedirectDropsPayloadHeaders(t *testing.T) {
	t.Parallel()
	type seen struct {
		path, body string
		header     http.Header
	}
	got := make(chan seen, 10)
	record := func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- seen{r.URL.Path, string(b), r.Header}
		w.WriteHeader(204)
	}
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if back := r.URL.Query().Get("back"); back != "" {
			http.Redirect(w, r, back, http.StatusTemporaryRedirect)
			return
		}
		record(w, r)
	}))
	defer other.Close()
	var home *httptest.Server
	home = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, port, _ := net.SplitHostPort(home.Listener.Addr().String())
		switch r.URL.Path {
		case "/same":
			http.Redirect(w, r, "/final", http.StatusTemporaryRedirect)
		case "/away":
			http.Redirect(w, r, other.URL+"/x", http.StatusTemporaryRedirect)
		case "/rename": // same port, another name for it
			http.Redirect(w, r, "http://localhost:"+port+"/final", http.StatusTemporaryRedirect)
		case "/boomerang": // away and back again
			http.Redirect(w, r, other.URL+"/y?back="+url.QueryEscape(home.URL+"/final"), http.StatusTemporaryRedirect)
		default:
			record(w, r)
		}
	}))
	defer home.Close()

	h := handlers.HTTP(nil)
	payload := func(path string) string {
		return fmt.Sprintf(`{"url":%q,"body":{"a":1},"headers":{"X-Api-Key":"secret-key","Authorization":"Bearer secret-token",`+
			`"Cookie":"s=secret-cookie","Referer":"https://secret-referer/","X-Custom":"secret-custom"}}`, home.URL+path)
	}
	payloadHeaders := []string{"X-Api-Key", "Authorization", "Cookie", "Referer", "X-Custom"}
	kept := map[string]string{"Leash-Job-Id": "7", "Leash-Attempt": "1", "Leash-Lease-Token": "9", "Idempotency-Key": "leash-job-7", "Content-Type": "application/json"}
	for _, c := range []struct {
		path, landed string
		keep         bool
	}{{"/same", "/final", true}, {"/away", "/x", false}, {"/rename", "/final", false}, {"/boomerang", "/final", false}} {
		if err := handle(h, payload(c.path)); err != nil {
			t.Fatalf("%s: %v", c.path, err)
		}
		s := <-got
		if s.path != c.landed || s.body != `{"a":1}` {
			t.Errorf("%s: landed on %s with body %q", c.path, s.path, s.body)
		}
		for k, v := range kept {
			if s.header.Get(k) != v {
				t.Errorf("%s: %s = %q, want %q", c.path, k, s.header.Get(k), v)
			}
		}
		for _, k := range payloadHeaders {
			if v := s.header.Get(k); (v != "") != c.keep {
				t.Errorf("%s: %s = %q; the payload's headers should be kept: %v", c.path, k, v, c.keep)
			}
		}
		if !c.keep {
			for k, v := range s.header {
				if strings.Contains(strings.Join(v, " "), "secret") {
					t.Errorf("%s: %s = %q reached another host", c.path, k, v)
				}
			}
		}
	}

	// A client's own CheckRedirect still has the last word, and sees the headers already dropped.
	var sawKey atomic.Value
	own := handlers.HTTPPolicy{}.Client()
	own.CheckRedirect = func(req *http.Request, via []*http.Request) error {
		sawKey.Store(req.Header.Get("X-Api-Key"))
		return http.ErrUseLastResponse
	}
	if err := handle(handlers.HTTP(own), payload("/away")); err == nil || !strings.Contains(err.Error(), "307") {
		t.Errorf("own CheckRedirect: %v", err)
	}
	if v := sawKey.Load(); v != "" {
		t.Errorf("own CheckRedirect saw X-Api-Key %q", v)
	}
}
