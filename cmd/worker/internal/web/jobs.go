package web

import (
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/leashq/leash/pool"
)

// states lists the job states in the order the state filter offers them.
var states = pool.States()

// maxNameBytes bounds a queue or kind filter: longer names cannot exist (the table's checks).
const maxNameBytes = 128

// listPageSize is the number of jobs per page of the job list.
const listPageSize = 50

// errBadQuery is a request that no page can answer; its text is shown as is (it never quotes
// the request).
type errBadQuery string

func (e errBadQuery) Error() string { return string(e) }

// queryNames are the query parameters the pages read.
var queryNames = []string{"queue", "kind", "state", "before", "id"}

// query parses a request's query string strictly: a malformed escape or a parameter named twice
// is an error, so that what the page shows is always what was asked.
func query(r *http.Request) (url.Values, error) {
	q, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		return nil, errBadQuery("malformed query string")
	}
	for name, vs := range q {
		if len(vs) > 1 {
			if !slices.Contains(queryNames, name) {
				name = "a parameter" // never quote the request
			}
			return nil, errBadQuery(name + " is given more than once")
		}
	}
	return q, nil
}

// name reads a queue or kind filter: trimmed, at most maxNameBytes of valid UTF-8 without
// control characters (NUL included), which no job can have; empty matches every job.
func name(q url.Values, field string) (string, error) {
	v := strings.TrimSpace(q.Get(field))
	if len(v) > maxNameBytes || !utf8.ValidString(v) || strings.ContainsFunc(v, unicode.IsControl) {
		return "", errBadQuery(fmt.Sprintf("%s: at most %d bytes of text (valid UTF-8, no control characters)", field, maxNameBytes))
	}
	return v, nil
}

// jobID reads a job id: a positive whole number, optionally written #42.
func jobID(v string) (int64, error) {
	v = strings.TrimPrefix(strings.TrimSpace(v), "#")
	id, err := strconv.ParseInt(v, 10, 64)
	if err != nil || id <= 0 {
		return 0, errBadQuery("job id: a positive whole number, such as 42")
	}
	return id, nil
}

// Filters are the job list's filters, as given in its query string.
type Filters struct {
	Queue, Kind, State string
	BeforeID           int64
}

// parseFilters reads the job list's filters from q.
func parseFilters(q url.Values) (Filters, error) {
	var f Filters
	var err error
	if f.Queue, err = name(q, "queue"); err != nil {
		return f, err
	}
	if f.Kind, err = name(q, "kind"); err != nil {
		return f, err
	}
	f.State = strings.TrimSpace(q.Get("state"))
	if f.State != "" && !slices.Contains(states, f.State) {
		return f, errBadQuery("state: one of " + strings.Join(states, ", "))
	}
	if v := q.Get("before"); v != "" {
		if f.BeforeID, err = jobID(v); err != nil {
			return f, errBadQuery("before: a positive whole number")
		}
	}
	return f, nil
}

// Values writes f back as a query string, without the page position; with before, for the next
// page.
func (f Filters) Values(before int64) string {
	q := url.Values{}
	for k, v := range map[string]string{"queue": f.Queue, "kind": f.Kind, "state": f.State} {
		if v != "" {
			q.Set(k, v)
		}
	}
	if before > 0 {
		q.Set("before", strconv.FormatInt(before, 10))
	}
	return q.Encode()
}

// Active reports whether any filter is set.
func (f Filters) Active() bool { return f.Queue != "" || f.Kind != "" || f.State != "" }

type jobsData struct {
	Filters Filters
	States  []string
	Queues  []string // none: reading them would cost a scan of the table
	Jobs    []pool.JobSummary
	// Next links to the next page; "" on the last.
	Next     template.URL
	TooSlow  bool
	PageSize int
}

// jobs lists jobs, filtered by queue, kind and state.
func (s *server) jobs(w http.ResponseWriter, r *http.Request) {
	q, err := query(r)
	if err != nil {
		badRequest(w, err)
		return
	}
	f, err := parseFilters(q)
	if err != nil {
		badRequest(w, err)
		return
	}
	data := jobsData{Filters: f, States: states, PageSize: listPageSize}
	data.Jobs, err = pool.ListJobs(r.Context(), s.DB, pool.ListJobsParams{Queue: f.Queue, Kind: f.Kind, State: f.State,
		BeforeID: f.BeforeID, Limit: listPageSize + 1})
	switch {
	case errors.Is(err, pool.ErrListTimeout):
		data.TooSlow = true
	case err != nil:
		s.fail(w, err)
		return
	}
	if len(data.Jobs) > listPageSize {
		data.Jobs = data.Jobs[:listPageSize]
		// Built from url.Values.Encode: every value is escaped.
		data.Next = template.URL("/jobs?" + f.Values(data.Jobs[listPageSize-1].ID))
	}
	s.render(w, "jobs.html", data)
}

// search goes to the page of the job whose id was typed in.
func (s *server) search(w http.ResponseWriter, r *http.Request) {
	q, err := query(r)
	if err != nil {
		badRequest(w, err)
		return
	}
	id, err := jobID(q.Get("id"))
	if err != nil {
		badRequest(w, err)
		return
	}
	http.Redirect(w, r, fmt.Sprintf("/jobs/%d", id), http.StatusSeeOther)
}

// badRequest answers 400 with err's text, which never quotes the request.
func badRequest(w http.ResponseWriter, err error) {
	var bq errBadQuery
	msg := "bad request"
	if errors.As(err, &bq) {
		msg = "bad request: " + string(bq)
	}
	http.Error(w, msg, http.StatusBadRequest)
}
