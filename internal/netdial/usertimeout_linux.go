package netdial

import (
	"net"
	"syscall"
	"time"
)

// tcpUserTimeout is TCP_USER_TIMEOUT from linux/tcp.h (the syscall package lacks it).
const tcpUserTimeout = 0x12

// setUserTimeout bounds how long data sent on c may go unacknowledged before the kernel drops
// the connection. Keepalive alone does not cover that case: its probes start only on an idle
// connection, and a statement sent to a host that died is retransmitted for about 15 minutes.
// Best effort, like KeepAlive.
func setUserTimeout(c *net.TCPConn, d time.Duration) {
	if raw, err := c.SyscallConn(); err == nil {
		raw.Control(func(fd uintptr) { setSockUserTimeout(fd, d) })
	}
}

func setSockUserTimeout(fd uintptr, d time.Duration) {
	_ = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, tcpUserTimeout, int(d/time.Millisecond))
}
