// Package leashotel traces leash jobs with OpenTelemetry: enqueue helpers that store the caller's
// W3C trace context with the job (the trace_context column), and a pool.AttemptHook that runs
// every attempt under a consumer span, the child of the enqueuer's span (or linked to it when
// the job waited long), with the job's identity, its outcome and the lease's end as attributes
// and events.
//
// It is a module of its own (github.com/leashq/leash/otel), so that applications that do not
// trace never get OpenTelemetry in their dependencies:
//
//	import leashotel "github.com/leashq/leash/otel"
//
//	p, err := pool.New(db, pool.Config{Hooks: []pool.AttemptHook{leashotel.NewHook(leashotel.Config{})}})
//	id, err := leashotel.Insert(ctx, db, "email", args, nil) // carries ctx's span to the job
package leashotel

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

// ScopeName is the instrumentation scope of the spans this package makes.
const ScopeName = "github.com/leashq/leash/otel"

// LinkAfterDefault is Config.LinkAfter's default.
const LinkAfterDefault = 15 * time.Minute

// Attribute keys of attempt spans. The messaging.* ones follow OpenTelemetry's messaging
// semantic conventions; the leash.* ones are leash's own.
const (
	AttrMessagingSystem    = attribute.Key("messaging.system")           // "leash"
	AttrMessagingOperation = attribute.Key("messaging.operation.type")   // "process"
	AttrDestination        = attribute.Key("messaging.destination.name") // the job's queue
	AttrMessageID          = attribute.Key("messaging.message.id")       // the job's id, as a string
	AttrJobID              = attribute.Key("leash.job.id")               // int64
	AttrKind               = attribute.Key("leash.job.kind")             // string
	AttrQueue              = attribute.Key("leash.job.queue")            // string
	AttrAttempt            = attribute.Key("leash.job.attempt")          // int, 1 for the first
	AttrLeaseToken         = attribute.Key("leash.lease.token")          // int64, the claim's fencing token
	AttrEnqueueAge         = attribute.Key("leash.job.enqueue_age_ms")   // int64, enqueue to this attempt's start (database clock)
	AttrOutcome            = attribute.Key("leash.job.outcome")          // state written, or lost, stale, abandoned
	AttrEndCause           = attribute.Key("leash.lease.end_cause")      // revoked, lost, renewal_timeout, shutdown, timeout
	AttrEndReason          = attribute.Key("leash.lease.end_reason")     // the cause's text (a revocation's reason)
)

// Event names on attempt spans: one per lease end that reached the running job.
const (
	EventRevoked        = "leash.revoked"         // an operator revoked the job
	EventLeaseLost      = "leash.lease_lost"      // another worker took the job over
	EventRenewalTimeout = "leash.renewal_timeout" // renewals went unconfirmed: the worker stopped first
	EventShutdown       = "leash.shutdown"        // the worker's shutdown grace period ran out
	EventTimeout        = "leash.timeout"         // the attempt ran past its timeout
	EventLeaseEnded     = "leash.lease_ended"     // any other cause
)

// Config configures a Hook. The zero value works.
type Config struct {
	// TracerProvider makes the attempt spans. Default: the global one, otel.GetTracerProvider()
	// (which also serves a provider installed after NewHook).
	TracerProvider trace.TracerProvider
	// LinkAfter decides between child and link. An attempt that starts at most this long after
	// its job was enqueued (attempted_at − created_at, both on the database clock) is a child of
	// the enqueuer's span, in the enqueuer's trace. One that starts later (a job scheduled for
	// tomorrow, a retry after a long backoff) starts a trace of its own with a link to the
	// enqueuer's span, so that traces do not stretch over hours and stay readable. Default
	// LinkAfterDefault (15 minutes); negative: always a child.
	LinkAfter time.Duration
}

// Hook is a pool.AttemptHook that runs every attempt under a span. Install it in
// pool.Config.Hooks.
type Hook struct {
	tracer    trace.Tracer
	linkAfter time.Duration
}

// NewHook returns a Hook configured by cfg, its zero fields filled with the defaults.
func NewHook(cfg Config) *Hook {
	if cfg.LinkAfter == 0 {
		cfg.LinkAfter = LinkAfterDefault
	}
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = otel.GetTracerProvider()
	}
	return &Hook{tracer: cfg.TracerProvider.Tracer(ScopeName), linkAfter: cfg.LinkAfter}
}

// StartAttempt implements pool.AttemptHook: it starts the attempt's consumer span, named
// "process <kind>", and returns the handler's context carrying it.
func (h *Hook) StartAttempt(ctx context.Context, job *pool.Job) (context.Context, pool.AttemptObserver) {
	age := job.AttemptedAt.Sub(job.CreatedAt)
	opts := []trace.SpanStartOption{
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			AttrMessagingSystem.String("leash"),
			AttrMessagingOperation.String("process"),
			AttrDestination.String(job.Queue),
			AttrMessageID.String(strconv.FormatInt(job.ID, 10)),
			AttrJobID.Int64(job.ID),
			AttrKind.String(job.Kind),
			AttrQueue.String(job.Queue),
			AttrAttempt.Int(job.Attempt),
			AttrLeaseToken.Int64(job.Token),
			AttrEnqueueAge.Int64(age.Milliseconds()),
		),
	}
	// The pool's own context may carry a span (the one Run was called under): never a parent of
	// the jobs.
	parent := trace.ContextWithSpanContext(ctx, trace.SpanContext{})
	if enq := Extract(job.TraceContext); enq.IsValid() {
		if h.linkAfter < 0 || age <= h.linkAfter {
			parent = trace.ContextWithRemoteSpanContext(ctx, enq)
		} else {
			opts = append(opts, trace.WithLinks(trace.Link{SpanContext: enq}))
		}
	}
	// parent is ctx with another span context: the handler keeps ctx's values and cancellation.
	spanCtx, span := h.tracer.Start(parent, "process "+job.Kind, opts...)
	return spanCtx, &attempt{span: span}
}

// attempt is one attempt's span. The pool serialises the calls of one attempt and makes
// AttemptEnded the last.
type attempt struct {
	span trace.Span
}

// LeaseEnded implements pool.AttemptObserver: an event named for the cause.
func (a *attempt) LeaseEnded(cause error) {
	name, label := causeName(cause)
	a.span.AddEvent(name, trace.WithAttributes(AttrEndCause.String(label), AttrEndReason.String(clip(cause.Error(), 256))))
}

// AttemptEnded implements pool.AttemptObserver: the outcome, the lease's end cause and the
// status, then the span ends.
func (a *attempt) AttemptEnded(ev pool.JobEvent) {
	outcome := ev.State
	switch {
	case ev.Abandoned:
		outcome = "abandoned"
	case ev.Stale:
		outcome = "stale"
	case outcome == "":
		outcome = "lost"
	}
	a.span.SetAttributes(AttrOutcome.String(outcome))
	if ev.Cause != nil {
		_, label := causeName(ev.Cause)
		a.span.SetAttributes(AttrEndCause.String(label))
	}
	if ev.Err != nil {
		a.span.RecordError(ev.Err)
	}
	switch outcome {
	case "completed", "available":
		// Done, or handed back at shutdown to run elsewhere: not a failure of this attempt.
	default:
		desc := "job " + outcome
		if ev.Err != nil {
			desc += ": " + ev.Err.Error()
		} else if ev.Cause != nil {
			desc += ": " + ev.Cause.Error()
		}
		a.span.SetStatus(codes.Error, clip(desc, 1024))
	}
	a.span.End()
}

// causeName maps a lease's end cause to its event name and attribute value.
func causeName(cause error) (event, label string) {
	switch {
	case errors.Is(cause, lease.ErrRevoked):
		return EventRevoked, "revoked"
	case errors.Is(cause, lease.ErrLost):
		return EventLeaseLost, "lost"
	case errors.Is(cause, lease.ErrRenewalTimeout):
		return EventRenewalTimeout, "renewal_timeout"
	case errors.Is(cause, lease.ErrShutdown):
		return EventShutdown, "shutdown"
	case errors.Is(cause, pool.ErrTimeout):
		return EventTimeout, "timeout"
	}
	return EventLeaseEnded, "other"
}

// propagator is the one format of the trace_context column: W3C Trace Context.
var propagator = propagation.TraceContext{}

// Extract returns the span context in a job's trace context carrier (pool.Job.TraceContext),
// or an invalid one when it holds none: a missing, malformed or forged traceparent is no trace
// context, never an error.
func Extract(tc map[string]string) trace.SpanContext {
	if tc["traceparent"] == "" {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(propagator.Extract(context.Background(), propagation.MapCarrier(tc)))
}

// Carrier returns the W3C trace context of ctx's span as a carrier for
// pool.InsertOpts.TraceContext, or nil when ctx carries no valid span. A tracestate that would
// make it longer than pool.MaxTraceContextBytes is left out.
func Carrier(ctx context.Context) map[string]string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return nil
	}
	c := propagation.MapCarrier{}
	propagator.Inject(ctx, c)
	if b, err := json.Marshal(c); err != nil || len(b) > pool.MaxTraceContextBytes || !utf8.ValidString(c["tracestate"]) {
		delete(c, "tracestate")
	}
	if c["traceparent"] == "" {
		return nil
	}
	return c
}

// clip cuts s to at most n bytes on a character boundary.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
