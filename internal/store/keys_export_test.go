package store

// Statements for keys_measure_test.go, which explains them on a table of many keys.
var (
	LockQueueRowSQL = lockQueueRowSQL
	KeyWakesSQL     = keyWakesSQL
	ClaimKeyedSQL   = claimKeyedSQL
	KeyWalkedSQL    = keyWalkedSQL
	ClaimOneSQL     = claimOneQueueSQL
)
