package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/leashq/leash/internal/clean"
)

// WorkflowJob is one job of a workflow: its step name, the steps it waits for and the job
// itself (UniqueKey must be empty).
type WorkflowJob struct {
	Step      string
	DependsOn []string
	// MayFail: when this job fails for good or is cancelled, the jobs waiting for it run anyway.
	MayFail bool
	Params  InsertParams
}

// insertWorkflowJobsSQL inserts the jobs of workflow $1 in one statement, in the order given,
// and returns their ids in that order. The triggers of leash.jobs make the ones with
// dependencies pending and check the graph at commit.
const insertWorkflowJobsSQL = `
	WITH j AS (
		SELECT * FROM ROWS FROM (
			pg_catalog.unnest($2::text[]), pg_catalog.unnest($3::text[]), pg_catalog.unnest($4::text[]),
			pg_catalog.unnest($5::smallint[]), pg_catalog.unnest($6::integer[]), pg_catalog.unnest($7::timestamptz[]),
			pg_catalog.unnest($8::interval[]), pg_catalog.unnest($9::interval[]), pg_catalog.unnest($10::text[]),
			pg_catalog.unnest($11::text[]), pg_catalog.unnest($12::text[]), pg_catalog.unnest($13::boolean[]),
			pg_catalog.unnest($14::text[]))
		         WITH ORDINALITY AS u(queue, kind, payload, priority, max_attempts, run_at, delay, timeout,
		                              trace_context, step, depends_on, may_fail, concurrency_key, ord)
	), ins AS (
		INSERT INTO leash.jobs (queue, kind, payload, priority, max_attempts, run_at, timeout, trace_context,
		                        workflow_id, step, depends_on, may_fail, concurrency_key)
		SELECT j.queue, j.kind, j.payload::pg_catalog.jsonb, j.priority, j.max_attempts,
		       coalesce(j.run_at, pg_catalog.now() OPERATOR(pg_catalog.+) j.delay), j.timeout, j.trace_context::pg_catalog.jsonb,
		       $1, j.step,
		       CASE WHEN j.depends_on IS NOT NULL
		            THEN ARRAY(SELECT pg_catalog.jsonb_array_elements_text(j.depends_on::pg_catalog.jsonb)) END,
		       nullif(j.may_fail, false), j.concurrency_key
		FROM j ORDER BY j.ord
		RETURNING id, step
	)
	SELECT ins.id FROM ins JOIN j ON j.step OPERATOR(pg_catalog.=) ins.step ORDER BY j.ord`

// copyWorkflowJobsMin is the number of jobs from which InsertWorkflowJobs copies them in
// (COPY, then one read of their ids) rather than inserting them with one statement: COPY takes
// half the time of the statement for thousands of jobs, and one round trip more.
const copyWorkflowJobsMin = 256

// InsertWorkflowJobs inserts jobs into workflow wid in one statement (a COPY when there are many
// and tx can copy) and returns their ids in the order of jobs. Run it in a transaction: the graph
// is checked, and jobs with dependencies settled, when it commits.
func InsertWorkflowJobs(ctx context.Context, tx DBTX, wid int64, jobs []WorkflowJob) ([]int64, error) {
	n := len(jobs)
	for i := range jobs {
		if jobs[i].Params.UniqueKey != "" {
			return nil, fmt.Errorf("insert workflow jobs: step %q: a job of a workflow has no unique key", jobs[i].Step)
		}
		// The statement passes dependencies as JSON, whose encoder would replace invalid UTF-8
		// with U+FFFD: another step's name.
		for _, d := range jobs[i].DependsOn {
			if !utf8.ValidString(d) || strings.ContainsRune(d, 0) {
				return nil, fmt.Errorf("insert workflow jobs: step %q: dependency %q is not valid UTF-8 without NUL", jobs[i].Step, d)
			}
		}
	}
	if c, ok := tx.(copier); ok && n >= copyWorkflowJobsMin {
		return copyWorkflowJobs(ctx, tx, c, wid, jobs)
	}
	queues, kinds, payloads := make([]string, n), make([]string, n), make([]*string, n)
	prios, attempts := make([]int16, n), make([]int32, n)
	runAts, delays, timeouts := make([]pgtype.Timestamptz, n), make([]pgtype.Interval, n), make([]pgtype.Interval, n)
	traces, steps, deps, mayFail := make([]*string, n), make([]string, n), make([]*string, n), make([]bool, n)
	ckeys := make([]*string, n)
	for i := range jobs {
		p := &jobs[i].Params
		queues[i], kinds[i], prios[i], attempts[i] = p.Queue, p.Kind, p.Priority, p.MaxAttempts
		if p.Payload != nil {
			s := string(p.Payload)
			payloads[i] = &s
		} else {
			s := "{}"
			payloads[i] = &s
		}
		runAts[i] = pgtype.Timestamptz{Time: p.RunAt, Valid: !p.RunAt.IsZero()}
		delays[i] = interval(p.Delay)
		timeouts[i] = nullInterval(p.Timeout)
		if p.TraceContext != nil {
			s := string(p.TraceContext)
			traces[i] = &s
		}
		steps[i] = jobs[i].Step
		if len(jobs[i].DependsOn) > 0 {
			b, err := json.Marshal(jobs[i].DependsOn)
			if err != nil {
				return nil, fmt.Errorf("insert workflow jobs: %w", err)
			}
			s := string(b)
			deps[i] = &s
		}
		mayFail[i] = jobs[i].MayFail
		if p.ConcurrencyKey != "" {
			ckeys[i] = &p.ConcurrencyKey
		}
	}
	rows, err := tx.Query(ctx, insertWorkflowJobsSQL, wid, queues, kinds, payloads, prios, attempts,
		runAts, delays, timeouts, traces, steps, deps, mayFail, ckeys)
	if err != nil {
		return nil, explainInsertError("insert workflow jobs", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, explainInsertError("insert workflow jobs", err)
	}
	if len(ids) != n {
		return nil, fmt.Errorf("insert workflow jobs: %d of %d inserted", len(ids), n)
	}
	return ids, nil
}

// copier is a transaction that can COPY.
type copier interface {
	CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error)
}

// copyWorkflowJobs is InsertWorkflowJobs by COPY: the jobs' rows are copied in, in order (the
// same triggers fire for each), then their ids are read by (workflow, step), which the unique
// index of a workflow's steps maps to one job each.
func copyWorkflowJobs(ctx context.Context, tx DBTX, c copier, wid int64, jobs []WorkflowJob) ([]int64, error) {
	scheduled := false
	for i := range jobs {
		scheduled = scheduled || jobs[i].Params.scheduled()
	}
	var now time.Time
	if scheduled {
		if err := tx.QueryRow(ctx, "SELECT pg_catalog.now()").Scan(&now); err != nil {
			return nil, fmt.Errorf("insert workflow jobs: read database clock: %w", err)
		}
	}
	cols := []string{"queue", "kind", "payload", "priority", "max_attempts", "timeout", "trace_context",
		"workflow_id", "step", "depends_on", "may_fail", "concurrency_key"}
	if scheduled {
		cols = append(cols, "run_at")
	}
	steps := make([]string, len(jobs))
	_, err := c.CopyFrom(ctx, pgx.Identifier{"leash", "jobs"}, cols, pgx.CopyFromSlice(len(jobs), func(i int) ([]any, error) {
		j := &jobs[i]
		p := &j.Params
		steps[i] = j.Step
		payload := p.Payload
		if payload == nil {
			payload = []byte("{}")
		}
		var deps any
		if len(j.DependsOn) > 0 {
			deps = j.DependsOn
		}
		var mayFail any
		if j.MayFail {
			mayFail = true
		}
		r := []any{p.Queue, p.Kind, string(payload), p.Priority, p.MaxAttempts, nullInterval(p.Timeout),
			nullJSON(p.TraceContext), wid, j.Step, deps, mayFail, nullText(p.ConcurrencyKey)}
		if scheduled {
			runAt := p.RunAt
			if runAt.IsZero() {
				runAt = now.Add(p.Delay)
			}
			r = append(r, runAt)
		}
		return r, nil
	}))
	if err != nil {
		return nil, explainInsertError("insert workflow jobs", err)
	}
	rows, err := tx.Query(ctx, `
		SELECT id, step FROM leash.jobs
		WHERE workflow_id OPERATOR(pg_catalog.=) $1 AND step OPERATOR(pg_catalog.=) ANY ($2::text[])`, wid, steps)
	if err != nil {
		return nil, fmt.Errorf("insert workflow jobs: read their ids: %w", err)
	}
	byStep := make(map[string]int64, len(jobs))
	var id int64
	var step string
	if _, err := pgx.ForEachRow(rows, []any{&id, &step}, func() error {
		byStep[step] = id
		return nil
	}); err != nil {
		return nil, fmt.Errorf("insert workflow jobs: read their ids: %w", err)
	}
	ids := make([]int64, len(jobs))
	for i := range jobs {
		var ok bool
		if ids[i], ok = byStep[jobs[i].Step]; !ok {
			return nil, fmt.Errorf("insert workflow jobs: step %q not found after its insert", jobs[i].Step)
		}
	}
	return ids, nil
}

// CreateWorkflow inserts a workflow's row and returns its id.
func CreateWorkflow(ctx context.Context, tx DBTX, name string) (int64, error) {
	var id int64
	if err := tx.QueryRow(ctx, `INSERT INTO leash.workflows (name) VALUES ($1) RETURNING id`, name).Scan(&id); err != nil {
		return 0, fmt.Errorf("create workflow: %w", err)
	}
	return id, nil
}

// ErrNotInWorkflow is returned when a job that is in no workflow asks for its workflow.
var ErrNotInWorkflow = errors.New("the job is in no workflow")

// JobWorkflow returns the workflow and step of job id.
func JobWorkflow(ctx context.Context, db DBTX, id int64) (wid int64, step string, err error) {
	var w pgtype.Int8
	var s pgtype.Text
	err = db.QueryRow(ctx, `SELECT workflow_id, step FROM leash.jobs WHERE id OPERATOR(pg_catalog.=) $1`, id).Scan(&w, &s)
	if err != nil {
		return 0, "", fmt.Errorf("read workflow of job %d: %w", id, err)
	}
	if !w.Valid {
		return 0, "", fmt.Errorf("job %d: %w", id, ErrNotInWorkflow)
	}
	return w.Int64, s.String, nil
}

// AddDependencies makes the job of step in workflow wid wait for more steps too. It fails when
// that job has started or finished, or there is no such step.
func AddDependencies(ctx context.Context, tx DBTX, wid int64, step string, more []string) error {
	tag, err := tx.Exec(ctx, `
		UPDATE leash.jobs
		SET depends_on = ARRAY(SELECT DISTINCT x FROM pg_catalog.unnest(coalesce(depends_on, '{}') OPERATOR(pg_catalog.||) $3::text[]) x)
		WHERE workflow_id OPERATOR(pg_catalog.=) $1 AND step OPERATOR(pg_catalog.=) $2`, wid, step, more)
	if err != nil {
		return fmt.Errorf("add dependencies to step %q: %w", step, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("add dependencies to step %q: workflow %d has no such step", step, wid)
	}
	return nil
}

// DependencyOutputs returns, by step, the outputs of the jobs job id depends on (nil for a
// dependency that recorded none), in one query.
func DependencyOutputs(ctx context.Context, db DBTX, id int64) (map[string]json.RawMessage, error) {
	rows, err := db.Query(ctx, `
		SELECT d.step, d.output FROM leash.jobs j
		JOIN leash.jobs d ON d.workflow_id OPERATOR(pg_catalog.=) j.workflow_id
		                 AND d.step OPERATOR(pg_catalog.=) ANY (j.depends_on)
		WHERE j.id OPERATOR(pg_catalog.=) $1`, id)
	if err != nil {
		return nil, fmt.Errorf("read dependency outputs of job %d: %w", id, err)
	}
	out := map[string]json.RawMessage{}
	var step string
	var output []byte
	_, err = pgx.ForEachRow(rows, []any{&step, &output}, func() error {
		if output != nil {
			out[step] = json.RawMessage(append([]byte(nil), output...))
		} else {
			out[step] = nil
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read dependency outputs of job %d: %w", id, err)
	}
	return out, nil
}

// RevokeWorkflow calls leash.revoke_workflow: how many unfinished jobs it revoked.
func RevokeWorkflow(ctx context.Context, db DBTX, id int64, reason string) (int, error) {
	var n int32
	if err := db.QueryRow(ctx, `SELECT leash.revoke_workflow($1, nullif($2, ''))`, id, clean.Text(reason, MaxReasonBytes)).Scan(&n); err != nil {
		return 0, fmt.Errorf("revoke workflow %d: %w", id, err)
	}
	return int(n), nil
}

// WorkflowStep is one job of a workflow as `worker workflow show` and the admin page show it.
type WorkflowStep struct {
	ID        int64
	Step      string
	Kind      string
	State     string
	DependsOn []string
	MayFail   bool
	Attempt   int32
	LastError string
}

// Workflow is a workflow and its jobs.
type Workflow struct {
	ID        int64
	Name      string
	CreatedAt time.Time
	Steps     []WorkflowStep
}

// ErrNoWorkflow is returned for an unknown workflow id.
var ErrNoWorkflow = errors.New("no such workflow")

// ShowWorkflow reads workflow id and its jobs in id order, at most limit of them.
func ShowWorkflow(ctx context.Context, db DBTX, id int64, limit int) (Workflow, error) {
	w := Workflow{ID: id}
	err := db.QueryRow(ctx, `SELECT name, created_at FROM leash.workflows WHERE id = $1`, id).Scan(&w.Name, &w.CreatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return w, fmt.Errorf("workflow %d: %w", id, ErrNoWorkflow)
	}
	if err != nil {
		return w, fmt.Errorf("read workflow %d: %w", id, err)
	}
	rows, err := db.Query(ctx, `
		SELECT id, step, kind, state, coalesce(depends_on, '{}'), coalesce(may_fail, false), attempt, coalesce(last_error, '')
		FROM leash.jobs WHERE workflow_id = $1 ORDER BY id LIMIT $2`, id, limit)
	if err != nil {
		return w, fmt.Errorf("read jobs of workflow %d: %w", id, err)
	}
	w.Steps, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (WorkflowStep, error) {
		var s WorkflowStep
		err := r.Scan(&s.ID, &s.Step, &s.Kind, &s.State, &s.DependsOn, &s.MayFail, &s.Attempt, &s.LastError)
		return s, err
	})
	if err != nil {
		return w, fmt.Errorf("read jobs of workflow %d: %w", id, err)
	}
	return w, nil
}
