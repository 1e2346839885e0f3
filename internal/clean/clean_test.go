package clean

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestText(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"plain":        "plain",
		"a\x00b":       "a\uFFFDb",
		"a\xffb":       "a\uFFFDb",
		"\xed\xa0\x80": "\uFFFD", // an encoded surrogate is invalid UTF-8: one run, one U+FFFD
	} {
		if got := Text(in, 0); got != want {
			t.Errorf("Text(%q) = %q, want %q", in, got, want)
		}
	}
	long := strings.Repeat("é", 400) // 800 bytes
	got := Text(long, 100)
	if len(got) > 100 || !utf8.ValidString(got) || !strings.Contains(got, " more bytes cut]") {
		t.Fatalf("Text(800 bytes, 100) = %q (%d bytes)", got, len(got))
	}
	if got := Text(long, 5); len(got) > 5 || !utf8.ValidString(got) {
		t.Fatalf("Text(800 bytes, 5) = %q", got)
	}
	if got := Text("abc", 3); got != "abc" {
		t.Fatalf("Text at its limit = %q", got)
	}
}

func FuzzText(f *testing.F) {
	f.Add("a\x00\xffb", 10)
	f.Fuzz(func(t *testing.T, s string, max int) {
		got := Text(s, max)
		if !utf8.ValidString(got) || strings.IndexByte(got, 0) >= 0 || (max > 0 && len(got) > max) {
			t.Fatalf("Text(%q, %d) = %q", s, max, got)
		}
	})
}
