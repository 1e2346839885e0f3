package main

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"reflect"
	"strings"
	"time"

	"github.com/sethvargo/go-envconfig"

	"github.com/leashq/leash/handlers"
	"github.com/leashq/leash/pool"
)

// env is the worker's configuration, read from the environment.
type env struct {
	DatabaseURL          string                   `env:"DATABASE_URL"`
	ListenDatabaseURL    string                   `env:"LISTEN_DATABASE_URL"`
	WorkerID             string                   `env:"WORKER_ID"`
	Queues               []string                 `env:"WORKER_QUEUES, default=default"`
	Concurrency          int                      `env:"WORKER_CONCURRENCY, default=100"`
	LeaseDuration        time.Duration            `env:"WORKER_LEASE_DURATION, default=30s"`
	HeartbeatInterval    time.Duration            `env:"WORKER_HEARTBEAT_INTERVAL, default=10s"`
	RenewRetryInterval   time.Duration            `env:"WORKER_RENEW_RETRY_INTERVAL"`
	LeaseSafetyMargin    time.Duration            `env:"WORKER_LEASE_SAFETY_MARGIN"`
	RescueInterval       time.Duration            `env:"WORKER_RESCUE_INTERVAL"`
	PollInterval         time.Duration            `env:"WORKER_POLL_INTERVAL, default=1s"`
	ShutdownTimeout      time.Duration            `env:"WORKER_SHUTDOWN_TIMEOUT, default=30s"`
	RevokeRequireRow     bool                     `env:"WORKER_REVOKE_REQUIRE_ROW, default=false"`
	AutoMigrate          bool                     `env:"WORKER_AUTO_MIGRATE, default=false"`
	DBMaxConns           int32                    `env:"WORKER_DB_MAX_CONNS, default=10"`
	HTTPAddr             string                   `env:"WORKER_HTTP_ADDR"`
	AdminToken           string                   `env:"WORKER_ADMIN_TOKEN"`
	AdminHosts           []string                 `env:"WORKER_ADMIN_HOSTS"`
	RetainCompleted      time.Duration            `env:"WORKER_RETENTION_COMPLETED, default=24h"`
	RetainFailed         time.Duration            `env:"WORKER_RETENTION_FAILED, default=168h"`
	LogLevel             string                   `env:"LOG_LEVEL, default=info"`
	LogFormat            string                   `env:"LOG_FORMAT"`
	ListenReconnectWait  time.Duration            `env:"WORKER_LISTEN_RECONNECT_DELAY, default=2s"`
	ExecAllow            []string                 `env:"WORKER_EXEC_ALLOW"`
	ExecGrace            time.Duration            `env:"WORKER_EXEC_GRACE, default=5s"`
	ExecEnvAllow         []string                 `env:"WORKER_EXEC_ENV_ALLOW"`
	WebhookAllow         []string                 `env:"WORKER_WEBHOOK_ALLOW"`
	WebhookBlockPrivate  bool                     `env:"WORKER_WEBHOOK_BLOCK_PRIVATE, default=false"`
	JobTimeouts          map[string]time.Duration `env:"WORKER_JOB_TIMEOUTS"`
	ControlConns         int                      `env:"WORKER_CONTROL_CONNS, default=4"`
	PlannerStatsInterval time.Duration            `env:"WORKER_PLANNER_STATS_INTERVAL, default=1s"`
}

// fieldEnv maps the env struct's field names (as go-envconfig and pool.ConfigError name them) to
// their variables.
var fieldEnv = func() map[string]string {
	m := map[string]string{}
	t := reflect.TypeFor[env]()
	for i := range t.NumField() {
		f := t.Field(i)
		key, _, _ := strings.Cut(f.Tag.Get("env"), ",")
		m[f.Name] = key
	}
	// pool.Config fields that are named differently here.
	m["ID"] = "WORKER_ID"
	m["ListenReconnectDelay"] = "WORKER_LISTEN_RECONNECT_DELAY"
	m["Timeouts"] = "WORKER_JOB_TIMEOUTS"
	return m
}()

// loadEnv reads and checks the configuration; errors name the variable and the rule.
func loadEnv(ctx context.Context, getenv func(string) string) (env, error) {
	var e env
	look := envconfig.LookuperFunc(func(key string) (string, bool) {
		v := getenv(key)
		return v, v != ""
	})
	if err := envconfig.ProcessWith(ctx, &envconfig.Config{Target: &e, Lookuper: look}); err != nil {
		msg := err.Error()
		if field, rest, ok := strings.Cut(msg, ": "); ok {
			if key := fieldEnv[field]; key != "" {
				return e, fmt.Errorf("%s=%q: %s", key, getenv(key), rest)
			}
		}
		return e, fmt.Errorf("configuration: %w", err)
	}
	switch strings.ToLower(e.LogLevel) {
	case "debug", "info", "warn", "error":
	default:
		return e, fmt.Errorf("LOG_LEVEL=%q: must be debug, info, warn or error", e.LogLevel)
	}
	switch e.LogFormat {
	case "", "tint", "json", "text":
	default:
		return e, fmt.Errorf("LOG_FORMAT=%q: must be tint, json or text", e.LogFormat)
	}
	if e.DBMaxConns < 1 {
		return e, fmt.Errorf("WORKER_DB_MAX_CONNS=%d: must be at least 1", e.DBMaxConns)
	}
	if e.ControlConns < 2 {
		return e, fmt.Errorf("WORKER_CONTROL_CONNS=%d: must be at least 2 (renewals must never wait behind a claim or an outcome)", e.ControlConns)
	}
	for _, c := range e.ExecAllow {
		if !filepath.IsAbs(strings.TrimSpace(c)) {
			return e, fmt.Errorf("WORKER_EXEC_ALLOW: %q must be an absolute path", c)
		}
	}
	if err := handlers.CheckExecEnvAllow(e.ExecEnvAllow); err != nil {
		return e, fmt.Errorf("WORKER_EXEC_ENV_ALLOW: %w", err)
	}
	if e.ExecGrace <= 0 {
		return e, fmt.Errorf("WORKER_EXEC_GRACE=%s: must be positive", e.ExecGrace)
	}
	for _, h := range e.AdminHosts {
		if !validHostName(strings.TrimSpace(h)) {
			return e, fmt.Errorf("WORKER_ADMIN_HOSTS: %q must be a host name without scheme or port, e.g. worker.internal "+
				"or .example.com for its subdomains (IP addresses need no entry)", h)
		}
	}
	if _, err := e.webhookAllow(); err != nil {
		return e, err
	}
	if err := e.poolConfig().Validate(); err != nil {
		var ce *pool.ConfigError
		if errors.As(err, &ce) {
			return e, fmt.Errorf("%s: %s", fieldEnv[ce.Field], ce.Rule)
		}
		return e, err
	}
	return e, nil
}

// validHostName accepts letters, digits, hyphens and dots, optionally starting with a dot.
func validHostName(h string) bool {
	h = strings.TrimPrefix(h, ".")
	if h == "" || len(h) > 253 {
		return false
	}
	for _, c := range []byte(h) {
		if !(c == '.' || c == '-' || c == '_' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z') {
			return false
		}
	}
	return true
}

// webhookAllow parses WORKER_WEBHOOK_ALLOW: IP addresses and CIDR networks.
func (e env) webhookAllow() ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, a := range e.WebhookAllow {
		a = strings.TrimSpace(a)
		if a == "" {
			continue
		}
		if p, err := netip.ParsePrefix(a); err == nil {
			out = append(out, p.Masked())
			continue
		}
		ip, err := netip.ParseAddr(a)
		if err != nil {
			return nil, fmt.Errorf("WORKER_WEBHOOK_ALLOW: %q must be an IP address or a CIDR network, e.g. 10.1.0.0/16", a)
		}
		out = append(out, netip.PrefixFrom(ip.Unmap(), ip.Unmap().BitLen()))
	}
	return out, nil
}

func (e env) poolConfig() pool.Config {
	return pool.Config{
		ID: e.WorkerID, Queues: e.Queues, Concurrency: e.Concurrency,
		LeaseDuration: e.LeaseDuration, HeartbeatInterval: e.HeartbeatInterval,
		RenewRetryInterval: e.RenewRetryInterval, LeaseSafetyMargin: e.LeaseSafetyMargin,
		RescueInterval: e.RescueInterval, PollInterval: e.PollInterval, ShutdownTimeout: e.ShutdownTimeout,
		RevokeRequireRow: e.RevokeRequireRow, ListenReconnectDelay: e.ListenReconnectWait,
		RetainCompleted: e.RetainCompleted, RetainFailed: e.RetainFailed,
		Timeouts: e.JobTimeouts, ControlConns: e.ControlConns, PlannerStatsInterval: e.PlannerStatsInterval,
	}
}
