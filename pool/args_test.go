package pool_test

import (
	"context"
	"testing"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/pool"
)

// A handler registered for an args type and an insert of it name the same kind; bulk inserts of
// args take their kind too, and one kind cannot be registered twice.
func TestTypedKinds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.Pool(t)
	p, err := pool.New(db, pool.Config{})
	if err != nil {
		t.Fatal(err)
	}
	handle := func(context.Context, *pool.Job, WelcomeArgs) error { return nil }
	if err := pool.AddWorker(p, handle); err != nil {
		t.Fatal(err)
	}
	if err := pool.AddWorker(p, handle); err == nil {
		t.Fatal("a kind registered twice")
	}
	if err := p.Register("welcome", pool.HandlerFunc(func(context.Context, *pool.Job) error { return nil })); err == nil {
		t.Fatal("a string kind registered over a typed one")
	}
	id, err := pool.InsertArgs(ctx, db, WelcomeArgs{User: "ada"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := pool.InsertMany(ctx, db, []pool.InsertManyParams{{Payload: WelcomeArgs{User: "bob"}}}); err != nil || n != 1 {
		t.Fatalf("InsertMany: %d, %v", n, err)
	}
	var kinds []string
	rows, _ := db.Query(ctx, `SELECT kind FROM leash.jobs WHERE id >= $1 ORDER BY id`, id)
	for rows.Next() {
		var k string
		rows.Scan(&k)
		kinds = append(kinds, k)
	}
	if len(kinds) != 2 || kinds[0] != "welcome" || kinds[1] != "welcome" {
		t.Fatalf("kinds %v", kinds)
	}
	if _, err := pool.InsertArgs(ctx, db, nil, nil); err == nil {
		t.Fatal("nil args inserted")
	}
}
