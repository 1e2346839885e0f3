package pool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/leashq/leash/internal/store"
)

// WorkflowJob is one job of a workflow: a step name unique in the workflow, the steps it waits
// for, and the job itself.
type WorkflowJob struct {
	// Step names the job in its workflow: 1 to 1024 bytes of valid UTF-8 without NUL.
	Step string
	// DependsOn lists the steps of the same workflow this job waits for: it is pending, never
	// claimed, until each of them completed.
	DependsOn []string
	// MayFail: when this job fails for good or is cancelled, the jobs waiting for it run anyway,
	// as if it had completed. Otherwise they are cancelled, and the jobs waiting for them.
	MayFail bool
	// Kind and Payload as for Insert (a JobArgs payload names its kind when Kind is empty).
	Kind    string
	Payload any
	// Opts as for Insert; UniqueKey and UniqueFinishedWithin must be empty.
	Opts *InsertOpts
}

// InsertedWorkflow is what InsertWorkflow inserted.
type InsertedWorkflow struct {
	ID int64
	// JobIDs are the jobs' ids, in the order of the jobs given.
	JobIDs []int64
}

// MaxWorkflowNameBytes bounds a workflow's name and a step's.
const MaxWorkflowNameBytes = 1024

// InsertWorkflow inserts a workflow and its jobs in one transaction: all of them or none. The
// jobs with dependencies are pending until those complete; the others are available at once.
// Steps must be unique, dependencies must name steps of the workflow, and they must not form a
// cycle: otherwise nothing is inserted and the error wraps ErrInvalidJob.
func InsertWorkflow(ctx context.Context, db Beginner, name string, jobs []WorkflowJob) (InsertedWorkflow, error) {
	var out InsertedWorkflow
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var err error
		out, err = InsertWorkflowTx(ctx, tx, name, jobs)
		return err
	})
	return out, err
}

// InsertWorkflowTx is InsertWorkflow inside the caller's transaction: the workflow's jobs become
// visible, and the graph is checked again by the database, when tx commits.
func InsertWorkflowTx(ctx context.Context, tx pgx.Tx, name string, jobs []WorkflowJob) (InsertedWorkflow, error) {
	if len(name) > MaxWorkflowNameBytes || !validName(name) {
		return InsertedWorkflow{}, fmt.Errorf("%w: workflow name must be at most %d bytes of valid UTF-8 without NUL", ErrInvalidJob, MaxWorkflowNameBytes)
	}
	ps, err := workflowParams(jobs, nil)
	if err != nil {
		return InsertedWorkflow{}, err
	}
	if err := checkAcyclic(jobs); err != nil {
		return InsertedWorkflow{}, err
	}
	wid, err := store.CreateWorkflow(ctx, tx, name)
	if err != nil {
		return InsertedWorkflow{}, err
	}
	ids, err := store.InsertWorkflowJobs(ctx, tx, wid, ps)
	if err != nil {
		return InsertedWorkflow{}, fmt.Errorf("insert workflow %q: %w", truncateForError(name), err)
	}
	return InsertedWorkflow{ID: wid, JobIDs: ids}, nil
}

// workflowParams checks jobs and turns them into the store's. A dependency must name a step of
// jobs, or one of known when known is not nil (jobs added to an existing workflow, whose other
// steps the database checks).
func workflowParams(jobs []WorkflowJob, known func(string) bool) ([]store.WorkflowJob, error) {
	steps := make(map[string]bool, len(jobs))
	for _, j := range jobs {
		if j.Step == "" || len(j.Step) > MaxWorkflowNameBytes || !validName(j.Step) {
			return nil, fmt.Errorf("%w: step %q: a step is 1 to %d bytes of valid UTF-8 without NUL", ErrInvalidJob, truncateForError(j.Step), MaxWorkflowNameBytes)
		}
		if steps[j.Step] {
			return nil, fmt.Errorf("%w: step %q appears twice", ErrInvalidJob, truncateForError(j.Step))
		}
		steps[j.Step] = true
	}
	out := make([]store.WorkflowJob, len(jobs))
	for i, j := range jobs {
		for _, d := range j.DependsOn {
			if d == "" || len(d) > MaxWorkflowNameBytes || !validName(d) {
				return nil, fmt.Errorf("%w: step %q depends on %q, which is no step name (1 to %d bytes of valid UTF-8 without NUL)",
					ErrInvalidJob, truncateForError(j.Step), truncateForError(d), MaxWorkflowNameBytes)
			}
			if !steps[d] && (known == nil || !known(d)) {
				return nil, fmt.Errorf("%w: step %q depends on unknown step %q", ErrInvalidJob, truncateForError(j.Step), truncateForError(d))
			}
		}
		if j.Opts != nil && (j.Opts.UniqueKey != "" || j.Opts.UniqueFinishedWithin != 0) {
			return nil, fmt.Errorf("%w: step %q: a job of a workflow has no unique key", ErrInvalidJob, truncateForError(j.Step))
		}
		kind, payload := j.Kind, j.Payload
		if a, ok := payload.(JobArgs); ok && kind == "" {
			kind = a.Kind()
		}
		p, err := params(kind, payload, j.Opts)
		if err != nil {
			return nil, fmt.Errorf("step %q: %w", truncateForError(j.Step), err)
		}
		out[i] = store.WorkflowJob{Step: j.Step, DependsOn: j.DependsOn, MayFail: j.MayFail, Params: p}
	}
	return out, nil
}

// checkAcyclic fails, wrapping ErrInvalidJob, when the dependencies among jobs form a cycle
// (Kahn's algorithm; dependencies outside jobs are ignored).
func checkAcyclic(jobs []WorkflowJob) error {
	pos := make(map[string]int, len(jobs))
	for i, j := range jobs {
		pos[j.Step] = i
	}
	indeg := make([]int, len(jobs))
	next := make([][]int, len(jobs))
	for i, j := range jobs {
		seen := map[string]bool{}
		for _, d := range j.DependsOn {
			if k, ok := pos[d]; ok && !seen[d] {
				seen[d] = true
				indeg[i]++
				next[k] = append(next[k], i)
			}
		}
	}
	queue := make([]int, 0, len(jobs))
	for i, n := range indeg {
		if n == 0 {
			queue = append(queue, i)
		}
	}
	for h := 0; h < len(queue); h++ {
		for _, k := range next[queue[h]] {
			if indeg[k]--; indeg[k] == 0 {
				queue = append(queue, k)
			}
		}
	}
	if len(queue) < len(jobs) {
		for i, n := range indeg {
			if n > 0 {
				return fmt.Errorf("%w: step %q is on or behind a cycle of dependencies", ErrInvalidJob, truncateForError(jobs[i].Step))
			}
		}
	}
	return nil
}

// RevokeWorkflow revokes every unfinished job of workflow id (leash.revoke_workflow) and returns
// how many: the running ones as RevokeJob does (their handlers' contexts are cancelled with
// lease.ErrRevoked), the queued and pending ones are cancelled at once. 0 for an unknown or
// finished workflow.
func RevokeWorkflow(ctx context.Context, db DB, id int64, reason string) (int, error) {
	return store.RevokeWorkflow(ctx, db, id, reason)
}

// WorkflowStep is one job of a workflow, as GetWorkflow reads it.
type WorkflowStep struct {
	ID        int64
	Step      string
	Kind      string
	State     string
	DependsOn []string
	MayFail   bool
	Attempt   int
	LastError string
}

// WorkflowInfo is a workflow and its jobs, in id order.
type WorkflowInfo struct {
	ID        int64
	Name      string
	CreatedAt time.Time
	Steps     []WorkflowStep
}

// ErrWorkflowNotFound: no workflow has the id asked for.
var ErrWorkflowNotFound = errors.New("workflow not found")

// GetWorkflow reads workflow id and at most limit of its jobs (1 to 100000).
func GetWorkflow(ctx context.Context, db DB, id int64, limit int) (WorkflowInfo, error) {
	if limit < 1 || limit > 100_000 {
		return WorkflowInfo{}, fmt.Errorf("get workflow: limit %d is not between 1 and 100000", limit)
	}
	w, err := store.ShowWorkflow(ctx, db, id, limit)
	if errors.Is(err, store.ErrNoWorkflow) {
		return WorkflowInfo{}, fmt.Errorf("get workflow %d: %w", id, ErrWorkflowNotFound)
	}
	if err != nil {
		return WorkflowInfo{}, err
	}
	out := WorkflowInfo{ID: w.ID, Name: w.Name, CreatedAt: w.CreatedAt, Steps: make([]WorkflowStep, len(w.Steps))}
	for i, s := range w.Steps {
		out.Steps[i] = WorkflowStep{ID: s.ID, Step: s.Step, Kind: s.Kind, State: s.State, DependsOn: s.DependsOn,
			MayFail: s.MayFail, Attempt: int(s.Attempt), LastError: s.LastError}
	}
	return out, nil
}

// DependencyOutputs returns the outputs (SetOutput) of the jobs this job depends on, by step, in
// one query; a dependency that recorded none maps to nil. Empty for a job outside workflows.
func (j *Job) DependencyOutputs(ctx context.Context) (map[string]json.RawMessage, error) {
	if j.db == nil {
		return nil, fmt.Errorf("dependency outputs of job %d: the job has no database (pooltest without one)", j.claim.ID)
	}
	return store.DependencyOutputs(ctx, j.db, j.claim.ID)
}

// AddToWorkflowTx adds jobs to this job's workflow inside tx, fenced by this claim (as Fence):
// they are inserted only if tx commits while the claim still holds the job, so an attempt that
// lost its lease adds nothing. waits makes jobs of the workflow that have not started (pending or
// available) wait for more steps too: waits["join"] = []string{"part-1", "part-2"}. Dependencies
// may name the new steps and the workflow's existing ones. It returns the new jobs' ids in the
// order given. The errors of a bad graph (unknown step, cycle, duplicate step, a waiting job that
// started) come from the statements or from tx's commit; nothing of tx commits then.
func (j *Job) AddToWorkflowTx(ctx context.Context, tx pgx.Tx, jobs []WorkflowJob, waits map[string][]string) ([]int64, error) {
	if err := j.Fence(ctx, tx); err != nil {
		return nil, err
	}
	wid, _, err := store.JobWorkflow(ctx, tx, j.claim.ID)
	if errors.Is(err, store.ErrNotInWorkflow) {
		return nil, fmt.Errorf("add to workflow: job %d: %w", j.claim.ID, ErrNotInWorkflow)
	}
	if err != nil {
		return nil, fmt.Errorf("add to workflow: %w", err)
	}
	ps, err := workflowParams(jobs, func(string) bool { return true })
	if err != nil {
		return nil, err
	}
	if err := checkAcyclic(jobs); err != nil {
		return nil, err
	}
	var ids []int64
	if len(ps) > 0 {
		if ids, err = store.InsertWorkflowJobs(ctx, tx, wid, ps); err != nil {
			return nil, fmt.Errorf("add to workflow %d: %w", wid, err)
		}
	}
	for step, more := range waits {
		if len(more) == 0 {
			continue
		}
		if err := store.AddDependencies(ctx, tx, wid, step, more); err != nil {
			return nil, fmt.Errorf("add to workflow %d: %w", wid, err)
		}
	}
	return ids, nil
}

// ErrNotInWorkflow: AddToWorkflowTx was called by a job that is in no workflow.
var ErrNotInWorkflow = errors.New("the job is in no workflow")
