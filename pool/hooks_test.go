package pool_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/leashq/leash/internal/syncbuf"
	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
)

// attemptLog is what a recordingHook saw of one attempt, in order.
type attemptLog struct {
	job    jobSeen
	causes []error
	ended  *pool.JobEvent
}

// recordingHook reports every attempt it saw once it ended, and tags handler contexts.
type recordingHook struct{ done chan attemptLog }

// jobSeen is the part of a pool.Job a hook reads.
type jobSeen struct {
	ID           int64
	Kind, Queue  string
	Attempt      int
	Token        int64
	TraceContext map[string]string
}

type hookKey struct{}

func newRecordingHook() *recordingHook { return &recordingHook{done: make(chan attemptLog, 100)} }

func (h *recordingHook) StartAttempt(ctx context.Context, j *pool.Job) (context.Context, pool.AttemptObserver) {
	return context.WithValue(ctx, hookKey{}, j.ID), &recordingObserver{h: h, log: attemptLog{job: jobSeen{
		ID: j.ID, Kind: j.Kind, Queue: j.Queue, Attempt: j.Attempt, Token: j.Token, TraceContext: j.TraceContext}}}
}

// recordingObserver needs no lock: the pool serialises its calls for one attempt.
type recordingObserver struct {
	h   *recordingHook
	log attemptLog
}

func (o *recordingObserver) LeaseEnded(cause error) {
	if o.log.ended != nil {
		panic("LeaseEnded after AttemptEnded")
	}
	o.log.causes = append(o.log.causes, cause)
}

func (o *recordingObserver) AttemptEnded(ev pool.JobEvent) {
	if o.log.ended != nil {
		panic("AttemptEnded twice")
	}
	o.log.ended = &ev
	o.h.done <- o.log
}

func (h *recordingHook) next(t *testing.T) attemptLog {
	t.Helper()
	select {
	case a := <-h.done:
		return a
	case <-time.After(20 * time.Second):
		t.Fatal("no attempt ended")
		return attemptLog{}
	}
}

func TestHookSeesAttemptAndOutcome(t *testing.T) {
	t.Parallel()
	hook := newRecordingHook()
	cfg := fastConfig()
	cfg.Hooks = []pool.AttemptHook{hook}
	tagged := make(chan bool, 10)
	p, b := setup(t, nil, cfg, map[string]pool.Handler{
		"ok": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			tagged <- ctx.Value(hookKey{}) == j.ID
			return nil
		}),
		"bad": pool.HandlerFunc(func(context.Context, *pool.Job) error { return pool.Permanent(errors.New("no luck")) }),
	})
	tc := map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v"}
	okID := insert(t, b.db, "ok", nil, &pool.InsertOpts{Queue: "default", TraceContext: tc})
	start(t, p)
	a := hook.next(t)
	if !<-tagged {
		t.Error("the handler's context is not the one the hook returned")
	}
	if a.job.ID != okID || a.job.Kind != "ok" || a.job.Queue != "default" || a.job.Attempt != 1 || a.job.Token == 0 {
		t.Errorf("job %+v", a.job)
	}
	if fmt.Sprint(a.job.TraceContext) != fmt.Sprint(tc) {
		t.Errorf("trace context %v, want %v", a.job.TraceContext, tc)
	}
	if a.ended.State != "completed" || a.ended.Err != nil || a.ended.Cause != nil || len(a.causes) != 0 {
		t.Errorf("ended %+v, lease causes %v", a.ended, a.causes)
	}

	insert(t, b.db, "bad", nil, nil)
	a = hook.next(t)
	if a.ended.State != "failed" || a.ended.Err == nil || !strings.Contains(a.ended.Err.Error(), "no luck") {
		t.Errorf("ended %+v", a.ended)
	}
	if a.job.TraceContext != nil {
		t.Errorf("trace context %v for a job enqueued without one", a.job.TraceContext)
	}
}

func TestHookSeesRevocationBeforeOutcome(t *testing.T) {
	t.Parallel()
	hook := newRecordingHook()
	cfg := slowHeartbeat()
	cfg.Hooks = []pool.AttemptHook{hook}
	h := newBlocker()
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"block": h})
	id := insert(t, b.db, "block", nil, nil)
	start(t, p)
	h.next(t)
	waitFor(t, 10*time.Second, p.ListenerConnected)
	mustExec(t, b.db, "SELECT leash.revoke_job($1, 'wrong customer')", id)
	a := hook.next(t)
	if len(a.causes) != 1 || !errors.Is(a.causes[0], lease.ErrRevoked) {
		t.Fatalf("lease causes %v, want one revocation", a.causes)
	}
	if a.ended.State != "cancelled" || !errors.Is(a.ended.Cause, lease.ErrRevoked) || !errors.Is(a.ended.Err, lease.ErrRevoked) {
		t.Fatalf("ended %+v", a.ended)
	}
}

func TestHookSeesShutdownHandBack(t *testing.T) {
	t.Parallel()
	hook := newRecordingHook()
	cfg := fastConfig()
	cfg.Hooks = []pool.AttemptHook{hook}
	h := newBlocker()
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"block": h})
	insert(t, b.db, "block", nil, nil)
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	h.next(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // no grace period
	p.Shutdown(ctx)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	a := hook.next(t)
	if len(a.causes) != 1 || !errors.Is(a.causes[0], lease.ErrShutdown) || a.ended.State != "available" {
		t.Fatalf("lease causes %v, ended %+v", a.causes, a.ended)
	}
}

// panickyHook panics when it starts an attempt, or returns an observer that panics.
type panickyHook struct{ atStart bool }

func (h panickyHook) StartAttempt(ctx context.Context, _ *pool.Job) (context.Context, pool.AttemptObserver) {
	if h.atStart {
		panic("hook broken")
	}
	return ctx, panickyObserver{}
}

type panickyObserver struct{}

func (panickyObserver) LeaseEnded(error)              { panic("observer broken") }
func (panickyObserver) AttemptEnded(ev pool.JobEvent) { panic("observer broken") }

func TestBrokenHookNeverStopsAJob(t *testing.T) {
	t.Parallel()
	hook := newRecordingHook()
	cfg := fastConfig()
	cfg.Hooks = []pool.AttemptHook{panickyHook{atStart: true}, panickyHook{}, hook}
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"ok": noop()})
	id := insert(t, b.db, "ok", nil, nil)
	start(t, p)
	if a := hook.next(t); a.ended.State != "completed" {
		t.Fatalf("ended %+v", a.ended)
	}
	if r := getRow(t, b.db, id); r.State != "completed" {
		t.Fatalf("row %+v", r)
	}
}

// TestJunkTraceContextIgnored stores what any SQL client could put in trace_context: a claim
// never fails on it, the job runs, and only an object's string members reach the handler.
func TestJunkTraceContextIgnored(t *testing.T) {
	t.Parallel()
	hook := newRecordingHook()
	cfg := fastConfig()
	cfg.Hooks = []pool.AttemptHook{hook}
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"ok": noop()})
	huge := strings.Repeat("0", 1<<20)
	junk := map[string]struct {
		sql  string
		want string
	}{
		"array":        {`'[1, 2, 3]'`, "map[]"},
		"string":       {`'"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"'`, "map[]"},
		"number":       {`'42'`, "map[]"},
		"json null":    {`'null'`, "map[]"},
		"not strings":  {`'{"traceparent": 5, "tracestate": {"a": [1]}}'`, "map[]"},
		"some strings": {`'{"traceparent": "junk", "x": null}'`, "map[traceparent:junk]"},
		"huge":         {"jsonb_build_object('traceparent', '" + huge + "')", "map[]"},
		"many keys":    {`(SELECT jsonb_object_agg('k' || i, 'v') FROM generate_series(1, 5000) i)`, "map[]"},
		"escapes":      {`'{"traceparent": "\u00e9\ud83d\ude00\t"}'`, "map[traceparent:é😀\t]"},
	}
	ids := map[int64]string{}
	for name, j := range junk {
		var id int64
		if err := b.db.QueryRow(context.Background(),
			"INSERT INTO leash.jobs (kind, trace_context) VALUES ('ok', "+j.sql+") RETURNING id").Scan(&id); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		ids[id] = name
	}
	start(t, p)
	for range junk {
		a := hook.next(t)
		name := ids[a.job.ID]
		if got := fmt.Sprint(a.job.TraceContext); got != junk[name].want {
			t.Errorf("%s: trace context %s, want %s", name, got, junk[name].want)
		}
		if a.ended.State != "completed" {
			t.Errorf("%s: ended %+v", name, a.ended)
		}
	}
	if p.Stats().Completed != int64(len(junk)) {
		t.Fatalf("completed %d of %d", p.Stats().Completed, len(junk))
	}
}

func TestInsertTraceContext(t *testing.T) {
	t.Parallel()
	_, b := setup(t, nil, fastConfig(), nil)
	ctx := context.Background()
	tc := map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	n, err := pool.InsertMany(ctx, b.db, []pool.InsertManyParams{
		{Kind: "a", Opts: &pool.InsertOpts{TraceContext: tc}},
		{Kind: "a"},
		{Kind: "a", Opts: &pool.InsertOpts{Delay: time.Hour, TraceContext: tc}},
	})
	if err != nil || n != 3 {
		t.Fatalf("InsertMany: %d, %v", n, err)
	}
	var withTrace, without int
	if err := b.db.QueryRow(ctx, `SELECT count(*) FILTER (WHERE trace_context->>'traceparent' = $1),
		count(*) FILTER (WHERE trace_context IS NULL) FROM leash.jobs`, tc["traceparent"]).Scan(&withTrace, &without); err != nil {
		t.Fatal(err)
	}
	if withTrace != 2 || without != 1 {
		t.Fatalf("%d rows with the trace context, %d without", withTrace, without)
	}
	for name, bad := range map[string]map[string]string{
		"NUL":      {"traceparent": "a\x00b"},
		"bad utf8": {"tracestate": "\xff"},
		"no key":   {"": "x"},
		"too long": {"tracestate": strings.Repeat("x", pool.MaxTraceContextBytes)},
	} {
		if _, err := pool.Insert(ctx, b.db, "a", nil, &pool.InsertOpts{TraceContext: bad}); !errors.Is(err, pool.ErrInvalidJob) {
			t.Errorf("%s: %v, want ErrInvalidJob", name, err)
		}
	}
}

func TestLoggerCarriesTheAttempt(t *testing.T) {
	t.Parallel()
	if pool.Logger(context.Background()) != slog.Default() {
		t.Error("outside a handler Logger is not slog.Default()")
	}
	var logs syncbuf.Buffer
	cfg := fastConfig()
	cfg.ID = "w1"
	cfg.Logger = slog.New(slog.NewJSONHandler(&logs, nil))
	p, b := setup(t, nil, cfg, map[string]pool.Handler{
		"talk": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
			ctx, cancel := context.WithCancel(ctx) // derived contexts carry it too
			defer cancel()
			pool.Logger(ctx).InfoContext(ctx, "hello from the handler")
			return nil
		}),
	})
	id := insert(t, b.db, "talk", nil, &pool.InsertOpts{Queue: "default"})
	start(t, p)
	b.events.wait(t, 1, 20*time.Second)
	var line map[string]any
	for l := range strings.Lines(logs.String()) {
		if strings.Contains(l, "hello from the handler") {
			if err := json.Unmarshal([]byte(l), &line); err != nil {
				t.Fatal(err)
			}
		}
	}
	if line == nil {
		t.Fatalf("no handler line in:\n%s", logs.String())
	}
	r := getRow(t, b.db, id)
	want := map[string]any{"job_id": float64(id), "kind": "talk", "queue": "default", "attempt": float64(1),
		"lease_token": line["lease_token"], "worker": "w1"}
	for k, v := range want {
		if line[k] != v {
			t.Errorf("%s = %v (%T), want %v", k, line[k], line[k], v)
		}
	}
	if tok, ok := line["lease_token"].(float64); !ok || tok <= 0 || r.State != "completed" {
		t.Errorf("lease_token %v, row %+v", line["lease_token"], r)
	}
}

func TestHookSeesTimeout(t *testing.T) {
	t.Parallel()
	hook := newRecordingHook()
	cfg := fastConfig()
	cfg.Hooks = []pool.AttemptHook{hook}
	p, b := setup(t, nil, cfg, map[string]pool.Handler{"block": newBlocker()})
	insert(t, b.db, "block", nil, &pool.InsertOpts{Timeout: 50 * time.Millisecond, MaxAttempts: 1})
	start(t, p)
	a := hook.next(t)
	if len(a.causes) != 1 || !errors.Is(a.causes[0], pool.ErrTimeout) || a.ended.State != "failed" ||
		!errors.Is(a.ended.Cause, pool.ErrTimeout) {
		t.Fatalf("lease causes %v, ended %+v", a.causes, a.ended)
	}
}
