package store_test

import (
	"context"
	"strings"
	"testing"

	"github.com/leashq/leash/internal/pgtest"
	"github.com/leashq/leash/internal/store"
)

// Numbers jsonb refuses (huge exponents, endless digits) are kept as text: the document is
// always storable.
func TestCleanJSONNumbersStorable(t *testing.T) {
	t.Parallel()
	db := pgtest.Pool(t)
	for _, in := range []string{`{"a":1e999999}`, `[1E-99999, 2]`, `{"n":` + strings.Repeat("9", 200000) + `}`,
		`{"f":0.` + strings.Repeat("1", 20000) + `}`, `{"ok":1.5e10}`} {
		out, err := store.CleanJSON([]byte(in))
		if err != nil {
			t.Fatalf("%.40s: %v", in, err)
		}
		var ok bool
		if err := db.QueryRow(context.Background(), `SELECT $1::jsonb IS NOT NULL`, string(out)).Scan(&ok); err != nil {
			t.Errorf("%.40s cleaned to %.60s: %v", in, out, err)
		}
	}
	if out, _ := store.CleanJSON([]byte(`{"ok":1.5e10}`)); string(out) != `{"ok":1.5e10}` {
		t.Errorf("an ordinary number changed: %s", out)
	}
}
