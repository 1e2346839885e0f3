package pool

import (
	"errors"
	"fmt"
	"testing"

	"github.com/leashq/leash/internal/store"
)

// The package's constants are defined by value, so that its documentation names no internal
// package; they must stay equal to the store's.
func TestConstantsMatchStore(t *testing.T) {
	t.Parallel()
	for name, c := range map[string][2]any{
		"StatePending":          {StatePending, store.StatePending},
		"StateAvailable":        {StateAvailable, store.StateAvailable},
		"StateRunning":          {StateRunning, store.StateRunning},
		"StateRetryable":        {StateRetryable, store.StateRetryable},
		"StateCompleted":        {StateCompleted, store.StateCompleted},
		"StateFailed":           {StateFailed, store.StateFailed},
		"StateCancelled":        {StateCancelled, store.StateCancelled},
		"SampleLagDefault":      {SampleLagDefault, store.SampleLagDefault},
		"SampleBackfillDefault": {SampleBackfillDefault, store.SampleBackfillDefault},
		"SampleRetainDefault":   {SampleRetainDefault, store.SampleRetainDefault},
		"MaxTraceContextBytes":  {MaxTraceContextBytes, store.MaxTraceContextBytes},
	} {
		if c[0] != c[1] {
			t.Errorf("%s is %v, the store's %v", name, c[0], c[1])
		}
	}
}

// The store's sentinels reach callers as the package's own, text and chain kept.
func TestStoreErrorsMatchPublicSentinels(t *testing.T) {
	t.Parallel()
	err := fmt.Errorf("list jobs: %w", store.ErrListTimeout)
	got := matchAlso(err, store.ErrListTimeout, ErrListTimeout)
	if !errors.Is(got, ErrListTimeout) || !errors.Is(got, store.ErrListTimeout) || got.Error() != err.Error() {
		t.Fatalf("got %v", got)
	}
	if other := errors.New("x"); matchAlso(other, store.ErrListTimeout, ErrListTimeout) != other {
		t.Fatal("an unrelated error was changed")
	}
	if matchAlso(nil, store.ErrListTimeout, ErrListTimeout) != nil {
		t.Fatal("nil became an error")
	}
}
