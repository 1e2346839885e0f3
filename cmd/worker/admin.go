package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/leashq/leash/pool"
)

func cmdEnqueue(ctx context.Context, e env, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("enqueue", flag.ContinueOnError)
	fs.SetOutput(stderr)
	kind := fs.String("kind", "", "job kind (handler name), e.g. noop, sleep (required)")
	payload := fs.String("payload", "{}", "job payload as JSON")
	queue := fs.String("queue", "default", "queue")
	priority := fs.Int("priority", 0, "priority, lower runs first (-32768..32767)")
	delay := fs.Duration("delay", 0, "run no sooner than this from now, e.g. 30s")
	maxAttempts := fs.Int("max-attempts", pool.MaxAttemptsDefault, "attempts before the job fails for good")
	uniqueKey := fs.String("unique-key", "", "skip the insert while another unfinished job has this key (prints that job's id)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("enqueue: unexpected argument %q", fs.Arg(0))
	}
	if *priority < -32768 || *priority > 32767 {
		return fmt.Errorf("enqueue: -priority %d out of range", *priority)
	}
	if !json.Valid([]byte(*payload)) {
		return fmt.Errorf("enqueue: -payload is not valid JSON: %s", *payload)
	}
	db, err := connect(ctx, e)
	if err != nil {
		return err
	}
	defer db.Close()
	id, err := pool.Insert(ctx, db, *kind, json.RawMessage(*payload), &pool.InsertOpts{
		Queue: *queue, Priority: int16(*priority), Delay: *delay, MaxAttempts: *maxAttempts, UniqueKey: *uniqueKey})
	if errors.Is(err, pool.ErrDuplicate) {
		fmt.Fprintf(stderr, "duplicate: job %d holds unique key %s\n", id, printable(*uniqueKey))
		fmt.Fprintln(stdout, id)
		return nil
	}
	if err != nil {
		return fmt.Errorf("enqueue: %w", err)
	}
	fmt.Fprintln(stdout, id)
	return nil
}

func cmdRevoke(ctx context.Context, e env, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("revoke", flag.ContinueOnError)
	fs.SetOutput(stderr)
	reason := fs.String("reason", "", "why, recorded on the job")
	// Accept the id before or after the flags.
	var idArg string
	if len(args) > 0 && args[0] != "" && args[0][0] != '-' {
		idArg, args = args[0], args[1:]
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if idArg == "" && fs.NArg() > 0 {
		idArg = fs.Arg(0)
	}
	id, err := parseJobID("revoke", idArg)
	if err != nil {
		return err
	}
	db, err := connect(ctx, e)
	if err != nil {
		return err
	}
	defer db.Close()
	ok, err := pool.RevokeJob(ctx, db, id, *reason)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("revoke: job %d is unknown or already finished", id)
	}
	fmt.Fprintf(stdout, "job %d revoked\n", id)
	return nil
}

func cmdStatus(ctx context.Context, e env, args []string, stdout io.Writer) error {
	if len(args) > 1 {
		return fmt.Errorf("status: want at most one job id")
	}
	var id int64
	if len(args) == 1 {
		var err error
		if id, err = parseJobID("status", args[0]); err != nil {
			return err
		}
	}
	db, err := connect(ctx, e)
	if err != nil {
		return err
	}
	defer db.Close()
	if id != 0 {
		return jobStatus(ctx, db, id, stdout)
	}
	st, err := pool.ReadStatus(ctx, db, pool.StatusParams{Running: 50, CountFinished: true})
	if err != nil {
		return err
	}
	w := tabwriter.NewWriter(stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(w, "QUEUE\tSTATE\tJOBS")
	for _, c := range st.Counts {
		fmt.Fprintf(w, "%s\t%s\t%d\n", c.Queue, c.State, c.Count)
	}
	w.Flush()
	if st.OldestWaiting != nil {
		fmt.Fprintf(stdout, "\noldest waiting job: %d (%s, queue %s), waiting %s\n", st.OldestWaiting.ID,
			st.OldestWaiting.Kind, st.OldestWaiting.Queue, st.OldestWaiting.Age.Round(time.Millisecond))
	} else {
		fmt.Fprintln(stdout, "\nno job waiting")
	}
	if len(st.Running) == 0 {
		fmt.Fprintln(stdout, "no job running")
		return nil
	}
	fmt.Fprintln(stdout)
	w = tabwriter.NewWriter(stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(w, "RUNNING\tKIND\tQUEUE\tHOLDER\tATTEMPT\tTOKEN\tHEARTBEAT AGE\tLEASE LEFT\tREVOKED\tPROGRESS")
	for _, r := range st.Running {
		revoked := ""
		if r.Revoked {
			revoked = "yes"
		}
		fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%d/%d\t%d\t%s\t%s\t%s\t%s\n", r.ID, r.Kind, r.Queue, r.Holder, r.Attempt, r.MaxAttempts,
			r.Token, r.HeartbeatAge.Round(time.Millisecond), r.LeaseLeft.Round(time.Millisecond), revoked, r.Progress)
	}
	return w.Flush()
}

// jobStatus prints one job: its state, attempts, error and output.
func jobStatus(ctx context.Context, db pool.DB, id int64, stdout io.Writer) error {
	j, err := pool.GetJob(ctx, db, id)
	if errors.Is(err, pool.ErrJobNotFound) {
		return fmt.Errorf("status: no job %d", id)
	}
	if err != nil {
		return err
	}
	opt := func(s string) string {
		if s == "" {
			return "-"
		}
		return s
	}
	when := func(t *time.Time) string {
		if t == nil {
			return "-"
		}
		return t.Local().Format(time.DateTime + ".000")
	}
	w := tabwriter.NewWriter(stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintf(w, "job\t%d\n", j.ID)
	fmt.Fprintf(w, "kind\t%s\n", printable(j.Kind))
	fmt.Fprintf(w, "queue\t%s\n", printable(j.Queue))
	fmt.Fprintf(w, "state\t%s\n", j.State)
	fmt.Fprintf(w, "attempt\t%d of %d\n", j.Attempt, j.MaxAttempts)
	fmt.Fprintf(w, "unique key\t%s\n", printable(opt(j.UniqueKey)))
	if j.WorkflowID != nil {
		fmt.Fprintf(w, "workflow\t%d, step %s\n", *j.WorkflowID, printable(clip(j.Step, 200)))
	}
	fmt.Fprintf(w, "created\t%s\n", when(&j.CreatedAt))
	fmt.Fprintf(w, "run at\t%s\n", when(&j.RunAt))
	fmt.Fprintf(w, "attempted\t%s\n", when(j.AttemptedAt))
	fmt.Fprintf(w, "finished\t%s\n", when(j.FinishedAt))
	if j.RevokedAt != nil {
		fmt.Fprintf(w, "revoked\t%s (%s)\n", when(j.RevokedAt), printable(clip(opt(j.RevokeReason), 200)))
	}
	fmt.Fprintf(w, "last error\t%s\n", printable(clip(opt(j.LastError), 500)))
	w.Flush()
	fmt.Fprintf(stdout, "output:\n%s\n", terminalSafe(clip(opt(string(j.Output)), 8<<10)))
	return nil
}

// clip cuts s to at most n bytes on a character boundary, saying how much it cut.
func clip(s string, n int) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + fmt.Sprintf("… [%d more bytes cut]", len(s)-cut)
}

// terminalSafe drops control characters other than newline and tab from text written by
// anyone (a job's output), so that it cannot rewrite the terminal.
func terminalSafe(s string) string {
	return strings.Map(func(r rune) rune {
		if (r < 0x20 && r != '\n' && r != '\t') || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return -1
		}
		return r
	}, s)
}

// parseJobID reads a job id given to command cmd: a positive whole number.
func parseJobID(cmd, s string) (int64, error) {
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil || id <= 0 {
		return 0, fmt.Errorf("%s: need a job id (a positive whole number), got %q", cmd, s)
	}
	return id, nil
}
