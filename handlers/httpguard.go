package handlers

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"syscall"
	"time"
)

// HTTPPolicy says which addresses the http handler may connect to. It is enforced when a
// connection is made, on the address the name resolved to, so neither a redirect nor a name that
// resolves differently later (DNS rebinding) gets around it.
//
// Always refused unless Allow covers them: link-local addresses (169.254.0.0/16, fe80::/10),
// where cloud metadata services answer, and the other well-known metadata addresses
// (AWS fd00:ec2::254, Alibaba 100.100.100.200, Azure 168.63.129.16, Oracle 192.0.0.192, GCP
// fd20:ce::254 and the name metadata.google.internal).
// With BlockPrivate, also loopback, private (10/8, 172.16/12, 192.168/16, fc00::/7), shared
// (100.64/10), unspecified, multicast and other special ranges. Never reachable, whatever Allow
// says: the worker's own HTTP endpoints (Self's port on a loopback, unspecified or local address).
type HTTPPolicy struct {
	// BlockPrivate also refuses loopback and private networks: for webhooks whose URLs come from
	// users.
	BlockPrivate bool
	// Allow lists networks that may be reached even though refused above (say an internal
	// service's subnet with BlockPrivate, or 169.254.170.2/32 for a container metadata endpoint).
	Allow []netip.Prefix
	// Self is the address the worker's own HTTP endpoints listen on (host:port); "" if none.
	Self string
}

// AddressError is a connection the policy refused. A job failing with it fails permanently.
type AddressError struct {
	Host string         // the name dialled, when refused by name
	Addr netip.AddrPort // the address, when refused by address
	Why  string
}

func (e *AddressError) Error() string {
	target := e.Host
	if e.Addr.IsValid() {
		target = e.Addr.String()
	}
	return fmt.Sprintf("connection to %s refused: %s", target, e.Why)
}

// metadataNames are names of metadata services, refused by name (outside the cloud in question
// they may resolve to anything) unless Allow covers their address.
var metadataNames = map[string]netip.Addr{
	"metadata.google.internal": netip.MustParseAddr("169.254.169.254"),
}

var (
	metadataAddrs = []netip.Prefix{
		netip.MustParsePrefix("169.254.0.0/16"), netip.MustParsePrefix("fe80::/10"),
		netip.MustParsePrefix("fd00:ec2::254/128"), netip.MustParsePrefix("100.100.100.200/32"),
		netip.MustParsePrefix("168.63.129.16/32"), netip.MustParsePrefix("192.0.0.192/32"),
		netip.MustParsePrefix("fd20:ce::254/128"),
	}
	specialAddrs = []netip.Prefix{
		netip.MustParsePrefix("0.0.0.0/8"), netip.MustParsePrefix("100.64.0.0/10"),
		netip.MustParsePrefix("192.0.0.0/24"), netip.MustParsePrefix("198.18.0.0/15"),
		netip.MustParsePrefix("240.0.0.0/4"), // reserved and broadcast
		netip.MustParsePrefix("64:ff9b:1::/48"),
	}
	nat64 = netip.MustParsePrefix("64:ff9b::/96")
)

const allowHint = "; WORKER_WEBHOOK_ALLOW can allow it"

// check returns the reason to refuse ip:port, or "".
func (p *HTTPPolicy) check(ip netip.Addr, port uint16, self netip.AddrPort) string {
	ip = ip.WithZone("").Unmap()
	if self.IsValid() && port == self.Port() && (ip.IsLoopback() || ip.IsUnspecified() || ip == self.Addr().Unmap() || isLocal(ip)) {
		return "the worker's own HTTP endpoints"
	}
	for _, a := range p.Allow {
		if a.Contains(ip) {
			return ""
		}
	}
	if nat64.Contains(ip) { // an IPv4 address reached through NAT64
		b := ip.As16()
		ip = netip.AddrFrom4([4]byte(b[12:]))
	}
	for _, m := range metadataAddrs {
		if m.Contains(ip) {
			return "link-local or cloud metadata address" + allowHint
		}
	}
	if !p.BlockPrivate {
		return ""
	}
	special := ip.IsLoopback() || ip.IsPrivate() || ip.IsUnspecified() || ip.IsMulticast()
	for _, s := range specialAddrs {
		special = special || s.Contains(ip)
	}
	if special {
		return "loopback, private or special-purpose address (WORKER_WEBHOOK_BLOCK_PRIVATE)" + allowHint
	}
	return ""
}

// isLocal reports whether ip is one of this machine's interface addresses.
func isLocal(ip netip.Addr) bool {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if la, ok := netip.AddrFromSlice(n.IP); ok && la.Unmap() == ip {
				return true
			}
		}
	}
	return false
}

// selfAddr reads Self; a port of 0 or a bad address means no check.
func (p *HTTPPolicy) selfAddr() netip.AddrPort {
	if p.Self == "" {
		return netip.AddrPort{}
	}
	host, port, err := net.SplitHostPort(p.Self)
	if err != nil {
		return netip.AddrPort{}
	}
	pn, err := net.LookupPort("tcp", port)
	if err != nil || pn <= 0 || pn > 65535 {
		return netip.AddrPort{}
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		ip = netip.IPv6Unspecified() // a name or nothing: the port alone identifies it locally
	}
	return netip.AddrPortFrom(ip, uint16(pn))
}

// DialContext connects like a net.Dialer, refusing what the policy refuses.
func (p *HTTPPolicy) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	if ip, ok := metadataNames[strings.TrimSuffix(strings.ToLower(host), ".")]; ok {
		allowed := false
		for _, a := range p.Allow {
			allowed = allowed || a.Contains(ip)
		}
		if !allowed {
			return nil, &net.OpError{Op: "dial", Net: network, Err: &AddressError{Host: host, Why: "cloud metadata service" + allowHint}}
		}
	}
	self := p.selfAddr()
	d := &net.Dialer{
		Timeout:   30 * time.Second,
		KeepAlive: 30 * time.Second,
		ControlContext: func(_ context.Context, _, address string, _ syscall.RawConn) error {
			ap, err := netip.ParseAddrPort(address)
			if err != nil {
				return &AddressError{Host: address, Why: "not an IP address and port"}
			}
			if why := p.check(ap.Addr(), ap.Port(), self); why != "" {
				return &AddressError{Addr: ap, Why: why}
			}
			return nil
		},
	}
	return d.DialContext(ctx, network, addr)
}

// Client is an HTTP client whose connections obey the policy. It connects directly, ignoring
// HTTP_PROXY and HTTPS_PROXY: through a proxy the policy could not see where a request goes.
func (p HTTPPolicy) Client() *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil
	t.DialContext = p.DialContext
	t.MaxIdleConnsPerHost = 16
	return &http.Client{Transport: t}
}
