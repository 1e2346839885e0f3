package leashotel_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/leashq/leash/internal/pgtest"
	leashotel "github.com/leashq/leash/otel"
	"github.com/leashq/leash/pool"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// ended is a span processor that hands every ended span to the test: tests wait on it rather
// than sleep.
type ended chan sdktrace.ReadOnlySpan

func (e ended) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (e ended) OnEnd(s sdktrace.ReadOnlySpan)                   { e <- s }
func (e ended) Shutdown(context.Context) error                  { return nil }
func (e ended) ForceFlush(context.Context) error                { return nil }

// next returns the next ended span named name, or fails the test.
func (e ended) next(t *testing.T, name string) sdktrace.ReadOnlySpan {
	t.Helper()
	timeout := time.After(20 * time.Second)
	for {
		select {
		case s := <-e:
			if s.Name() == name {
				return s
			}
		case <-timeout:
			t.Fatalf("no span %q ended", name)
			return nil
		}
	}
}

type bundle struct {
	db     *pgxpool.Pool
	tp     *sdktrace.TracerProvider
	spans  ended
	pool   *pool.Pool
	tracer trace.Tracer
}

// setup returns a running pool traced into an in-memory recorder, with the given handlers.
func setup(t *testing.T, cfg leashotel.Config, pcfg pool.Config, handlers map[string]pool.Handler) *bundle {
	t.Helper()
	b := &bundle{db: pgtest.Pool(t), spans: make(ended, 1000)}
	b.tp = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(b.spans))
	t.Cleanup(func() { b.tp.Shutdown(context.Background()) })
	b.tracer = b.tp.Tracer("test")
	cfg.TracerProvider = b.tp
	pcfg.Hooks = append(pcfg.Hooks, leashotel.NewHook(cfg))
	pcfg.PollInterval = 50 * time.Millisecond
	p, err := pool.New(b.db, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	for kind, h := range handlers {
		if err := p.Register(kind, h); err != nil {
			t.Fatal(err)
		}
	}
	b.pool = p
	done := make(chan error, 1)
	// Run under a span of its own: it must never become the parent of the jobs' spans.
	runCtx, runSpan := b.tracer.Start(context.Background(), "worker run")
	go func() { done <- p.Run(runCtx) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		p.Shutdown(ctx)
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		runSpan.End()
	})
	return b
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

func TestAttemptSpanIsChildOfEnqueuer(t *testing.T) {
	t.Parallel()
	ran := make(chan trace.SpanContext, 1)
	b := setup(t, leashotel.Config{}, pool.Config{}, map[string]pool.Handler{
		"email": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			ran <- trace.SpanContextFromContext(ctx)
			return nil
		}),
	})
	ctx, parent := b.tracer.Start(context.Background(), "signup")
	id, err := leashotel.Insert(ctx, b.db, "email", map[string]string{"to": "a@example.com"}, &pool.InsertOpts{Queue: "default"})
	if err != nil {
		t.Fatal(err)
	}
	parent.End()
	s := b.spans.next(t, "process email")
	inHandler := <-ran
	if s.Parent().SpanID() != parent.SpanContext().SpanID() || s.SpanContext().TraceID() != parent.SpanContext().TraceID() {
		t.Fatalf("parent %v, want the enqueuer's span %v", s.Parent(), parent.SpanContext())
	}
	if inHandler.SpanID() != s.SpanContext().SpanID() {
		t.Errorf("the handler's context carries span %v, not the attempt's %v", inHandler.SpanID(), s.SpanContext().SpanID())
	}
	if s.SpanKind() != trace.SpanKindConsumer || len(s.Links()) != 0 {
		t.Errorf("kind %v, links %v", s.SpanKind(), s.Links())
	}
	a := attrs(s)
	for key, want := range map[attribute.Key]any{
		leashotel.AttrJobID: id, leashotel.AttrKind: "email", leashotel.AttrQueue: "default", leashotel.AttrAttempt: int64(1),
		leashotel.AttrOutcome: "completed", leashotel.AttrMessagingSystem: "leash", leashotel.AttrDestination: "default",
	} {
		if got := a[key].AsInterface(); got != want {
			t.Errorf("%s = %v (%T), want %v", key, got, got, want)
		}
	}
	if tok := a[leashotel.AttrLeaseToken].AsInt64(); tok <= 0 {
		t.Errorf("lease token %d", tok)
	}
	if _, ok := a[leashotel.AttrEndCause]; ok || s.Status().Code == codes.Error {
		t.Errorf("end cause %v, status %v on a completed job", a[leashotel.AttrEndCause], s.Status())
	}
}

func TestRevokedAttemptSpan(t *testing.T) {
	t.Parallel()
	started := make(chan int64, 1)
	b := setup(t, leashotel.Config{}, pool.Config{}, map[string]pool.Handler{
		"block": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			started <- j.ID
			<-ctx.Done()
			return context.Cause(ctx)
		}),
	})
	ctx, parent := b.tracer.Start(context.Background(), "request")
	if _, err := leashotel.InsertMany(ctx, b.db, []pool.InsertManyParams{{Kind: "block"}}); err != nil {
		t.Fatal(err)
	}
	parent.End()
	id := <-started
	if _, err := b.db.Exec(context.Background(), "SELECT leash.revoke_job($1, 'wrong customer')", id); err != nil {
		t.Fatal(err)
	}
	s := b.spans.next(t, "process block")
	if s.Parent().SpanID() != parent.SpanContext().SpanID() {
		t.Errorf("parent %v, want %v", s.Parent().SpanID(), parent.SpanContext().SpanID())
	}
	var revoked int
	for _, ev := range s.Events() {
		if ev.Name == leashotel.EventRevoked {
			revoked++
		}
	}
	a := attrs(s)
	if revoked != 1 || a[leashotel.AttrOutcome].AsString() != "cancelled" || a[leashotel.AttrEndCause].AsString() != "revoked" {
		t.Fatalf("events %v, attributes %v", s.Events(), a)
	}
	if s.Status().Code != codes.Error {
		t.Fatalf("status %v", s.Status())
	}
}

func TestOldEnqueueIsLinked(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	b := setup(t, leashotel.Config{LinkAfter: time.Minute}, pool.Config{Queues: []string{"later"}}, map[string]pool.Handler{
		"report": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			<-release
			return errors.New("printer on fire")
		}),
	})
	ctx, parent := b.tracer.Start(context.Background(), "nightly")
	opts := &pool.InsertOpts{Queue: "later", MaxAttempts: 1, RunAt: time.Now().Add(time.Hour)}
	id, err := leashotel.Insert(ctx, b.db, "report", nil, opts)
	if err != nil {
		t.Fatal(err)
	}
	parent.End()
	// Enqueued two hours ago, due now.
	if _, err := b.db.Exec(context.Background(), "UPDATE leash.jobs SET created_at = now() - interval '2 hours', run_at = now() WHERE id = $1", id); err != nil {
		t.Fatal(err)
	}
	close(release)
	s := b.spans.next(t, "process report")
	if s.Parent().IsValid() || s.SpanContext().TraceID() == parent.SpanContext().TraceID() {
		t.Fatalf("parent %v: an old enqueue must start a trace of its own", s.Parent())
	}
	if len(s.Links()) != 1 || s.Links()[0].SpanContext.SpanID() != parent.SpanContext().SpanID() {
		t.Fatalf("links %v, want one to the enqueuer's span", s.Links())
	}
	if a := attrs(s); a[leashotel.AttrOutcome].AsString() != "failed" || s.Status().Code != codes.Error || a[leashotel.AttrEnqueueAge].AsInt64() < 7_000_000 {
		t.Fatalf("attributes %v, status %v", a, s.Status())
	}
}

// A forged or junk trace_context, written by any SQL client, gives the attempt a root span of its
// own: never a failed claim.
func TestJunkTraceContextGivesRootSpan(t *testing.T) {
	t.Parallel()
	b := setup(t, leashotel.Config{}, pool.Config{}, map[string]pool.Handler{
		"ok": pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil }),
	})
	for _, junk := range []string{
		`{"traceparent": "00-00000000000000000000000000000000-0000000000000000-01"}`,
		`{"traceparent": "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`,
		`{"traceparent": "not a traceparent", "tracestate": "x=\u0001"}`,
		`{"traceparent": ["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"]}`,
		`[{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}]`,
	} {
		if _, err := b.db.Exec(context.Background(), "INSERT INTO leash.jobs (kind, trace_context) VALUES ('ok', $1::jsonb)", junk); err != nil {
			t.Fatalf("%s: %v", junk, err)
		}
		s := b.spans.next(t, "process ok")
		if s.Parent().IsValid() || len(s.Links()) != 0 || attrs(s)[leashotel.AttrOutcome].AsString() != "completed" {
			t.Fatalf("%s: parent %v, links %v, attributes %v", junk, s.Parent(), s.Links(), attrs(s))
		}
	}
	if got := b.pool.Stats().Completed; got != 5 {
		t.Fatalf("completed %d", got)
	}
}

func TestCarrier(t *testing.T) {
	t.Parallel()
	if c := leashotel.Carrier(context.Background()); c != nil {
		t.Fatalf("carrier %v without a span", c)
	}
	if o := leashotel.WithTrace(context.Background(), nil); o == nil || o.TraceContext != nil {
		t.Fatalf("opts %+v", o)
	}
	tp := sdktrace.NewTracerProvider()
	ctx, span := tp.Tracer("t").Start(context.Background(), "x")
	defer span.End()
	ts, _ := trace.ParseTraceState("a=1,b=2")
	ctx = trace.ContextWithSpanContext(ctx, span.SpanContext().WithTraceState(ts))
	c := leashotel.Carrier(ctx)
	if c["traceparent"] == "" || c["tracestate"] != "a=1,b=2" {
		t.Fatalf("carrier %v", c)
	}
	if got := leashotel.Extract(c); got.SpanID() != span.SpanContext().SpanID() || !got.IsRemote() {
		t.Fatalf("extracted %v", got)
	}
	own := map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	if o := leashotel.WithTrace(ctx, &pool.InsertOpts{TraceContext: own}); o.TraceContext["traceparent"] != own["traceparent"] {
		t.Fatalf("an explicit trace context was replaced: %v", o.TraceContext)
	}
}

// A takeover reaches the old holder as an event, and its span ends with nothing written.
func TestLostLeaseSpan(t *testing.T) {
	t.Parallel()
	started := make(chan int64, 10)
	b := setup(t, leashotel.Config{}, pool.Config{LeaseDuration: 2 * time.Minute, HeartbeatInterval: time.Minute,
		RescueInterval: time.Hour}, map[string]pool.Handler{
		"block": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			if j.Attempt > 1 {
				return nil // the retry after the takeover
			}
			started <- j.ID
			<-ctx.Done()
			return context.Cause(ctx)
		}),
	})
	if _, err := leashotel.Insert(context.Background(), b.db, "block", nil, nil); err != nil {
		t.Fatal(err)
	}
	id := <-started
	// The takeover notification needs the listener.
	for deadline := time.Now().Add(10 * time.Second); !b.pool.ListenerConnected(); {
		if time.Now().After(deadline) {
			t.Fatal("listener not connected")
		}
		time.Sleep(10 * time.Millisecond)
	}

	ctx := context.Background()
	err := pgx.BeginFunc(ctx, b.db, func(tx pgx.Tx) error {
		// What a rescuer does to an expired lease: the job is claimable again, and the old
		// holder is told on job_revoked that it lost the lease.
		_, err := tx.Exec(ctx, `
			WITH old AS (SELECT lease_token FROM leash.jobs WHERE id = $1 FOR UPDATE)
			UPDATE leash.jobs j SET state = 'retryable', run_at = now(), lease_token = NULL, leased_by = NULL, lease_expires_at = NULL
			FROM old WHERE j.id = $1
			RETURNING leash.notify_revoked(j.id, old.lease_token, 'lease expired', true)`, id)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	s := b.spans.next(t, "process block")
	if attrs(s)[leashotel.AttrAttempt].AsInt64() != 1 {
		s = b.spans.next(t, "process block") // the retry ended first
	}
	a := attrs(s)
	var lost int
	for _, ev := range s.Events() {
		if ev.Name == leashotel.EventLeaseLost {
			lost++
		}
	}
	if lost != 1 || a[leashotel.AttrOutcome].AsString() != "lost" || a[leashotel.AttrEndCause].AsString() != "lost" || s.Status().Code != codes.Error {
		t.Fatalf("events %v, attributes %v, status %v", s.Events(), a, s.Status())
	}
}
