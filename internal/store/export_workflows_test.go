package store

// CopyWorkflowJobsMin is the size from which InsertWorkflowJobs copies, for workflows_test.go.
const CopyWorkflowJobsMin = copyWorkflowJobsMin
