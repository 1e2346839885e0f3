package store

// Statements for planner_test.go and renewplan_test.go, which explain their generic plans.
var (
	FinishSQL    = finishSQL
	CompleteSQL  = completeSQL
	CleanOutput  = cleanOutput
	RenewSQL     = renewSQL
	StillHeldSQL = stillHeldSQL
)

// FinishStatement is the statement Finish sends for outs.
func FinishStatement(outs []Outcome) string {
	q, _, _ := finishQuery(outs)
	return q
}
