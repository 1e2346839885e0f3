package listener

import (
	"context"
	"log/slog"
	"time"
)

// TerminateAbandoned exposes terminateAbandoned to the external tests.
func (l *Listener) TerminateAbandoned(ctx context.Context, pid int32, backendStart time.Time) bool {
	if l.log == nil {
		l.log = slog.New(slog.DiscardHandler)
	}
	if l.Metrics == nil {
		l.Metrics = &Metrics{}
	}
	return l.terminateAbandoned(ctx, pid, backendStart)
}
