// Package notify is leash's notification contract: the channel names, the parsing of
// job_revoked payloads (what an operator or another worker may send), the listener's
// application_name and its counters. The listener itself is internal to package pool.
package notify

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"unicode/utf8"
)

// ApplicationName is the application_name of a worker's LISTEN connection, so that operators
// can find it in pg_stat_activity.
const ApplicationName = "leash-listener"

// Metrics counts what a worker's listener saw. All fields are safe for concurrent use.
type Metrics struct {
	Received   atomic.Int64 // notifications received on any channel
	Malformed  atomic.Int64 // job_revoked payloads that did not parse
	Reconnects atomic.Int64 // connections made after the first
	PingsLost  atomic.Int64 // liveness pings that did not come back in time
	Terminated atomic.Int64 // server backends of abandoned connections that were terminated
}

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

// MaxReason is the longest Revocation.Reason returned, in bytes; a longer reason is cut on a
// character boundary and ends with "…".
const MaxReason = 256

// Revocation is a parsed job_revoked payload.
type Revocation struct {
	// ID is the job.
	ID int64
	// Token, when not zero, limits the revocation to the claim holding that lease token.
	Token int64
	// Reason is free text for logs and the job's record: valid UTF-8 without NUL bytes (which
	// PostgreSQL text rejects), at most MaxReason bytes.
	Reason string
	// Takeover means a rescuer took the job back after its lease expired: the holder lost the
	// lease rather than being revoked.
	Takeover bool
}

// ErrMalformed wraps every payload parsing error.
var ErrMalformed = errors.New("malformed job_revoked payload")

type wire struct {
	ID       json.RawMessage `json:"id"`
	Token    json.RawMessage `json:"token"`
	Reason   *string         `json:"reason"`
	Takeover *bool           `json:"takeover"`
}

// ParseRevocation parses a job_revoked payload: a bare positive id ("42", as typed in psql), or
// a JSON object {"id":42,"token":7,"reason":"...","takeover":false} where only id is required.
// Anything else (unknown fields, non-integer or non-positive numbers, trailing data, more than
// MaxPayload bytes) is an error wrapping ErrMalformed. The reason is sanitised, not rejected:
// NUL bytes ("\u0000" in JSON) are dropped, invalid UTF-8 (raw bytes or a lone surrogate
// escape) becomes U+FFFD, and it is cut to MaxReason bytes on a character boundary.
func ParseRevocation(payload string) (Revocation, error) {
	if len(payload) > MaxPayload {
		return Revocation{}, fmt.Errorf("%w: %d bytes (max %d)", ErrMalformed, len(payload), MaxPayload)
	}
	s := strings.TrimSpace(payload)
	if s == "" {
		return Revocation{}, fmt.Errorf("%w: empty", ErrMalformed)
	}
	if s[0] != '{' {
		id, err := positive(s)
		if err != nil {
			return Revocation{}, fmt.Errorf("%w: %q: %v", ErrMalformed, clip(s), err)
		}
		return Revocation{ID: id}, nil
	}
	dec := json.NewDecoder(strings.NewReader(s))
	dec.DisallowUnknownFields()
	var w wire
	if err := dec.Decode(&w); err != nil {
		return Revocation{}, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	if dec.More() || !trailingSpaceOnly(dec) {
		return Revocation{}, fmt.Errorf("%w: trailing data after JSON object", ErrMalformed)
	}
	if w.ID == nil {
		return Revocation{}, fmt.Errorf("%w: missing \"id\"", ErrMalformed)
	}
	var r Revocation
	var err error
	if r.ID, err = positive(string(w.ID)); err != nil {
		return Revocation{}, fmt.Errorf("%w: id: %v", ErrMalformed, err)
	}
	if w.Token != nil && string(w.Token) != "null" {
		if r.Token, err = positive(string(w.Token)); err != nil {
			return Revocation{}, fmt.Errorf("%w: token: %v", ErrMalformed, err)
		}
	}
	if w.Reason != nil {
		r.Reason = cleanReason(*w.Reason)
	}
	if w.Takeover != nil {
		r.Takeover = *w.Takeover
	}
	if r.Takeover && r.Token == 0 {
		return Revocation{}, fmt.Errorf("%w: takeover without token", ErrMalformed)
	}
	return r, nil
}

// cleanReason drops NUL bytes from s, replaces invalid UTF-8 with U+FFFD (encoding/json has
// done so already; this keeps the guarantee local) and cuts s to MaxReason bytes on a character
// boundary.
func cleanReason(s string) string {
	s = strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", ""), "\uFFFD")
	if len(s) <= MaxReason {
		return s
	}
	const more = "…"
	cut := MaxReason - len(more)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + more
}

func trailingSpaceOnly(dec *json.Decoder) bool {
	var rest bytes.Buffer
	rest.ReadFrom(dec.Buffered())
	return len(bytes.TrimSpace(rest.Bytes())) == 0
}

func positive(s string) (int64, error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, errors.New("not an integer in range")
	}
	if n <= 0 {
		return 0, errors.New("must be positive")
	}
	return n, nil
}

func clip(s string) string {
	if len(s) > 40 {
		return s[:40] + "..."
	}
	return s
}
