// Package notify is leash's notification contract: the channel names, the job_revoked payload
// format (what an operator or another worker may send) and the listener's application_name.
// The listener that parses them is internal to package pool.
//
// A job_revoked payload is either a bare positive job id ("42", as typed in psql:
// NOTIFY job_revoked, '42') or a JSON object {"id":42,"token":7,"reason":"...","takeover":false}
// where only id is required. With a token, only the claim holding that lease token is revoked;
// takeover (which needs a token) says that a rescuer took the job back after its lease expired,
// so the holder lost its lease rather than being revoked. Anything else (unknown fields,
// non-integer or non-positive numbers, trailing data, more than MaxPayload bytes) is malformed:
// logged and counted, never fatal. The reason is cleaned, not rejected: NUL bytes and invalid
// UTF-8 become U+FFFD, and it is cut to at most MaxReason bytes.
package notify

// ApplicationName is the application_name of a worker's LISTEN connection, so that operators
// can find it in pg_stat_activity.
const ApplicationName = "leash-listener"

// Channel names (contract).
const (
	ChannelJobAvailable = "job_available"
	ChannelJobRevoked   = "job_revoked"
	// ChannelQueueChanged carries a queue's name whenever its leash.queues row changes (paused,
	// resumed, capped): workers re-read the row.
	ChannelQueueChanged = "queue_changed"
)

// MaxPayload is the longest job_revoked payload accepted. PostgreSQL allows up to 8000 bytes;
// leash's own payloads carry at most 200 characters of reason, which JSON may escape to six bytes
// each, so anything longer is junk.
const MaxPayload = 2048

// MaxReason is the longest revocation reason a worker keeps from a job_revoked payload, in bytes;
// a longer reason is cut on a character boundary and ends with a note of how much was cut.
const MaxReason = 256
