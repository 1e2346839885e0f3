package store

import (
	"context"
	"fmt"
)

// MarkRevoked records a revocation that arrived as a notification on a job this worker holds,
// guarded by its token. It reports whether the row changed (false when already revoked or the
// lease is gone).
func MarkRevoked(ctx context.Context, db DBTX, id, token int64, reason string) (bool, error) {
	tag, err := db.Exec(ctx, `
		UPDATE leash.jobs SET revoked_at = now(), revoke_reason = $3
		WHERE id = $1 AND lease_token = $2 AND state = 'running' AND revoked_at IS NULL`,
		id, token, CleanText(reason, MaxReasonBytes))
	if err != nil {
		return false, fmt.Errorf("record revocation of job %d: %w", id, err)
	}
	return tag.RowsAffected() > 0, nil
}

// Revoke calls leash.revoke_job.
func Revoke(ctx context.Context, db DBTX, id int64, reason string) (bool, error) {
	var ok bool
	if err := db.QueryRow(ctx, `SELECT leash.revoke_job($1, nullif($2, ''))`, id, CleanText(reason, MaxReasonBytes)).Scan(&ok); err != nil {
		return false, fmt.Errorf("revoke job %d: %w", id, err)
	}
	return ok, nil
}
