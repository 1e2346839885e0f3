-- leash 006: jobs carry their enqueuer's trace context, so that a tracing worker can make each
-- attempt's span a child of (or a link to) the span that enqueued the job.
-- Safe to apply while workers of the previous release run: it adds one nullable column with no
-- default (a catalog change, no table rewrite, no scan); inserts that do not name it store NULL,
-- and workers that do not know it never read it.

-- The W3C trace context of the enqueuing span, as a carrier object of strings:
-- {"traceparent": "00-<trace id>-<span id>-<flags>", "tracestate": "..."}. NULL: no trace.
-- Written by the Go API when the caller's context carries a span (module
-- github.com/leashq/leash/otel) or by any SQL client; read only by tracing workers, which ignore
-- a value they cannot use (not an object, not strings, too long, not a valid traceparent).
ALTER TABLE leash.jobs ADD COLUMN trace_context jsonb;
