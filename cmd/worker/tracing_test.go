package main

import (
	"compress/gzip"
	"context"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/leashq/leash/cmd/worker/internal/pgtest"
	"github.com/leashq/leash/cmd/worker/internal/syncbuf"
	leashotel "github.com/leashq/leash/otel"
)

func TestTracingOn(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		env  []string
		on   bool
		fail string
	}{
		{env: nil, on: false},
		{env: []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"}, on: true},
		{env: []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces"}, on: true},
		{env: []string{"OTEL_TRACES_EXPORTER", "otlp"}, on: true},
		{env: []string{"OTEL_TRACES_EXPORTER", "none", "OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"}, on: false},
		{env: []string{"OTEL_SDK_DISABLED", "true", "OTEL_TRACES_EXPORTER", "otlp"}, on: false},
		{env: []string{"OTEL_TRACES_EXPORTER", "zipkin"}, fail: "OTEL_TRACES_EXPORTER"},
		{env: []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"}, fail: "OTEL_EXPORTER_OTLP_PROTOCOL"},
		{env: []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc",
			"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"}, on: true},
	} {
		on, err := tracingOn(envOf(c.env...))
		if c.fail != "" {
			if err == nil || !strings.Contains(err.Error(), c.fail) {
				t.Errorf("%v: %v, want an error naming %s", c.env, err, c.fail)
			}
			continue
		}
		if err != nil || on != c.on {
			t.Errorf("%v: on %v, %v; want %v", c.env, on, err, c.on)
		}
	}
}

// receiver is an OTLP/HTTP trace endpoint that hands every span it receives to the test, with
// its resource's service name.
type receiver struct {
	srv   *httptest.Server
	spans chan receivedSpan
}

type receivedSpan struct {
	service string
	span    *tracepb.Span
}

func newReceiver(t *testing.T) *receiver {
	r := &receiver{spans: make(chan receivedSpan, 1000)}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path != "/v1/traces" || req.Header.Get("Content-Type") != "application/x-protobuf" {
			t.Errorf("export to %s as %s", req.URL.Path, req.Header.Get("Content-Type"))
			http.Error(w, "unexpected", http.StatusBadRequest)
			return
		}
		var body io.Reader = req.Body
		if req.Header.Get("Content-Encoding") == "gzip" {
			gz, err := gzip.NewReader(req.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			body = gz
		}
		b, err := io.ReadAll(body)
		var msg coltrace.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(b, &msg)
		}
		if err != nil {
			t.Errorf("decode export: %v", err)
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		for _, rs := range msg.ResourceSpans {
			var service string
			for _, kv := range rs.GetResource().GetAttributes() {
				if kv.Key == "service.name" {
					service = kv.GetValue().GetStringValue()
				}
			}
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					r.spans <- receivedSpan{service: service, span: s}
				}
			}
		}
		out, _ := proto.Marshal(&coltrace.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.Write(out)
	}))
	t.Cleanup(r.srv.Close)
	return r
}

// TestWorkerExportsSpans runs the binary with OTEL_EXPORTER_OTLP_ENDPOINT pointing at a local
// receiver, enqueues a job under a span, and waits for the attempt's span to arrive, in the
// enqueuer's trace.
func TestWorkerExportsSpans(t *testing.T) {
	t.Parallel()
	url := pgtest.URL(t)
	db := pgtest.PoolFor(t, url)
	rcv := newReceiver(t)
	bin := buildWorker(t)
	cmd := exec.Command(bin, "run")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+url, "LOG_FORMAT=json", "WORKER_POLL_INTERVAL=50ms",
		"WORKER_SHUTDOWN_TIMEOUT=1s", "OTEL_EXPORTER_OTLP_ENDPOINT="+rcv.srv.URL, "OTEL_SERVICE_NAME=billing-worker",
		"OTEL_BSP_SCHEDULE_DELAY=50", "OTEL_TRACES_EXPORTER=", "OTEL_SDK_DISABLED=")
	logs := &syncbuf.Buffer{}
	cmd.Stderr = logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		if err := <-exited; err != nil {
			t.Errorf("worker exited with %v\n%s", err, logs.String())
		}
	})

	tp := sdktrace.NewTracerProvider()
	ctx, parent := tp.Tracer("test").Start(context.Background(), "checkout")
	id, err := leashotel.Insert(ctx, db, "noop", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	parent.End()
	timeout := time.After(30 * time.Second)
	for {
		select {
		case got := <-rcv.spans:
			s := got.span
			if s.Name != "process noop" {
				continue
			}
			if hex.EncodeToString(s.TraceId) != parent.SpanContext().TraceID().String() ||
				hex.EncodeToString(s.ParentSpanId) != parent.SpanContext().SpanID().String() {
				t.Fatalf("span in trace %x under %x, want the enqueuer's %s", s.TraceId, s.ParentSpanId, parent.SpanContext().SpanID())
			}
			if got.service != "billing-worker" || s.Kind != tracepb.Span_SPAN_KIND_CONSUMER {
				t.Fatalf("service %q, kind %v", got.service, s.Kind)
			}
			attrs := map[string]string{}
			for _, kv := range s.Attributes {
				attrs[kv.Key] = kv.Value.String()
			}
			if !strings.Contains(attrs[string(leashotel.AttrJobID)], strconv.FormatInt(id, 10)) || !strings.Contains(attrs[string(leashotel.AttrOutcome)], "completed") {
				t.Fatalf("attributes %v", attrs)
			}
			return
		case err := <-exited:
			exited <- err
			t.Fatalf("worker exited: %v\n%s", err, logs.String())
		case <-timeout:
			t.Fatalf("no span arrived\n%s", logs.String())
		}
	}
}
