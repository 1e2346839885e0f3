package pool

import (
	"encoding/json"
	"errors"
	"fmt"
)

// MaxTraceContextBytes is the largest trace context a job carries, as JSON: ample for a W3C
// traceparent (55 bytes) and tracestate (512 by the specification). A tracing worker reads a
// larger trace_context as none.
const MaxTraceContextBytes = 4096

// encodeTraceContext is tc as the JSON object stored in trace_context; nil for an empty carrier.
func encodeTraceContext(tc map[string]string) ([]byte, error) {
	if len(tc) == 0 {
		return nil, nil
	}
	for k, v := range tc {
		if k == "" || !validName(k) || !validName(v) {
			return nil, errors.New("trace context keys must be non-empty, and keys and values valid UTF-8 without NUL bytes")
		}
	}
	b, err := json.Marshal(tc)
	if err != nil {
		return nil, fmt.Errorf("trace context: %w", err)
	}
	if len(b) > MaxTraceContextBytes {
		return nil, fmt.Errorf("trace context is %d bytes as JSON, more than %d", len(b), MaxTraceContextBytes)
	}
	return b, nil
}

// decodeTraceContext reads a claimed row's trace_context, which any SQL client may have written:
// whatever is not a JSON object is no trace context, and members whose values are not strings
// are left out. It never fails.
func decodeTraceContext(b []byte) map[string]string {
	if len(b) == 0 || len(b) > MaxTraceContextBytes {
		return nil
	}
	var raw map[string]any
	if err := json.Unmarshal(b, &raw); err != nil {
		return nil
	}
	var tc map[string]string
	for k, v := range raw {
		if s, ok := v.(string); ok && k != "" {
			if tc == nil {
				tc = make(map[string]string, len(raw))
			}
			tc[k] = s
		}
	}
	return tc
}
