// Package syncbuf holds a buffer that one goroutine (or a child process's output copier) writes
// while another reads it, for tests that watch a worker's log.
//
// The library (internal/syncbuf) and the worker binary's module (cmd/worker/internal/syncbuf) each
// have this file, the same to the byte; cmd/worker's TestCopiesMatchLibrary checks it.
package syncbuf

import (
	"bytes"
	"sync"
)

// Buffer is a bytes.Buffer safe for concurrent Write and String.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns what was written so far.
func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
