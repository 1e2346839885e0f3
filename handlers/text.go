package handlers

import (
	"unicode/utf8"

	"github.com/leashq/leash/internal/clean"
)

// Error texts end up in PostgreSQL text and jsonb columns, which refuse NUL bytes and invalid
// UTF-8. Text that comes from outside (a command's output, a webhook's answer) goes through
// these before it becomes part of an error; both clean it with clean.Text, leash's one rule.

// headText is the clean start of b, at most n bytes, cut on a character boundary (a character
// cut off by whoever truncated b is dropped).
func headText(b []byte, n int) string {
	// Drop a character cut off at the end rather than showing it as U+FFFD.
	for i := 1; i < utf8.UTFMax && i <= len(b); i++ {
		if utf8.RuneStart(b[len(b)-i]) {
			if !utf8.FullRune(b[len(b)-i:]) {
				b = b[:len(b)-i]
			}
			break
		}
	}
	s := clean.Text(string(b), 0)
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// tailText is the clean end of b, at most n bytes, starting on a character boundary.
func tailText(b []byte, n int) string {
	for i := 0; i < utf8.UTFMax-1 && len(b) > 0 && !utf8.RuneStart(b[0]); i++ {
		b = b[1:] // the rest of a character cut off at the start
	}
	s := clean.Text(string(b), 0)
	if len(s) <= n {
		return s
	}
	i := len(s) - n
	for i < len(s) && !utf8.RuneStart(s[i]) {
		i++
	}
	return s[i:]
}
