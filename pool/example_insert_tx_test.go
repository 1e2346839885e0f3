package pool_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leashq/leash/pool"
)

// ReceiptArgs are the arguments of a job that sends an order's receipt.
type ReceiptArgs struct {
	OrderID int64 `json:"order_id"`
}

// Kind names the job kind of ReceiptArgs.
func (ReceiptArgs) Kind() string { return "receipt" }

// snippet:start insert-tx

// placeOrder records an order, enqueues its receipt and takes the item from stock in one
// transaction: the receipt job exists, and wakes workers, only if the order commits.
func placeOrder(ctx context.Context, db *pgxpool.Pool, item string) error {
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var orderID int64
		if err := tx.QueryRow(ctx, `INSERT INTO orders (item) VALUES ($1) RETURNING id`, item).Scan(&orderID); err != nil {
			return fmt.Errorf("record order: %w", err)
		}
		// A pgx.Tx is a pool.DB: the job is inserted by tx (pool.InsertTx for string kinds).
		if _, err := pool.InsertArgs(ctx, tx, ReceiptArgs{OrderID: orderID}, nil); err != nil {
			return fmt.Errorf("enqueue receipt: %w", err)
		}
		// Fails (CHECK quantity >= 0) when the item is out of stock: everything rolls back.
		if _, err := tx.Exec(ctx, `UPDATE stock SET quantity = quantity - 1 WHERE item = $1`, item); err != nil {
			return fmt.Errorf("take from stock: %w", err)
		}
		return nil
	})
}

// snippet:end insert-tx

// Example_insertTx enqueues a job in the caller's transaction: the job exists only if the
// business rows commit with it, and a rollback leaves no job.
func Example_insertTx() {
	db, done := exampleDB()
	defer done()
	ctx := context.Background()
	if _, err := db.Exec(ctx, `
		CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, item text NOT NULL);
		CREATE TABLE stock (item text PRIMARY KEY, quantity int NOT NULL CHECK (quantity >= 0));
		INSERT INTO stock VALUES ('book', 1)`); err != nil {
		panic(err)
	}

	if err := placeOrder(ctx, db, "book"); err != nil {
		panic(err)
	}
	err := placeOrder(ctx, db, "book") // the last book is gone: the transaction rolls back
	fmt.Println("second order failed:", err != nil)

	var orders int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&orders); err != nil {
		panic(err)
	}
	jobs, err := pool.ListJobs(ctx, db, pool.ListJobsParams{Kind: ReceiptArgs{}.Kind()})
	if err != nil {
		panic(err)
	}
	fmt.Println("orders:", orders, "receipt jobs:", len(jobs))
	// Output:
	// second order failed: true
	// orders: 1 receipt jobs: 1
}
