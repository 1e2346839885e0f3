package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/leashq/leash/pool"
)

const queueUsage = `usage: worker queue list
       worker queue pause NAME     no worker starts a job of NAME until it is resumed
       worker queue resume NAME
       worker queue cap NAME N     at most N jobs of NAME run at once across all workers
       worker queue cap NAME none  remove the cap
       worker queue limit NAME -per-key N     at most N jobs of one concurrency key of NAME
                                              hold the key at once (1: each key's jobs run in turn)
       worker queue limit NAME -per-key none  remove the per-key limit
       worker queue limit NAME -rate R/PERIOD  at most R starts of NAME's jobs in any window of
                                              PERIOD across all workers (5/s, 100/1m, 2000/1s)
       worker queue limit NAME -rate none      remove the rate limit
       worker queue limit NAME -key-rate R/PERIOD  at most R starts of the jobs of one
                                              concurrency key of NAME in any window of PERIOD
       worker queue limit NAME -key-rate none  remove the per-key rate limit`

// cmdQueue lists, pauses, resumes, caps and limits per key queues (leash.queues).
func cmdQueue(ctx context.Context, e env, args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return fmt.Errorf("queue: need a subcommand\n%s", queueUsage)
	}
	sub, args := args[0], args[1:]
	want := map[string]int{"list": 0, "pause": 1, "resume": 1, "cap": 2, "limit": 3}
	n, ok := want[sub]
	if !ok {
		return fmt.Errorf("queue: unknown subcommand %q\n%s", sub, queueUsage)
	}
	if len(args) != n {
		return fmt.Errorf("queue %s: want %d argument(s), got %d\n%s", sub, n, len(args), queueUsage)
	}
	var max int
	var period time.Duration
	switch sub {
	case "cap":
		if args[1] == "none" {
			max = -1
		} else if v, err := strconv.Atoi(args[1]); err != nil || v < 0 {
			return fmt.Errorf("queue cap: the cap must be a whole number ≥ 0 or none, got %q", args[1])
		} else {
			max = v
		}
	case "limit":
		if args[1] == "-rate" || args[1] == "--rate" || args[1] == "-key-rate" || args[1] == "--key-rate" {
			r, per, err := parseRate(args[2], strings.HasSuffix(args[1], "key-rate"))
			if err != nil {
				return fmt.Errorf("queue limit: %w", err)
			}
			max, period = r, per
			break
		}
		if args[1] != "-per-key" && args[1] != "--per-key" {
			return fmt.Errorf("queue limit: want -per-key N, -rate R/PERIOD or -key-rate R/PERIOD, got %q\n%s", args[1], queueUsage)
		}
		if args[2] == "none" {
			max = -1
		} else if v, err := strconv.Atoi(args[2]); err != nil || v < 0 {
			return fmt.Errorf("queue limit: the per-key limit must be a whole number ≥ 0 or none, got %q", args[2])
		} else {
			max = v
		}
	}
	db, err := connect(ctx, e)
	if err != nil {
		return err
	}
	defer db.Close()
	switch sub {
	case "pause":
		changed, err := pool.PauseQueue(ctx, db, args[0])
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "queue %s paused%s\n", args[0], map[bool]string{true: "", false: " (it already was)"}[changed])
	case "resume":
		changed, err := pool.ResumeQueue(ctx, db, args[0])
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "queue %s %s\n", args[0], map[bool]string{true: "resumed", false: "was not paused"}[changed])
	case "cap":
		if err := pool.SetQueueMaxRunning(ctx, db, args[0], max); err != nil {
			return err
		}
		if max < 0 {
			fmt.Fprintf(stdout, "queue %s uncapped\n", args[0])
		} else {
			fmt.Fprintf(stdout, "queue %s capped at %d running jobs\n", args[0], max)
		}
	case "limit":
		if args[1] == "-key-rate" || args[1] == "--key-rate" {
			if err := pool.SetQueueKeyRateLimit(ctx, db, args[0], max, period); err != nil {
				return err
			}
			if max < 0 {
				fmt.Fprintf(stdout, "queue %s has no per-key rate limit\n", args[0])
			} else {
				fmt.Fprintf(stdout, "queue %s: at most %s starts of one key\n", args[0], rateText(max, period))
			}
			return nil
		}
		if args[1] == "-rate" || args[1] == "--rate" {
			if err := pool.SetQueueRateLimit(ctx, db, args[0], max, period); err != nil {
				return err
			}
			if max < 0 {
				fmt.Fprintf(stdout, "queue %s has no rate limit\n", args[0])
			} else {
				fmt.Fprintf(stdout, "queue %s: at most %s starts\n", args[0], rateText(max, period))
			}
			return nil
		}
		if err := pool.SetQueueMaxRunningPerKey(ctx, db, args[0], max); err != nil {
			return err
		}
		if max < 0 {
			fmt.Fprintf(stdout, "queue %s has no per-key limit\n", args[0])
		} else {
			fmt.Fprintf(stdout, "queue %s: at most %d jobs of one key at once\n", args[0], max)
		}
	case "list":
		qs, err := pool.ListQueues(ctx, db)
		if err != nil {
			return err
		}
		if len(qs) == 0 {
			fmt.Fprintln(stdout, "no queue has jobs waiting or running, or a control row")
			return nil
		}
		tw := tabwriter.NewWriter(stdout, 2, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "QUEUE\tSTATE\tMAX RUNNING\tPER KEY\tRATE\tKEY RATE\tRUNNING\tWAITING")
		for _, q := range qs {
			state := "active"
			if q.PausedAt != nil {
				state = "paused since " + q.PausedAt.Local().Format(time.DateTime)
			}
			capText := "-"
			if q.MaxRunning != nil {
				capText = strconv.Itoa(*q.MaxRunning)
			}
			perKey := "-"
			if q.MaxRunningPerKey != nil {
				perKey = strconv.Itoa(*q.MaxRunningPerKey)
			}
			rate := "-"
			if q.RateLimit != nil {
				rate = rateText(*q.RateLimit, q.RatePeriod)
			}
			keyRate := "-"
			if q.KeyRateLimit != nil {
				keyRate = rateText(*q.KeyRateLimit, q.KeyRatePeriod)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\n", printable(q.Name), state, capText, perKey, rate, keyRate, q.Running, q.Available)
		}
		return tw.Flush()
	}
	return nil
}

// parseRate reads R/PERIOD (PERIOD a Go duration, or a unit alone meaning one of it: 5/s,
// 100/1m, 2000/1s), or none (-1); perKey: a per-key rate, whose R is bounded lower.
func parseRate(s string, perKey bool) (int, time.Duration, error) {
	if s == "none" {
		return -1, 0, nil
	}
	most := pool.MaxRateLimit
	if perKey {
		most = pool.MaxKeyRateLimit
	}
	rs, ps, ok := strings.Cut(s, "/")
	r, err := strconv.Atoi(rs)
	if !ok || err != nil || r < 0 || r > most {
		return 0, 0, fmt.Errorf("the rate must be R/PERIOD with R a whole number from 0 to %d (5/s, 100/1m), or none, got %q", most, s)
	}
	if ps != "" && (ps[0] < '0' || ps[0] > '9') {
		ps = "1" + ps
	}
	per, err := time.ParseDuration(ps)
	if err != nil || per < time.Millisecond || per > 31*24*time.Hour {
		return 0, 0, fmt.Errorf("the rate's period must be a duration from 1ms to 744h (s, 1m, 500ms), got %q", s)
	}
	return r, per, nil
}

// rateText shows a rate limit as R/PERIOD.
func rateText(r int, per time.Duration) string {
	p := per.String()
	switch per {
	case time.Second:
		p = "s"
	case time.Minute:
		p = "min"
	case time.Hour:
		p = "h"
	}
	return strconv.Itoa(r) + "/" + p
}

// printable quotes a name that holds control characters, so that a name written by any SQL
// client cannot rewrite the terminal.
func printable(s string) string {
	if strings.IndexFunc(s, func(r rune) bool { return r < 0x20 || r == 0x7f || r == 0xfffd }) >= 0 {
		return strconv.Quote(s)
	}
	return s
}

// cmdRetry makes a failed or cancelled job run once more.
func cmdRetry(ctx context.Context, e env, args []string, stdout io.Writer) error {
	if len(args) != 1 {
		return fmt.Errorf("retry: need one job id: worker retry ID")
	}
	id, err := parseJobID("retry", args[0])
	if err != nil {
		return err
	}
	db, err := connect(ctx, e)
	if err != nil {
		return err
	}
	defer db.Close()
	ok, err := pool.RetryJob(ctx, db, id)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("retry: job %d is unknown, or not failed or cancelled", id)
	}
	fmt.Fprintf(stdout, "job %d will run again\n", id)
	return nil
}
