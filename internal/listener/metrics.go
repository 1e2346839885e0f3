package listener

import "sync/atomic"

// Metrics counts what a worker's listener saw. All fields are safe for concurrent use.
type Metrics struct {
	Received   atomic.Int64 // notifications received on any channel
	Malformed  atomic.Int64 // job_revoked payloads that did not parse
	Reconnects atomic.Int64 // connections made after the first
	PingsLost  atomic.Int64 // liveness pings that did not come back in time
	Terminated atomic.Int64 // server backends of abandoned connections that were terminated
	// Wakes counts notifications on the worker's own wake channel naming one of its queues;
	// WakesIgnored those naming none (forged or garbage); WakesHeld notifications held back
	// because the claims after the ones before kept finding nothing.
	Wakes, WakesIgnored, WakesHeld atomic.Int64
}
