package store

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// MarkRevoked records revocations that arrived as notifications for jobs this worker holds (or
// just held): revoked_at and the reason, on every job of ids that is not final and not revoked
// yet. A queued job (an outcome put it back in the queue meanwhile) is cancelled by the
// database's revocation rule. It never waits on a row lock: it returns the ids whose row was
// locked by another transaction, to try again later; every other id is settled.
func MarkRevoked(ctx context.Context, db DBTX, ids []int64, reasons []string) (locked []int64, err error) {
	clean := make([]string, len(reasons))
	for i, r := range reasons {
		clean[i] = CleanText(r, MaxReasonBytes)
	}
	rows, err := db.Query(ctx, `
		WITH wanted AS (
			SELECT u.id, u.reason FROM unnest($1::bigint[], $2::text[]) AS u(id, reason)
		), target AS (
			SELECT j.id, w.reason FROM leash.jobs j JOIN wanted w ON j.id = w.id
			WHERE j.revoked_at IS NULL AND j.state IN ('running', 'available', 'retryable')
			ORDER BY j.id
			FOR NO KEY UPDATE OF j SKIP LOCKED
		), done AS (
			UPDATE leash.jobs j SET revoked_at = now(), revoke_reason = t.reason
			FROM target t WHERE j.id = t.id
			RETURNING j.id
		)
		SELECT j.id FROM leash.jobs j JOIN wanted w ON j.id = w.id
		WHERE j.revoked_at IS NULL AND j.state IN ('running', 'available', 'retryable')
		  AND j.id NOT IN (SELECT id FROM done)`, ids, clean)
	if err != nil {
		return nil, fmt.Errorf("record revocations: %w", err)
	}
	locked, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("record revocations: %w", err)
	}
	return locked, nil
}

// Revoke calls leash.revoke_job.
func Revoke(ctx context.Context, db DBTX, id int64, reason string) (bool, error) {
	var ok bool
	if err := db.QueryRow(ctx, `SELECT leash.revoke_job($1, nullif($2, ''))`, id, CleanText(reason, MaxReasonBytes)).Scan(&ok); err != nil {
		return false, fmt.Errorf("revoke job %d: %w", id, err)
	}
	return ok, nil
}
