package pool

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/leashq/leash/lease"
)

// The stored error of an attempt a lease cause ended says the cause once, then whatever the
// handler's error adds. They used to stutter: "revoked: job revoked: revoked by NOTIFY
// job_revoked", "lease renewal timed out: job lease renewal timed out".
func TestEndingSaysItsCauseOnce(t *testing.T) {
	t.Parallel()
	notified := &revocation{reason: defaultRevokeReason}
	timeout := &timeoutError{50 * time.Millisecond}
	for _, tc := range []struct {
		cause, err error
		want       string
	}{
		{notified, notified, "job revoked: by NOTIFY job_revoked"},
		{notified, fmt.Errorf("fetch page: %w", notified), "fetch page: job revoked: by NOTIFY job_revoked"},
		{notified, context.Canceled, "job revoked: by NOTIFY job_revoked"},
		{notified, errors.New("boom"), "job revoked: by NOTIFY job_revoked: boom"},
		{notified, nil, "job revoked: by NOTIFY job_revoked (the handler returned success after the revocation reached it)"},
		{lease.ErrRevoked, lease.ErrRevoked, "job revoked"},
		{lease.ErrRenewalTimeout, lease.ErrRenewalTimeout, "job lease renewal timed out"},
		{lease.ErrRenewalTimeout, fmt.Errorf("query: %w", lease.ErrRenewalTimeout), "query: job lease renewal timed out"},
		{lease.ErrRenewalTimeout, errors.New("boom"), "job lease renewal timed out: boom"},
		{timeout, timeout, "job timed out after 50ms"},
		{timeout, context.DeadlineExceeded, "job timed out after 50ms"},
		{timeout, errors.New("boom"), "job timed out after 50ms: boom"},
		// A fence that found the row revoked says "job revoked" with no reason, while the
		// notification's revocation (with its reason) ended the lease.
		{notified, fmt.Errorf("effect: fence job 1 token 2: %w: %w", ErrFenced, lease.ErrRevoked),
			"effect: fence job 1 token 2: " + ErrFenced.Error() + ": job revoked (by NOTIFY job_revoked)"},
		{timeout, fmt.Errorf("call: %w", ErrTimeout), "call: job timed out (after 50ms)"},
	} {
		out, write := decide(1, 2, "w", ending{err: tc.err, cause: tc.cause, attempt: 1, maxAttempts: 5,
			backoff: func(int) time.Duration { return 0 }})
		if !write || out.Error == nil || out.Error.Error != tc.want {
			t.Errorf("cause %v, handler returned %v: stored %+v, want %q", tc.cause, tc.err, out.Error, tc.want)
		}
	}
}
