package handlers_test

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
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
		"http://METADATA.GOOGLE.INTERNAL./", "http://[::ffff:169.254.169.254]/", "http://[64:ff9b::a9fe:a9fe]/", redirect.URL} {
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
