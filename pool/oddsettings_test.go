package pool_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/syncbuf"
	"github.com/leashq/leash/pool"
)

// Settings a DBA may give a database that leash neither pins nor refuses (they do not change what
// its statements mean over pgx's binary protocol), and a few it pins: inserts with every option,
// handlers writing progress, output and a fenced completion on the application's pool, a
// failure's error history, a schedule, all without a warning.
func TestWorkerUnderOddSessionSettings(t *testing.T) {
	t.Parallel()
	for _, set := range []string{
		"default_transaction_deferrable = on",
		"lock_timeout = '1ms'",
		"vacuum_freeze_min_age = 0",
		"log_min_duration_statement = 0",
		`"DateStyle" = 'SQL, DMY'`,
		`"IntervalStyle" = 'iso_8601'`,
		`"IntervalStyle" = 'sql_standard'`,
		`"TimeZone" = 'Pacific/Chatham'`,
		"extra_float_digits = -15",
		"bytea_output = 'escape'",
		"standard_conforming_strings = off",
		"array_nulls = off",
		"transform_null_equals = on",
		"default_transaction_isolation = 'serializable'",
		"search_path = ''",
	} {
		t.Run(set, func(t *testing.T) {
			t.Parallel()
			url := pgtest.URL(t)
			pgtest.Exec(t, url, "ALTER DATABASE "+dbIdent(t, url)+" SET "+set)
			logs := &syncbuf.Buffer{}
			cfg := fastConfig()
			cfg.Logger = slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
			cfg.Timeouts = map[string]time.Duration{"fenced": 10 * time.Second}
			cfg.Schedules = []pool.Schedule{{Name: "s", Spec: "@every 200ms", Kind: "noop"}}
			db := pgtest.PoolFor(t, url)
			p, b := setup(t, db, cfg, map[string]pool.Handler{
				"noop": pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil }),
				"fenced": pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
					if err := j.SetProgress(ctx, map[string]any{"x": 1.5, "s": `a\b`}); err != nil {
						return err
					}
					j.SetOutput(map[string]any{"f": 0.1, "b": []byte{0, 1, 2}})
					// Under SERIALIZABLE a renewal committed after the transaction's snapshot
					// fails it with 40001, as Fence documents; the handler retries as advised.
					for attempt := 1; ; attempt++ {
						err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
							if err := j.Fence(ctx, tx); err != nil {
								return err
							}
							return j.CompleteTx(ctx, tx)
						})
						var pgErr *pgconn.PgError
						if attempt < 5 && errors.As(err, &pgErr) && pgErr.Code == "40001" {
							continue
						}
						return err
					}
				}),
				"fail": pool.HandlerFunc(func(context.Context, *pool.Job) error { return pool.Permanent(errStr(`bad \ 'x'`)) }),
			})
			start(t, p)
			ctx := context.Background()
			var problems []string
			if _, err := pool.Insert(ctx, db, "noop", nil, &pool.InsertOpts{UniqueKey: `k\1`, Delay: 10 * time.Millisecond, Timeout: 1500 * time.Millisecond}); err != nil {
				problems = append(problems, "insert: "+err.Error())
			}
			if _, err := pool.Insert(ctx, db, "fenced", map[string]any{"a": `x\y`}, nil); err != nil {
				problems = append(problems, "insert fenced: "+err.Error())
			}
			if _, err := pool.Insert(ctx, db, "fail", nil, nil); err != nil {
				problems = append(problems, "insert fail: "+err.Error())
			}
			deadline := time.After(15 * time.Second)
			got := map[string]string{}
		wait:
			for len(got) < 3 {
				select {
				case ev := <-b.events:
					if ev.Kind != "noop" || got["noop"] == "" {
						got[ev.Kind] = ev.State
					}
				case <-deadline:
					break wait
				}
			}
			if got["noop"] != "completed" || got["fenced"] != "completed" || got["fail"] != "failed" {
				problems = append(problems, "outcomes: "+mustJSON(got))
			}
			var out, prog, errs string
			db.QueryRow(ctx, "SELECT coalesce(output::text, ''), coalesce(progress::text, '') FROM leash.jobs WHERE kind = 'fenced'").Scan(&out, &prog)
			db.QueryRow(ctx, "SELECT errors::text FROM leash.jobs WHERE kind = 'fail'").Scan(&errs)
			var ticks int
			for range 100 {
				db.QueryRow(ctx, "SELECT count(*) FROM leash.jobs WHERE kind = 'noop' AND state = 'completed'").Scan(&ticks)
				if ticks >= 3 {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			if w := logs.String(); strings.Contains(w, `"level":"WARN"`) || strings.Contains(w, `"level":"ERROR"`) {
				problems = append(problems, "logs: "+w)
			}
			if p.Ready() != nil {
				problems = append(problems, "ready: "+p.Ready().Error())
			}
			if out != `{"b": "AAEC", "f": 0.1}` || prog != `{"s": "a\\b", "x": 1.5}` || !strings.Contains(errs, `"error": "bad \\ 'x'"`) {
				problems = append(problems, "rows: output "+out+", progress "+prog+", errors "+errs)
			}
			if ticks < 3 {
				problems = append(problems, "the schedule enqueued nothing")
			}
			if len(problems) > 0 {
				t.Errorf("%s:\n%s", set, strings.Join(problems, "\n"))
			}
		})
	}
}

type errStr string

func (e errStr) Error() string { return string(e) }

func mustJSON(v any) string { b, _ := json.Marshal(v); return string(b) }
