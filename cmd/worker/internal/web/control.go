package web

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/leashq/leash/pool"
)

// Flash codes of the queue and retry actions (see flashText).
const (
	flashQueuePaused    = "queue-paused"
	flashQueueResumed   = "queue-resumed"
	flashQueueUnchanged = "queue-unchanged"
	flashRetried        = "retried"
	flashNotRetryable   = "not-retryable"
	flashRetryConflict  = "retry-conflict"
)

func controlFlashText(code string, id int64) string {
	switch code {
	case flashQueuePaused:
		return "Queue paused: no worker starts its jobs until it is resumed."
	case flashQueueResumed:
		return "Queue resumed."
	case flashQueueUnchanged:
		return "The queue was already in that state."
	}
	if id <= 0 {
		return ""
	}
	switch code {
	case flashRetried:
		return fmt.Sprintf("Job %d will run again.", id)
	case flashNotRetryable:
		return fmt.Sprintf("Job %d is not failed or cancelled: nothing to retry.", id)
	case flashRetryConflict:
		return fmt.Sprintf("Job %d was not retried: another unfinished job holds its unique key.", id)
	}
	return ""
}

// queueName reads the queue a form names, or "" when it is not a name a queue can have.
func queueName(r *http.Request) string {
	q := r.PostFormValue("queue")
	if !validQueueName(q) {
		return ""
	}
	return q
}

// validQueueName reports whether q is a name a queue can have (and the page can show).
func validQueueName(q string) bool {
	return q != "" && utf8.RuneCountInString(q) <= 128 && utf8.ValidString(q) && strings.IndexFunc(q, unicode.IsControl) < 0
}

// queueAction pauses or resumes the queue a form names.
func (s *server) queueAction(pause bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
		if err := r.ParseForm(); err != nil {
			http.Error(w, "bad form", http.StatusBadRequest)
			return
		}
		name := queueName(r)
		if name == "" {
			http.Error(w, "bad queue name", http.StatusBadRequest)
			return
		}
		do, code := pool.ResumeQueue, flashQueueResumed
		if pause {
			do, code = pool.PauseQueue, flashQueuePaused
		}
		changed, err := do(r.Context(), s.DB, name)
		if err != nil {
			s.fail(w, err)
			return
		}
		if !changed {
			code = flashQueueUnchanged
		}
		http.Redirect(w, r, "/?flash="+code+"#queues", http.StatusSeeOther)
	}
}

// retry makes a failed or cancelled job run once more.
func (s *server) retry(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		http.Error(w, "bad job id", http.StatusBadRequest)
		return
	}
	code := flashRetried
	ok, err := pool.RetryJob(r.Context(), s.DB, id)
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &pe) && pe.Code == "23505":
		code = flashRetryConflict
	case err != nil:
		s.fail(w, err)
		return
	case !ok:
		code = flashNotRetryable
	}
	http.Redirect(w, r, fmt.Sprintf("/jobs/%d?flash=%s", id, code), http.StatusSeeOther)
}
