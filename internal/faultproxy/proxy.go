// Package faultproxy is a TCP proxy for fault tests: it sits between a worker and PostgreSQL and
// can cut connections, hold traffic (a black hole: the connection stays open and nothing
// arrives) or delay it, then heal.
package faultproxy

import (
	"net"
	"sync"
	"time"
)

// Proxy forwards TCP connections from Addr to a target.
type Proxy struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	cond   *sync.Cond
	held   bool
	heldUp bool // only client-to-server traffic is held
	refuse bool
	delay  time.Duration
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// New starts a proxy on a free loopback port forwarding to target (host:port).
func New(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.acceptLoop()
	return p, nil
}

// Addr is the proxy's listening address (host:port).
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Port is the proxy's listening port.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// Cut closes every open connection and refuses new ones until Heal.
func (p *Proxy) Cut() {
	p.mu.Lock()
	p.refuse = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
}

// Hold stops forwarding in both directions without closing anything, as a black-holed network
// would: connections (new ones too) stay open and silent until Heal.
func (p *Proxy) Hold() {
	p.mu.Lock()
	p.held = true
	p.mu.Unlock()
}

// HoldUpstream stops forwarding from the client to the server only (one-way loss): the worker's
// statements never arrive, while what the server already sent still comes through.
func (p *Proxy) HoldUpstream() {
	p.mu.Lock()
	p.heldUp = true
	p.mu.Unlock()
}

// Delay adds d before forwarding each chunk of data.
func (p *Proxy) Delay(d time.Duration) {
	p.mu.Lock()
	p.delay = d
	p.mu.Unlock()
}

// Heal restores normal forwarding.
func (p *Proxy) Heal() {
	p.mu.Lock()
	p.held, p.heldUp, p.refuse, p.delay = false, false, false, 0
	p.cond.Broadcast()
	p.mu.Unlock()
}

// Close stops the proxy and closes every connection.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	p.held = false
	p.cond.Broadcast()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.ln.Close()
	p.wg.Wait()
}

func (p *Proxy) acceptLoop() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.refuse || p.closed {
			p.mu.Unlock()
			c.Close()
			continue
		}
		p.conns[c] = struct{}{}
		p.mu.Unlock()
		p.wg.Add(1)
		go p.serve(c)
	}
}

func (p *Proxy) serve(client net.Conn) {
	defer p.wg.Done()
	server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		p.drop(client)
		return
	}
	p.mu.Lock()
	p.conns[server] = struct{}{}
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	go func() { p.pipe(server, client, true); done <- struct{}{} }()
	go func() { p.pipe(client, server, false); done <- struct{}{} }()
	<-done
	p.drop(client)
	p.drop(server)
	<-done
}

func (p *Proxy) drop(c net.Conn) {
	c.Close()
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

// pipe copies src to dst, waiting while the proxy holds traffic (upstream: client to server).
func (p *Proxy) pipe(dst, src net.Conn, upstream bool) {
	buf := make([]byte, 32*1024)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			for (p.held || (upstream && p.heldUp)) && !p.closed {
				p.cond.Wait()
			}
			delay := p.delay
			p.mu.Unlock()
			if delay > 0 {
				time.Sleep(delay)
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return // EOF or a closed connection: the other direction is torn down by serve
		}
	}
}
