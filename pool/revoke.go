package pool

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/leashq/leash/internal/store"
	"github.com/leashq/leash/lease"
	"github.com/leashq/leash/notify"
)

// revokedByNotificationReason is recorded on a job revoked by a bare NOTIFY job_revoked.
const revokedByNotificationReason = "revoked by NOTIFY job_revoked"

// errRevokedByNotification is the cause of a bare NOTIFY revocation; it matches lease.ErrRevoked.
var errRevokedByNotification = fmt.Errorf("%w by NOTIFY job_revoked", lease.ErrRevoked)

// onRevoked handles a job_revoked notification on the listener's goroutine: it must not block,
// so database work goes to its own goroutine.
func (p *Pool) onRevoked(r notify.Revocation) {
	l := p.keeper.Get(r.ID)
	if l == nil || (r.Token != 0 && r.Token != l.Token) || l.Cause() != nil || l.Finishing() {
		return // not ours, an earlier claim, or already ending
	}
	if p.cfg.RevokeRequireRow {
		// Trust only the row: one renewal statement re-checks every lease and ends revoked or
		// lost ones with the right cause.
		p.keeper.Kick(false)
		return
	}
	if r.Takeover {
		if l.End(lease.ErrLost) {
			p.log.Warn("job taken over by another worker; cancelling", slog.Int64("job_id", r.ID), slog.Int64("lease_token", l.Token))
		}
		return
	}
	cause := lease.ErrRevoked
	if r.Token == 0 {
		cause = errRevokedByNotification
	}
	if !l.End(cause) {
		return
	}
	p.metrics.RevokedByNotification.Add(1)
	p.log.Info("job revoked by notification; cancelling", slog.Int64("job_id", r.ID), slog.Int64("lease_token", l.Token),
		slog.String("reason", r.Reason))
	if r.Token == 0 {
		// A bare NOTIFY from a console: make it durable in the row at once, fenced by our token
		// (the cancelled outcome records it too, whichever lands first).
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if _, err := store.MarkRevoked(ctx, p.db, r.ID, l.Token, revokedByNotificationReason); err != nil {
				p.log.Warn("recording revocation failed", slog.Int64("job_id", r.ID), slog.Any("err", err))
			}
		}()
	}
}
