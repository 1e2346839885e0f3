package pool_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// BenchmarkRevocationLatency measures the time from NOTIFY job_revoked (sent from another
// connection) to the handler seeing its context cancelled, with renewals far too rare to explain
// it. Reports p50 and p99 in milliseconds.
func BenchmarkRevocationLatency(b *testing.B) {
	db := pgtest.Pool(b)
	h := newBlocker()
	evs := make(events, 16)
	cfg := slowHeartbeat()
	cfg.Observer = evs
	p, err := pool.New(db, cfg)
	if err != nil {
		b.Fatal(err)
	}
	p.Register("block", h)
	go p.Run(context.Background())
	defer p.Shutdown(context.Background())
	for !p.ListenerConnected() {
		time.Sleep(5 * time.Millisecond)
	}
	ctx := context.Background()
	var lat []time.Duration
	for b.Loop() {
		id, err := pool.Insert(ctx, db, "block", nil, nil)
		if err != nil {
			b.Fatal(err)
		}
		<-h.started
		sent := time.Now()
		if _, err := db.Exec(ctx, fmt.Sprintf("NOTIFY job_revoked, '%d'", id)); err != nil {
			b.Fatal(err)
		}
		c := <-h.causes
		lat = append(lat, c.at.Sub(sent))
		<-evs
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
}

// BenchmarkBurnDown measures throughput of no-op jobs inserted with one COPY and drained by one
// pool at its defaults (100 slots): jobs/s.
func BenchmarkBurnDown(b *testing.B) {
	const n = 20000
	for b.Loop() {
		b.StopTimer()
		db := pgtest.Pool(b)
		evs := make(events, n)
		p, err := pool.New(db, pool.Config{Observer: evs})
		if err != nil {
			b.Fatal(err)
		}
		p.Register("noop", pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil }))
		params := make([]pool.InsertManyParams, n)
		for i := range params {
			params[i].Kind = "noop"
		}
		if _, err := pool.InsertMany(context.Background(), db, params); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		began := time.Now()
		go p.Run(context.Background())
		for range n {
			<-evs
		}
		b.ReportMetric(n/time.Since(began).Seconds(), "jobs/s")
		b.StopTimer()
		p.Shutdown(context.Background())
		db.Close()
		b.StartTimer()
	}
}
