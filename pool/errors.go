package pool

import "errors"

// matchAlso returns err, made to match public too (errors.Is) when it matches internal: the
// store's sentinels stay internal, and callers match the package's own.
func matchAlso(err, internal, public error) error {
	if err == nil || !errors.Is(err, internal) {
		return err
	}
	return &alsoError{err: err, public: public}
}

// alsoError is err, matching public as well.
type alsoError struct{ err, public error }

func (e *alsoError) Error() string        { return e.err.Error() }
func (e *alsoError) Unwrap() error        { return e.err }
func (e *alsoError) Is(target error) bool { return target == e.public }
