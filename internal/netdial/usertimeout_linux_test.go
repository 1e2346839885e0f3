package netdial

import (
	"context"
	"net"
	"syscall"
	"testing"
)

// A connection dialled through WithKeepAlive has TCP_USER_TIMEOUT set.
func TestUserTimeoutIsSet(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for name, dial := range map[string]func(context.Context, string, string) (net.Conn, error){
		"WithKeepAlive": WithKeepAlive(nil),
	} {
		c, err := dial(context.Background(), "tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := c.(*net.TCPConn).SyscallConn()
		var ms int
		raw.Control(func(fd uintptr) { ms, err = syscall.GetsockoptInt(int(fd), syscall.IPPROTO_TCP, tcpUserTimeout) })
		c.Close()
		if err != nil || ms != int(UserTimeout.Milliseconds()) {
			t.Errorf("%s: TCP_USER_TIMEOUT %d ms (%v), want %d", name, ms, err, UserTimeout.Milliseconds())
		}
	}
}
