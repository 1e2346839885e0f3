package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/leashq/leash/pool"
)

const workflowUsage = `usage: worker workflow show ID                 the workflow's jobs, their states and dependencies
       worker workflow revoke ID [-reason TEXT]  revoke every unfinished job of the workflow`

// workflowShowLimit bounds the jobs `worker workflow show` lists.
const workflowShowLimit = 10_000

// cmdWorkflow shows or revokes a workflow.
func cmdWorkflow(ctx context.Context, e env, args []string, stdout, stderr io.Writer) error {
	if len(args) < 2 {
		return fmt.Errorf("workflow: need a subcommand and a workflow id\n%s", workflowUsage)
	}
	sub, idArg, rest := args[0], args[1], args[2:]
	if sub != "show" && sub != "revoke" {
		return fmt.Errorf("workflow: unknown subcommand %q\n%s", sub, workflowUsage)
	}
	id, err := strconv.ParseInt(idArg, 10, 64)
	if err != nil || id <= 0 {
		return fmt.Errorf("workflow %s: need a workflow id (a positive whole number), got %q", sub, idArg)
	}
	fs := flag.NewFlagSet("workflow "+sub, flag.ContinueOnError)
	fs.SetOutput(stderr)
	reason := fs.String("reason", "", "why, recorded on each revoked job")
	if err := fs.Parse(rest); err != nil {
		return err
	}
	if fs.NArg() > 0 || (sub == "show" && *reason != "") {
		return fmt.Errorf("workflow %s: unexpected arguments\n%s", sub, workflowUsage)
	}
	db, err := connect(ctx, e)
	if err != nil {
		return err
	}
	defer db.Close()
	if sub == "revoke" {
		n, err := pool.RevokeWorkflow(ctx, db, id, *reason)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "workflow %d: %d unfinished job(s) revoked\n", id, n)
		return nil
	}
	w, err := pool.GetWorkflow(ctx, db, id, workflowShowLimit)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "workflow %d %s, created %s, %d job(s)%s\n", w.ID, strconv.Quote(w.Name),
		w.CreatedAt.Format("2006-01-02 15:04:05Z07:00"), len(w.Steps),
		map[bool]string{true: fmt.Sprintf(" (the first %d)", workflowShowLimit)}[len(w.Steps) == workflowShowLimit])
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTEP\tKIND\tSTATE\tATTEMPT\tDEPENDS ON\tLAST ERROR")
	for _, s := range w.Steps {
		deps := make([]string, len(s.DependsOn))
		for i, d := range s.DependsOn {
			deps[i] = strconv.Quote(d)
		}
		st := s.State
		if s.MayFail {
			st += " (may fail)"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\n", s.ID, strconv.Quote(s.Step), strconv.Quote(s.Kind), st, s.Attempt,
			strings.Join(deps, " "), strconv.Quote(truncate(s.LastError, 120)))
	}
	return tw.Flush()
}

// truncate cuts s to at most n runes.
func truncate(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n]) + "…"
}
