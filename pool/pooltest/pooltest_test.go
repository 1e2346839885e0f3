package pooltest_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/pool"
	"github.com/leashq/leash/pool/pooltest"
)

// snippet:start pooltest-main

func TestMain(m *testing.M) { pooltest.Main(m) }

// snippet:end pooltest-main

type greetArgs struct {
	Name string `json:"name"`
}

func (greetArgs) Kind() string { return "greet" }

// Without a database, the handler gets a live job and the result is what a pool would write.
func TestWorkWithoutDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, c := range map[string]struct {
		ret   error
		panic bool
		want  string
	}{
		"nil":       {want: pool.StateCompleted},
		"error":     {ret: errors.New("try again"), want: pool.StateRetryable},
		"permanent": {ret: pool.Permanent(errors.New("no")), want: pool.StateFailed},
		"panic":     {panic: true, want: pool.StateRetryable},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			res, err := pooltest.Work(ctx, nil, greetArgs{Name: "ada"}, nil, func(ctx context.Context, j *pool.Job, a greetArgs) error {
				if a.Name != "ada" || j.Kind != "greet" || j.Attempt != 1 || j.Queue != pool.QueueDefault {
					t.Errorf("job %+v, args %+v", j, a)
				}
				if err := j.EnsureActive(); err != nil {
					t.Errorf("EnsureActive: %v", err)
				}
				if err := j.SetProgress(ctx, 1); !errors.Is(err, pool.ErrFenced) {
					t.Errorf("SetProgress without a database: %v", err)
				}
				if c.panic {
					panic("boom")
				}
				return c.ret
			})
			if err != nil || res.State != c.want || (!c.panic && !errors.Is(res.Err, c.ret)) {
				t.Fatalf("got %+v, %v; want state %s", res, err, c.want)
			}
			var pe *pool.PanicError
			if c.panic != errors.As(res.Err, &pe) {
				t.Fatalf("panic recorded as %v", res.Err)
			}
		})
	}
}

// With a database, the job has a row and a lease token: fenced writes commit with the
// completion, and the outcome is written as a pool writes it.
func TestWorkWithDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pooltest.Database(t)
	if _, err := db.Exec(ctx, `CREATE TABLE greeted (name text)`); err != nil {
		t.Fatal(err)
	}
	greet := func(ctx context.Context, j *pool.Job, a greetArgs) error {
		if j.ID == 0 || j.Token == 0 {
			t.Errorf("job without a row: %+v", j)
		}
		if err := j.SetOutput(map[string]string{"greeted": a.Name}); err != nil {
			return err
		}
		return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if err := j.Fence(ctx, tx); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO greeted VALUES ($1)`, a.Name); err != nil {
				return err
			}
			return j.CompleteTx(ctx, tx)
		})
	}
	res, err := pooltest.Work(ctx, db, greetArgs{Name: "ada"}, &pool.InsertOpts{Queue: "people"}, greet)
	if err != nil || res.Err != nil || res.State != pool.StateCompleted || res.Job.Queue != "people" {
		t.Fatalf("got %+v, %v", res, err)
	}
	row, err := pool.GetJob(ctx, db, res.Job.ID)
	var out map[string]string
	if err != nil || json.Unmarshal(row.Output, &out) != nil || out["greeted"] != "ada" {
		t.Fatalf("output %s, %v", row.Output, err)
	}
	var n int
	db.QueryRow(ctx, `SELECT count(*) FROM greeted`).Scan(&n)
	if n != 1 {
		t.Fatalf("%d effects committed", n)
	}

	// A failure is written fenced, as retryable.
	res, err = pooltest.WorkHandler(ctx, db, "greet", greetArgs{Name: "bob"}, nil, pool.HandlerFunc(func(ctx context.Context, j *pool.Job) error {
		return errors.New("later")
	}))
	if err != nil || res.State != pool.StateRetryable {
		t.Fatalf("got %+v, %v", res, err)
	}

	// A revocation committed before the fence wins: the handler's context ends with
	// lease.ErrRevoked, nothing of its transaction commits, and the job ends cancelled.
	res, err = pooltest.Work(ctx, db, greetArgs{Name: "eve"}, nil, func(ctx context.Context, j *pool.Job, a greetArgs) error {
		if ok, err := pool.RevokeJob(ctx, db, j.ID, "test"); !ok || err != nil {
			t.Errorf("revoke: %v %v", ok, err)
		}
		err := greet(ctx, j, a)
		if !errors.Is(err, pool.ErrFenced) || !errors.Is(context.Cause(ctx), lease.ErrRevoked) {
			t.Errorf("fence after revocation: %v, cause %v", err, context.Cause(ctx))
		}
		return err
	})
	if err != nil || res.State != pool.StateCancelled {
		t.Fatalf("got %+v, %v", res, err)
	}
	db.QueryRow(ctx, `SELECT count(*) FROM greeted`).Scan(&n)
	if n != 1 {
		t.Fatalf("%d effects committed", n)
	}
}

// An application's test of a handler with fenced writes: a database of its own from Database,
// the handler's table, one attempt, and what it wrote.
func TestWelcomeWritesFenced(t *testing.T) {
	t.Parallel()
	// snippet:start pooltest-test
	ctx := context.Background()
	db := pooltest.Database(t) // a fresh database with leash's schema, dropped when t ends
	if _, err := db.Exec(ctx, `CREATE TABLE welcomed (email text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	res, err := pooltest.Work(ctx, db, SignupArgs{Email: "ada@example.com"}, nil, welcome(db))
	if err != nil {
		t.Fatal(err) // the helper failed: the job could not be inserted, claimed or settled
	}
	if res.Err != nil || res.State != pool.StateCompleted {
		t.Fatalf("handler returned %v; job %s", res.Err, res.State)
	}
	var n int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM welcomed`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d rows welcomed (%v), want 1", n, err)
	}
	// snippet:end pooltest-test
}
