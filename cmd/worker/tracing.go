package main

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	leashotel "github.com/leashq/leash/otel"
	"github.com/leashq/leash/pool"
)

// serviceNameDefault names the worker's spans' service when OTEL_SERVICE_NAME is not set.
const serviceNameDefault = "leash-worker"

// tracingOn reads OpenTelemetry's standard variables and reports whether this run exports
// traces. Tracing is on when OTEL_TRACES_EXPORTER is "otlp", or unset while an OTLP endpoint
// (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is; off when
// OTEL_TRACES_EXPORTER is "none", OTEL_SDK_DISABLED is "true", or nothing is set. Only OTLP over
// HTTP with protobuf is built in: other exporters and protocols are configuration errors naming
// the variable.
func tracingOn(getenv func(string) string) (bool, error) {
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return false, nil
	}
	on := getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
	switch exp := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")); exp {
	case "":
	case "none":
		return false, nil
	case "otlp":
		on = true
	default:
		return false, fmt.Errorf("OTEL_TRACES_EXPORTER: %q is not built into this worker (use otlp or none)", exp)
	}
	if !on {
		return false, nil
	}
	name := "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	proto := strings.TrimSpace(getenv(name))
	if proto == "" {
		name = "OTEL_EXPORTER_OTLP_PROTOCOL"
		proto = strings.TrimSpace(getenv(name))
	}
	if proto != "" && proto != "http/protobuf" {
		return false, fmt.Errorf("%s: %q is not built into this worker (use http/protobuf)", name, proto)
	}
	return true, nil
}

// startTracing installs an attempt hook exporting spans over OTLP/HTTP when the environment
// asks for it (tracingOn) and returns the function that flushes and stops the exporter at exit.
// The exporter reads the rest of its settings (headers, timeout, compression, certificates) from
// the standard OTEL_EXPORTER_OTLP_* variables, the batch processor from OTEL_BSP_*, the sampler
// from OTEL_TRACES_SAMPLER, and the resource from OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
func startTracing(ctx context.Context, getenv func(string) string, cfg *pool.Config, log *slog.Logger) (stop func(), err error) {
	on, err := tracingOn(getenv)
	if err != nil || !on {
		return func() {}, err
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("OpenTelemetry exporter: %w", err)
	}
	res, err := resource.Merge(
		resource.NewSchemaless(attribute.String("service.name", serviceNameDefault)),
		resource.Environment(), // OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win
	)
	if err != nil {
		return nil, fmt.Errorf("OTEL_RESOURCE_ATTRIBUTES: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	cfg.Hooks = append(cfg.Hooks, leashotel.NewHook(leashotel.Config{TracerProvider: tp}))
	service, _ := res.Set().Value("service.name")
	log.Info("tracing on: exporting spans over OTLP/HTTP", slog.String("service", service.AsString()))
	return func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tp.Shutdown(sctx); err != nil {
			log.Warn("flushing spans at exit failed", slog.Any("err", err))
		}
	}, nil
}
