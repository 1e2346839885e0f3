package pool

// LeaseCause is the cause j's lease ended with, or nil, read without ending it (EnsureActive
// ends a lease past its trust deadline).
func LeaseCause(j *Job) error { return j.lease.Cause() }
