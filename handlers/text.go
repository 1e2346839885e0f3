package handlers

import (
	"strings"
	"unicode/utf8"
)

// Error texts end up in PostgreSQL text and jsonb columns, which refuse NUL bytes and invalid
// UTF-8. Text that comes from outside (a command's output, a webhook's answer) goes through
// these before it becomes part of an error.

// cleanText replaces invalid UTF-8 and NUL bytes with U+FFFD.
func cleanText(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	return strings.ReplaceAll(s, "\x00", "\uFFFD")
}

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
	s := cleanText(string(b))
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
	s := cleanText(string(b))
	if len(s) <= n {
		return s
	}
	i := len(s) - n
	for i < len(s) && !utf8.RuneStart(s[i]) {
		i++
	}
	return s[i:]
}
