//go:build !linux

package netdial

import (
	"net"
	"time"
)

// setUserTimeout and setSockUserTimeout do nothing where TCP_USER_TIMEOUT is not known:
// KeepAlive and leash's statement deadlines still find a dead peer.
func setUserTimeout(*net.TCPConn, time.Duration) {}

func setSockUserTimeout(uintptr, time.Duration) {}
