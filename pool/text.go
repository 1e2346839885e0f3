package pool

import (
	"fmt"
)

// Handlers hand the pool values it must turn into text: errors and panic values. Their Error and
// String methods are the handler's code and may panic (a typed nil pointer, a value whose
// printing panics again); none of that may take the worker down.

// safeText calls f, recovering a panic; ok is false when it panicked, with what it panicked with.
func safeText(f func() string) (s string, ok bool) {
	defer func() {
		if r := recover(); r != nil {
			s, ok = describe(r), false
		}
	}()
	return f(), true
}

// describe prints v, or names its type when printing it panics.
func describe(v any) (s string) {
	defer func() {
		if recover() != nil {
			s = fmt.Sprintf("%T value (printing it panicked)", v)
		}
	}()
	return fmt.Sprint(v)
}

// brokenError stands in for a handler's error whose Error method panics; errors.Is and
// errors.As still reach the original through Unwrap.
type brokenError struct {
	text string
	err  error
}

func (e *brokenError) Error() string { return e.text }
func (e *brokenError) Unwrap() error { return e.err }

// stable returns err, or a stand-in with the same chain when its Error method panics.
func stable(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := safeText(err.Error); ok {
		return err
	}
	why, _ := safeText(err.Error)
	return &brokenError{text: fmt.Sprintf("%T error (its Error method panicked: %s)", err, why), err: err}
}
