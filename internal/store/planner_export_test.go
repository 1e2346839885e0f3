package store

// Statements for planner_test.go, which explains their generic plans.
var (
	FinishSQL = finishSQL
	RenewSQL  = renewSQL
)
