package pool_test

// runHelperWorker is replaced when the test binary runs as a child worker process.
func runHelperWorker() bool { return false }
