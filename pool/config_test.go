package pool_test

import (
	"errors"
	"testing"
	"time"

	"github.com/leashq/leash/pool"
)

// Every rule names the Config field it checks, the lease timing's included; Validate leaves its
// receiver alone and WithDefaults fills it as New does.
func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for field, cfg := range map[string]pool.Config{
		"LeaseDuration":           {LeaseDuration: 50 * time.Millisecond},
		"HeartbeatInterval":       {LeaseDuration: time.Second, HeartbeatInterval: 600 * time.Millisecond},
		"RenewRetryInterval":      {LeaseDuration: time.Second, HeartbeatInterval: 400 * time.Millisecond, RenewRetryInterval: time.Second},
		"LeaseSafetyMargin":       {LeaseDuration: time.Second, HeartbeatInterval: 400 * time.Millisecond, LeaseSafetyMargin: 700 * time.Millisecond},
		"Engine.WaitAfter":        {Engine: pool.EngineConfig{WaitAfter: time.Hour}},
		"Engine.IdlePollInterval": {Engine: pool.EngineConfig{IdlePollInterval: time.Hour}},
	} {
		var ce *pool.ConfigError
		if err := cfg.Validate(); !errors.As(err, &ce) || ce.Field != field {
			t.Errorf("%s: got %v", field, err)
		}
	}
	var zero pool.Config
	if err := zero.Validate(); err != nil {
		t.Fatalf("defaults rejected: %v", err)
	}
	if zero.LeaseDuration != 0 {
		t.Fatal("Validate changed its receiver")
	}
	filled := zero.WithDefaults()
	if filled.LeaseDuration != pool.LeaseDurationDefault || filled.HeartbeatInterval != pool.HeartbeatIntervalDefault ||
		filled.Engine.ClaimGather != pool.ClaimGatherDefault || filled.Concurrency != pool.ConcurrencyDefault {
		t.Fatalf("WithDefaults: %+v", filled)
	}
}
