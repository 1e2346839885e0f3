package store

// Statements for planner_test.go and renewplan_test.go, which explain their generic plans.
var (
	FinishSQL    = finishSQL
	RenewSQL     = renewSQL
	StillHeldSQL = stillHeldSQL
)
