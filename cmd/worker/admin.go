package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/leashq/leash/internal/store"
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
		Queue: *queue, Priority: int16(*priority), Delay: *delay, MaxAttempts: *maxAttempts})
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
	id, err := strconv.ParseInt(idArg, 10, 64)
	if err != nil || id <= 0 {
		return fmt.Errorf("revoke: need a job id, got %q", idArg)
	}
	db, err := connect(ctx, e)
	if err != nil {
		return err
	}
	defer db.Close()
	ok, err := store.Revoke(ctx, db, id, *reason)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("revoke: job %d is unknown or already finished", id)
	}
	fmt.Fprintf(stdout, "job %d revoked\n", id)
	return nil
}

func cmdStatus(ctx context.Context, e env, stdout io.Writer) error {
	db, err := connect(ctx, e)
	if err != nil {
		return err
	}
	defer db.Close()
	st, err := store.ReadStatus(ctx, db, 50)
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
