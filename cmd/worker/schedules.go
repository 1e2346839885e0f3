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

	"github.com/leashq/leash/pool"
)

const scheduleUsage = `usage: worker schedule list
       worker schedule add -name NAME -spec SPEC -kind KIND [-payload JSON] [-queue Q] [-priority N] [-max-attempts N] [-timeout D]
       worker schedule remove NAME
SPEC: a 5-field cron expression in UTC ("0 9 * * 1-5"), optionally after CRON_TZ=<zone>;
@hourly, @daily, @weekly, @monthly, @yearly; or @every <duration> ("@every 15m").`

// cmdSchedule lists, adds and removes durable schedules (leash.schedules).
func cmdSchedule(ctx context.Context, e env, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return fmt.Errorf("schedule: need a subcommand\n%s", scheduleUsage)
	}
	sub, args := args[0], args[1:]
	switch sub {
	case "list":
		if len(args) != 0 {
			return fmt.Errorf("schedule list takes no arguments\n%s", scheduleUsage)
		}
		db, err := connect(ctx, e)
		if err != nil {
			return err
		}
		defer db.Close()
		return listSchedules(ctx, db, stdout)
	case "remove":
		if len(args) != 1 {
			return fmt.Errorf("schedule remove: need one name\n%s", scheduleUsage)
		}
		db, err := connect(ctx, e)
		if err != nil {
			return err
		}
		defer db.Close()
		ok, err := pool.RemoveSchedule(ctx, db, args[0])
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("schedule remove: no schedule named %s", printable(args[0]))
		}
		fmt.Fprintf(stdout, "schedule %s removed\n", printable(args[0]))
		return nil
	case "add":
		fs := flag.NewFlagSet("schedule add", flag.ContinueOnError)
		fs.SetOutput(stderr)
		name := fs.String("name", "", "schedule name (required)")
		spec := fs.String("spec", "", "when it fires (required), e.g. '0 9 * * 1-5' or '@every 15m'")
		kind := fs.String("kind", "", "kind of the jobs it enqueues (required)")
		payload := fs.String("payload", "{}", "payload of its jobs, as JSON")
		queue := fs.String("queue", pool.QueueDefault, "queue of its jobs")
		priority := fs.Int("priority", 0, "priority of its jobs (-32768..32767)")
		maxAttempts := fs.Int("max-attempts", pool.MaxAttemptsDefault, "attempts of each of its jobs")
		timeout := fs.Duration("timeout", 0, "time limit of one attempt (0: the kind's default)")
		if err := fs.Parse(args); err != nil {
			return err
		}
		switch {
		case fs.NArg() > 0:
			return fmt.Errorf("schedule add: unexpected argument %s", printable(fs.Arg(0)))
		case *name == "" || *spec == "" || *kind == "":
			return fmt.Errorf("schedule add: -name, -spec and -kind are required\n%s", scheduleUsage)
		case *priority < -32768 || *priority > 32767:
			return fmt.Errorf("schedule add: -priority %d out of range", *priority)
		case !json.Valid([]byte(*payload)):
			return fmt.Errorf("schedule add: -payload is not valid JSON")
		}
		if err := pool.ValidateSpec(*spec); err != nil {
			return fmt.Errorf("schedule add: %w", err)
		}
		db, err := connect(ctx, e)
		if err != nil {
			return err
		}
		defer db.Close()
		err = pool.UpsertSchedule(ctx, db, pool.Schedule{Name: *name, Spec: *spec, Kind: *kind, Payload: json.RawMessage(*payload),
			Queue: *queue, Priority: int16(*priority), MaxAttempts: *maxAttempts, Timeout: *timeout})
		if err != nil {
			return fmt.Errorf("schedule add: %w", err)
		}
		fmt.Fprintf(stdout, "schedule %s stored; it fires from its next tick\n", printable(*name))
		return nil
	}
	return fmt.Errorf("schedule: unknown subcommand %s\n%s", printable(sub), scheduleUsage)
}

func listSchedules(ctx context.Context, db pool.DB, stdout io.Writer) error {
	list, err := pool.ListSchedules(ctx, db)
	if err != nil {
		return err
	}
	if len(list) == 0 {
		fmt.Fprintln(stdout, "no schedules")
		return nil
	}
	when := func(t *time.Time) string {
		if t == nil {
			return "-"
		}
		return t.Local().Format(time.DateTime)
	}
	tw := tabwriter.NewWriter(stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSPEC\tKIND\tQUEUE\tNEXT RUN\tLAST RUN\tLAST JOB\tERROR")
	for _, s := range list {
		next := when(s.NextRunAt)
		switch {
		case s.NextRunAt == nil:
			next = "at the next check"
		case s.Stopped():
			next = "stopped (bad spec)"
		}
		last := "-"
		if s.LastJobID != nil {
			last = strconv.FormatInt(*s.LastJobID, 10)
		}
		errText := "-"
		if s.LastError != "" {
			errText = clip(s.LastError, 120)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", printable(s.Name), printable(s.Spec), printable(s.Kind), printable(s.Queue),
			next, when(s.LastRunAt), last, printable(errText))
	}
	return tw.Flush()
}
