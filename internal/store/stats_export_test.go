package store

// Statements for stats_measure_test.go, which measures them on a large table.
var (
	SampleMinutesSQL  = sampleMinutesSQL
	RecentFailuresSQL = recentFailuresSQL
	StatusQueries     = map[string]string{"counts of every row (worker status)": statusCountsSQL, "counts of queued and running": liveCountsSQL,
		"oldest waiting": oldestWaitingSQL, "running": runningSQL}
)
