package web

import (
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/leashq/leash/cmd/worker/internal/chart"
	"github.com/leashq/leash/pool"
)

// chartMinutes is the span of the admin page's charts.
const chartMinutes = 60

// chartView is a chart with the sentence printed under it.
type chartView struct {
	chart.Chart
	// Note says what the chart measures and how.
	Note string
}

// finishedCounts are the jobs finished in a span, by final state.
type finishedCounts struct{ Completed, Failed, Cancelled int64 }

// charts builds the admin page's charts from the last hour of sampled minutes, and totals the
// jobs finished in it. It reports false when no minute of the hour was sampled.
func charts(stats []pool.MinuteStats) ([]chartView, finishedCounts, bool) {
	n := len(stats)
	labels := make([]string, n)
	completed, failed, cancelled := series(n), series(n), series(n)
	queued, runnable := series(n), series(n)
	p50, p99 := series(n), series(n)
	var sampled int
	var sumCompleted, sumFailed, sumCancelled, started int64
	for i, s := range stats {
		labels[i] = s.Minute.Local().Format("15:04")
		if !s.Sampled {
			continue
		}
		sampled++
		completed[i], failed[i], cancelled[i] = float64(s.Completed), float64(s.Failed), float64(s.Cancelled)
		sumCompleted, sumFailed, sumCancelled = sumCompleted+s.Completed, sumFailed+s.Failed, sumCancelled+s.Cancelled
		started += s.Started
		if s.Queued != nil && s.Runnable != nil {
			queued[i], runnable[i] = float64(*s.Queued), float64(*s.Runnable)
		}
		if s.PickupP50 != nil && s.PickupP99 != nil {
			p50[i], p99[i] = durationMS(*s.PickupP50), durationMS(*s.PickupP99)
		}
	}
	span := "the last hour"
	if n > 0 {
		span = fmt.Sprintf("the minutes from %s to %s", labels[0], labels[n-1])
	}
	count := func(v float64) string { return strconv.FormatInt(int64(math.Round(v)), 10) }
	out := []chartView{
		{Chart: chart.Chart{ID: "chart-finished", Kind: chart.Bars, Labels: labels, Format: count, Integer: true,
			Title: "Jobs finished per minute",
			Desc: fmt.Sprintf("Jobs that reached a final state in each of %s, stacked by state: %d completed, %d failed, %d cancelled in all (%d of %d minutes sampled).",
				span, sumCompleted, sumFailed, sumCancelled, sampled, n),
			Series: []chart.Series{{Name: "completed", Class: "completed", Values: completed},
				{Name: "failed", Class: "failed", Values: failed}, {Name: "cancelled", Class: "cancelled", Values: cancelled}}},
			Note: "Jobs whose finished_at falls in the minute, by final state, counted shortly after the minute ends."},
		{Chart: chart.Chart{ID: "chart-depth", Kind: chart.Lines, Labels: labels, Format: count, Integer: true,
			Title: "Queue depth",
			Desc:  fmt.Sprintf("Jobs waiting (available or retryable), and of those the ones already due, at the end of each of %s; latest: %s.", span, latest(queued, runnable, count)),
			Series: []chart.Series{{Name: "queued", Class: "queued", Values: queued},
				{Name: "due", Class: "due", Values: runnable}}},
			Note: "Counted by a worker 5 to 15 s after each minute ends (queued: available or retryable; due: of those, run_at passed). " +
				"Minutes no worker sampled in time are gaps: a past depth cannot be read from the rows."},
		{Chart: chart.Chart{ID: "chart-pickup", Kind: chart.Lines, Labels: labels, Format: fmtMS,
			Title: "Pickup latency",
			Desc:  fmt.Sprintf("Median and 99th percentile of the time from a job becoming due to its attempt starting, for the %d attempts started in %s; latest: %s.", started, span, latest(p50, p99, fmtMS)),
			Series: []chart.Series{{Name: "p50", Class: "p50", Values: p50},
				{Name: "p99", Class: "p99", Values: p99}}},
			Note: "attempted_at − greatest(run_at, created_at) of the attempts started in the minute, as the database clock stamped them. " +
				"It counts the latest attempt of jobs running or finished when the minute is sampled; attempts that ended in a retry or a hand-back are left out (their row's run_at has moved on)."},
	}
	return out, finishedCounts{sumCompleted, sumFailed, sumCancelled}, sampled > 0
}

func series(n int) []float64 {
	s := make([]float64, n)
	for i := range s {
		s[i] = math.NaN()
	}
	return s
}

// latest describes the last bucket with a value in a and b.
func latest(a, b []float64, format func(float64) string) string {
	for i := len(a) - 1; i >= 0; i-- {
		if !math.IsNaN(a[i]) && !math.IsNaN(b[i]) {
			return format(a[i]) + " and " + format(b[i])
		}
	}
	return "none"
}

func durationMS(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// fmtMS writes milliseconds for people: "850 ms", "1.2 s", "3m05s".
func fmtMS(ms float64) string {
	switch {
	case math.IsNaN(ms) || math.IsInf(ms, 0):
		return "–"
	case ms < 10:
		return strconv.FormatFloat(math.Round(ms*10)/10, 'f', -1, 64) + " ms"
	case ms < 1000:
		return strconv.FormatFloat(math.Round(ms), 'f', -1, 64) + " ms"
	case ms < 60_000:
		return strconv.FormatFloat(math.Round(ms/100)/10, 'f', -1, 64) + " s"
	case ms >= 1e12: // past what a Duration holds
		return chart.Number(ms/1000) + " s"
	}
	return fmtAge(time.Duration(ms) * time.Millisecond)
}
