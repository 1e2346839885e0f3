package leashotel_test

import (
	"os"
	"strings"
	"testing"
)

// The point of this module: an application that imports leash but not leashotel never gets
// OpenTelemetry in its go.mod or go.sum.
func TestRootModuleStaysFreeOfOpenTelemetry(t *testing.T) {
	for _, f := range []string{"../go.mod", "../go.sum"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(b), "opentelemetry") {
			t.Errorf("%s mentions OpenTelemetry", f)
		}
	}
}
