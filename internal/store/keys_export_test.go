package store

// Statements for keys_measure_test.go, which explains them on a table of many keys.
var (
	LockQueueRowSQL   = lockQueueRowSQL
	ClaimKeyedSQL     = claimKeyedSQL
	ClaimKeyedDoneSQL = claimKeyedFinishSQL
	ClaimOneSQL       = claimOneQueueSQL
)

// KeyUseSQL is the statement of ReadKeyUse, for its plan.
const KeyUseSQL = keyUseSQL
