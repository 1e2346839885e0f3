package store

import (
	"bytes"
	"encoding/json"
	"fmt"
	"regexp"
	"unicode/utf8"

	"github.com/leashq/leash/internal/clean"
)

// Limits on text leash stores from outside the process (handler errors, panic values, stacks,
// revocation reasons): bounded, so that one huge message cannot bloat a row or fail a batch.
const (
	MaxErrorBytes  = 16 << 10
	MaxStackBytes  = 16 << 10
	MaxReasonBytes = 1 << 10
)

// CleanJSON makes a JSON document storable as jsonb: strings (keys included) holding NUL, which
// jsonb rejects as \u0000, or lone surrogates get U+FFFD instead (clean.Text), as do invalid
// UTF-8 bytes. A document without
// either is returned as is. It fails only for invalid JSON.
func CleanJSON(b []byte) ([]byte, error) {
	// Any \u escape may be a NUL or a lone surrogate (jsonb refuses both): those documents are
	// decoded and encoded again; Go's encoder writes neither.
	if !bytes.Contains(b, []byte(`\u`)) && utf8.Valid(b) && bytes.IndexByte(b, 0) < 0 && !hugeNumber.Match(b) {
		return b, nil
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, fmt.Errorf("invalid JSON: %w", err)
	}
	out, err := json.Marshal(cleanValue(v))
	if err != nil {
		return nil, fmt.Errorf("re-encode JSON: %w", err)
	}
	return out, nil
}

func cleanValue(v any) any {
	switch x := v.(type) {
	case string:
		return clean.Text(x, 0)
	case []any:
		for i := range x {
			x[i] = cleanValue(x[i])
		}
		return x
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			out[clean.Text(k, 0)] = cleanValue(e)
		}
		return out
	case json.Number:
		// jsonb stores numbers as numeric, which refuses exponents beyond about ±16000 and
		// very long fractions: such a number is kept as its text.
		if len(x) > maxNumberText || hugeNumber.MatchString(string(x)) {
			return clean.Text(string(x), 0)
		}
		return x
	default:
		return v
	}
}

// maxNumberText is the longest number kept as a number (numeric allows 16383 fraction digits).
const maxNumberText = 1000

// hugeNumber finds a number whose exponent has four digits or more, or a run of digits longer
// than maxNumberText: one that jsonb may refuse.
var hugeNumber = regexp.MustCompile(`[0-9.][eE][+-]?[0-9]{4,}|[0-9]{1000,}`)
