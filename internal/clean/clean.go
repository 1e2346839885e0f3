// Package clean makes text from outside the process (handler errors, panic values, command
// output, revocation reasons) storable in PostgreSQL text and jsonb strings, with one rule used
// everywhere: NUL bytes and invalid UTF-8, which PostgreSQL rejects, become U+FFFD, so that
// nothing is silently dropped and the reader sees where something was.
package clean

import (
	"strconv"
	"strings"
	"unicode/utf8"
)

// Text returns s with every NUL byte and every invalid UTF-8 sequence replaced by U+FFFD. When
// max > 0 and the result is longer than max bytes, it is cut on a character boundary and ends
// with a note saying how many bytes were cut, the whole at most max bytes. Nothing else of s is
// changed.
func Text(s string, max int) string {
	if strings.IndexByte(s, 0) >= 0 {
		s = strings.ReplaceAll(s, "\x00", "\uFFFD")
	}
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	if max <= 0 || len(s) <= max {
		return s
	}
	note := func(n int) string { return "… [" + strconv.Itoa(n) + " more bytes cut]" }
	cut := max - len(note(len(s))) // the note of what is cut is no longer than this one
	if cut < 0 {
		for cut = max; cut > 0 && !utf8.RuneStart(s[cut]); cut-- {
		}
		return s[:cut]
	}
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + note(len(s)-cut)
}
