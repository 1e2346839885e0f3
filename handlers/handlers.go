// Package handlers holds the built-in handlers of the standalone worker binary. It imports
// package pool, never the reverse; embedding applications may register these too.
package handlers

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/leashq/leash/pool"
)

// Noop completes at once. Kind "noop".
func Noop() pool.Handler {
	return pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil })
}

// SleepArgs is the payload of a "sleep" job.
type SleepArgs struct {
	// Duration to sleep, as Go parses durations ("1.5s", "250ms"). Required.
	Duration Duration `json:"duration"`
	// Fail, when set, makes the job fail with this message after sleeping.
	Fail string `json:"fail,omitempty"`
	// Progress, when true, records the elapsed fraction as progress about every tenth.
	Progress bool `json:"progress,omitempty"`
}

// Duration is a time.Duration that reads JSON strings like "1.5s".
type Duration time.Duration

// UnmarshalJSON accepts a Go duration string.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("duration must be a string like \"1.5s\": %w", err)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	if v < 0 {
		return errors.New("duration must not be negative")
	}
	*d = Duration(v)
	return nil
}

// MarshalJSON writes a Go duration string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

// Sleep sleeps for the payload's duration, returning the context's cause as soon as it is
// cancelled, then fails with "fail" if set. Kind "sleep".
func Sleep() pool.Handler {
	return pool.Args(func(ctx context.Context, job *pool.Job, a SleepArgs) error {
		total := time.Duration(a.Duration)
		if !a.Progress || total <= 0 {
			if err := pool.Sleep(ctx, total); err != nil {
				return err
			}
		} else {
			step := total / 10
			for done := time.Duration(0); done < total; done += step {
				if err := pool.Sleep(ctx, min(step, total-done)); err != nil {
					return err
				}
				if err := job.SetProgress(ctx, map[string]any{"done": float64(min(done+step, total)) / float64(total)}); err != nil {
					return err
				}
			}
		}
		if a.Fail != "" {
			return errors.New(a.Fail)
		}
		return nil
	})
}

// Options configure the built-in handlers.
type Options struct {
	// ExecAllow lists the commands the exec handler may run; empty disables it.
	ExecAllow []string
	// ExecGrace is the wait between SIGTERM and SIGKILL for a cancelled command.
	ExecGrace time.Duration
	// ExecEnvAllow lists the variable names an exec job's env may set besides LANG, TZ and LC_*:
	// exact names, or prefixes ending in "*" ("APP_*"; "*" alone allows every name). Names that
	// [EnvDenied] refuses stay refused. [CheckExecEnvAllow] finds patterns that match nothing.
	ExecEnvAllow []string
	// HTTPClient is used by the http handler as is; nil means HTTPPolicy.Client().
	HTTPClient *http.Client
	// HTTPPolicy says which addresses the http handler may connect to, when HTTPClient is nil.
	HTTPPolicy HTTPPolicy
}

// Register adds the built-in handlers (noop, sleep, http, exec) to p.
func Register(p *pool.Pool, o Options) error {
	client := o.HTTPClient
	if client == nil {
		client = o.HTTPPolicy.Client()
	}
	for kind, h := range map[string]pool.Handler{
		"noop": Noop(), "sleep": Sleep(), "http": HTTP(client), "exec": Exec(o.ExecAllow, o.ExecGrace, o.ExecEnvAllow...),
	} {
		if err := p.Register(kind, h); err != nil {
			return err
		}
	}
	return nil
}
