package listener

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/leashq/leash/notify"
)

func TestParseRevocation(t *testing.T) {
	t.Parallel()
	good := map[string]Revocation{
		"42":                                   {ID: 42},
		" 42\n":                                {ID: 42},
		`{"id":42}`:                            {ID: 42},
		`{"id":42,"token":7,"reason":"wrong"}`: {ID: 42, Token: 7, Reason: "wrong"},
		`{"id" : 2, "token" : 1, "reason" : null}`:        {ID: 2, Token: 1},
		`{"id":9,"token":3,"reason":"x","takeover":true}`: {ID: 9, Token: 3, Reason: "x", Takeover: true},
	}
	for in, want := range good {
		got, err := ParseRevocation(in)
		if err != nil || got != want {
			t.Errorf("ParseRevocation(%q) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	bad := []string{
		"", " ", "abc", "0", "-1", "1.5", "99999999999999999999", "42 43", "0x2a",
		`{}`, `{"id":"42"}`, `{"id":1.5}`, `{"id":-3}`, `{"id":42,"extra":1}`, `{"id":42}{"id":43}`,
		`{"id":42} x`, `{"id":42,"token":0}`, `{"id":42,"takeover":true}`, `[42]`, `{"id":`,
		`{"id":42,"token":"7"}`, `{"id":99999999999999999999}`,
		strings.Repeat("7", 7900),
	}
	for _, in := range bad {
		if got, err := ParseRevocation(in); !errors.Is(err, ErrMalformed) {
			t.Errorf("ParseRevocation(%.50q) = %+v, %v; want ErrMalformed", in, got, err)
		}
	}
}

// The reason comes back storable: NUL and invalid UTF-8 replaced, at most notify.MaxReason bytes
// cut on a character boundary.
func TestParseRevocationCleansReason(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("é", 400) // 800 bytes
	for in, want := range map[string]string{
		`{"id":1,"reason":"a\u0000b"}`:                                      "a\uFFFDb",
		"{\"id\":1,\"reason\":\"a\x00b\"}":                                  "ab", // a raw NUL is not valid JSON either way
		"{\"id\":1,\"reason\":\"a\xffb\"}":                                  "a\uFFFDb",
		`{"id":1,"reason":"a\ud800b"}`:                                      "a\uFFFDb", // a lone surrogate
		`{"id":1,"reason":"` + long + `"}`:                                  strings.Repeat("é", 116) + "… [568 more bytes cut]",
		`{"id":1,"reason":"` + strings.Repeat("x", notify.MaxReason) + `"}`: strings.Repeat("x", notify.MaxReason),
	} {
		r, err := ParseRevocation(in)
		if strings.Contains(in, "\x00") {
			if err == nil {
				t.Errorf("ParseRevocation(%.40q) accepted a raw NUL in JSON", in)
			}
			continue
		}
		if err != nil || r.Reason != want {
			t.Errorf("ParseRevocation(%.40q) reason %.40q, %v; want %.40q", in, r.Reason, err, want)
		}
		if len(r.Reason) > notify.MaxReason {
			t.Errorf("reason of %d bytes", len(r.Reason))
		}
	}
}

func FuzzParseRevocation(f *testing.F) {
	for _, s := range []string{"42", `{"id":42,"token":7,"reason":"r"}`, `{"id":1,"token":2,"takeover":true}`, "", "{", "-1",
		`{"id":3,"reason":"a\u0000\ud800b"}`, "{\"id\":4,\"reason\":\"\xff\xfe\"}", `{"id":5,"reason":"` + strings.Repeat("é", 300) + `"}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseRevocation(s)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error does not wrap ErrMalformed: %v", err)
			}
			return
		}
		if r.ID <= 0 || r.Token < 0 || (r.Takeover && r.Token == 0) || len(s) > notify.MaxPayload {
			t.Fatalf("accepted invalid payload %q as %+v", s, r)
		}
		if !utf8.ValidString(r.Reason) || strings.IndexByte(r.Reason, 0) >= 0 || len(r.Reason) > notify.MaxReason {
			t.Fatalf("payload %q gave a reason that cannot be stored: %q", s, r.Reason)
		}
	})
}
