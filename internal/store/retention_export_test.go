package store

// DeleteFinishedSQL is DeleteFinished's statement, for retention_test.go, which explains it.
var DeleteFinishedSQL = deleteFinishedSQL
