package handlers

import (
	"net/netip"
	"net/url"
	"testing"
)

// Oracle's and GCP's IPv6 metadata addresses are refused like the others, unless allowed.
func TestPolicyRefusesMoreMetadataAddresses(t *testing.T) {
	t.Parallel()
	for _, a := range []string{"192.0.0.192", "fd20:ce::254", "::ffff:192.0.0.192", "64:ff9b::c000:c0"} {
		ip := netip.MustParseAddr(a)
		if why := (&HTTPPolicy{}).check(ip, 80, netip.AddrPort{}); why == "" {
			t.Errorf("%s: not refused", a)
		}
		allowed := &HTTPPolicy{Allow: []netip.Prefix{netip.PrefixFrom(ip.Unmap(), ip.Unmap().BitLen())}}
		if why := allowed.check(ip, 80, netip.AddrPort{}); why != "" {
			t.Errorf("%s allowed: %s", a, why)
		}
	}
	for _, a := range []string{"192.0.0.191", "192.0.0.193", "fd20:ce::253"} {
		if why := (&HTTPPolicy{}).check(netip.MustParseAddr(a), 80, netip.AddrPort{}); why != "" {
			t.Errorf("%s refused: %s", a, why)
		}
	}
}

func TestLeavesHost(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		from, to string
		leaves   bool
	}{
		{"https://a.example/x", "https://a.example/y", false},
		{"https://a.example/x", "https://A.EXAMPLE./y", false},
		{"https://a.example/x", "https://a.example:443/y", false},
		{"http://a.example/x", "https://a.example/y", false}, // an upgrade
		{"http://a.example:8080/x", "http://a.example:8080/y", false},
		{"https://a.example/x", "http://a.example/y", true}, // a downgrade
		{"https://a.example:8443/x", "http://a.example:8443/y", true},
		{"https://a.example/x", "https://b.example/y", true},
		{"https://a.example/x", "https://sub.a.example/y", true},
		{"https://a.example/x", "https://a.example:8443/y", true},
		{"http://a.example/x", "https://a.example:8443/y", true},
		{"http://127.0.0.1:1/x", "http://localhost:1/y", true},
	} {
		from, _ := url.Parse(c.from)
		to, _ := url.Parse(c.to)
		if got := leavesHost(from, to); got != c.leaves {
			t.Errorf("%s -> %s: leaves %v, want %v", c.from, c.to, got, c.leaves)
		}
	}
}
