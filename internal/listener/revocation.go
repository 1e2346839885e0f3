package listener

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/leashq/leash/internal/clean"
	"github.com/leashq/leash/notify"
)

// Revocation is a parsed job_revoked payload (the format is package notify's contract).
type Revocation struct {
	// ID is the job.
	ID int64
	// Token, when not zero, limits the revocation to the claim holding that lease token.
	Token int64
	// Reason is free text for logs and the job's record: valid UTF-8 without NUL bytes (which
	// PostgreSQL text rejects), at most notify.MaxReason bytes.
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
// notify.MaxPayload bytes) is an error wrapping ErrMalformed. The reason is cleaned by clean.Text,
// not rejected: NUL bytes ("\u0000" in JSON) and invalid UTF-8 (raw bytes or a lone surrogate
// escape) become U+FFFD, and it is cut to at most notify.MaxReason bytes.
func ParseRevocation(payload string) (Revocation, error) {
	if len(payload) > notify.MaxPayload {
		return Revocation{}, fmt.Errorf("%w: %d bytes (max %d)", ErrMalformed, len(payload), notify.MaxPayload)
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
		r.Reason = clean.Text(*w.Reason, notify.MaxReason)
	}
	if w.Takeover != nil {
		r.Takeover = *w.Takeover
	}
	if r.Takeover && r.Token == 0 {
		return Revocation{}, fmt.Errorf("%w: takeover without token", ErrMalformed)
	}
	return r, nil
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
