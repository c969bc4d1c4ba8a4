package nodepool

// Connecting to the node and reconnecting after it went away: connect
// (the handshake and the first region, for Dial and redial), replyErr (an
// Error reply as a Go error), lost (a connection's end: its waiters
// woken, its regions retired locally, the redial started), redial, and
// spawn, which starts the client's goroutines so that Close can wait for
// them.
//
// Locks: c.mu, held only to read or change the client's state, never
// across a socket operation or a hook. lost runs with the connection's
// rmu held (from readFailed) and spawn may (from readOne): they take c.mu
// under it, the order client.go gives (rmu, then c.mu).

import (
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"golang.org/x/sys/unix"
)

// connect dials, shakes hands, maps the first region, and starts the
// reader. Called by Dial and by the reconnection loop.
func (c *Client) connect() error {
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: c.socket, Net: "unixpacket"})
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrUnavailable, c.socket, err)
	}
	conn := wire.NewConn(uc)
	fail := func(err error) error { _ = conn.Close(); return err }
	// The handshake and the first region within the op timeout: a node
	// that accepts but never answers is unavailable, not a hang.
	_ = uc.SetDeadline(time.Now().Add(c.cfg.Timeout))
	hello := &wire.Msg{Type: wire.THello, ReqID: 1, Version: wire.Version, Namespace: c.cfg.Namespace, Layout: c.cfg.Layout}
	if err := conn.Send(hello, -1); err != nil {
		return fail(fmt.Errorf("%w: hello: %w", ErrUnavailable, err))
	}
	var m wire.Msg
	if _, err := conn.Recv(&m); err != nil {
		return fail(fmt.Errorf("%w: hello: %w", ErrUnavailable, err))
	}
	switch {
	case m.Type == wire.TError:
		return fail(replyErr(&m))
	case m.Type != wire.THelloOK:
		return fail(fmt.Errorf("%w: the node answered Hello with %v", ErrUnavailable, m.Type))
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return fail(ErrClientClosed)
	}
	c.epoch++
	epoch := c.epoch
	c.info = Info{ClientID: m.ClientID, NamespaceID: m.NamespaceID, SlotSize: m.SlotSize, PageMode: m.Text, Epoch: epoch, announced: int(m.Regions)}
	c.mu.Unlock()
	regions := m.Regions
	// The first region at once: mapped, populated, registered.
	if regions > 0 {
		fd, err := conn.Recv(&m)
		if err == nil && (m.Type != wire.TRegionAdded || fd < 0) {
			err = fmt.Errorf("%v with fd %d, want the first RegionAdded", m.Type, fd)
		}
		if err != nil {
			if fd >= 0 {
				_ = unix.Close(fd)
			}
			return fail(fmt.Errorf("%w: first region: %w", ErrUnavailable, err))
		}
		_ = uc.SetDeadline(time.Time{})
		c.addRegion(regionAdd{reg: m.Region, fd: fd, epoch: epoch})
	}
	_ = uc.SetDeadline(time.Time{})
	cs := &connState{conn: conn, epoch: epoch, free: make(chan struct{}, 1)}
	c.mu.Lock()
	c.conn, c.cs = conn, cs
	c.mu.Unlock()
	if c.cfg.OnEvents != nil {
		c.spawn(func() { _, _ = c.call(&wire.Msg{Type: wire.TSubscribe}, wire.TOK) })
	}
	if !c.spawn(func() { c.idleReader(cs) }) {
		_ = conn.Close() // Close is draining: this redial's connection ends here
	}
	return nil
}

func replyErr(m *wire.Msg) error {
	e := &wire.Error{Code: m.Code, Text: m.Text}
	switch m.Code {
	case wire.CodeVersion:
		return fmt.Errorf("%w: %w", ErrVersion, e)
	case wire.CodeLayout:
		return fmt.Errorf("%w: %w", ErrLayout, e)
	case wire.CodeHandshake:
		return fmt.Errorf("%w: %w", ErrRefused, e)
	case wire.CodeNotYours:
		return fmt.Errorf("%w: %w", ErrNotYours, e)
	case wire.CodeInvalid, wire.CodeUnsupported, wire.CodeMalformed:
		return fmt.Errorf("%w: %w", ErrInvalid, e)
	case wire.CodeClosed:
		return fmt.Errorf("%w: %w", ErrUnavailable, e)
	}
	return e
}

// spawn runs f on a goroutine that Close waits for, and reports true;
// false, and nothing runs, once Close is draining: every wg.Add then
// happens before Close's Wait (under mu), as a WaitGroup requires of an
// Add from zero (the race detector caught lost's Add beside Close's Wait).
func (c *Client) spawn(f func()) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.draining {
		return false
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		f()
	}()
	return true
}

// lost handles the end of a connection.
func (c *Client) lost(conn *wire.Conn, epoch uint32) {
	_ = conn.Close()
	c.mu.Lock()
	if c.epoch == epoch {
		c.conn = nil
	}
	for id, w := range c.waiters {
		if w.epoch == epoch {
			delete(c.waiters, id)
			if !w.abandoned {
				close(w.ch)
			}
		}
	}
	var gone []*Region
	for id, r := range c.regions {
		if r.epoch == epoch {
			gone = append(gone, r)
			delete(c.regions, id)
		}
	}
	closed := c.closed
	start := !closed && c.cfg.Redial > 0 && !c.redialOn
	if start {
		c.redialOn = true
	}
	c.mu.Unlock()
	if !closed {
		c.cfg.Logf("node at %s gone: %d regions retired locally", c.socket, len(gone))
	}
	// Not on the caller that noticed: the hooks may wait for copies
	// (but on it while Close drains, which waits for it then).
	retire := func() {
		for _, r := range gone {
			c.retireLocal(r)
		}
	}
	if !c.spawn(retire) {
		retire()
	}
	if start {
		c.spawn(c.redial) // start: not closed, so not draining either
	}
}

func (c *Client) redial() {
	t := time.NewTicker(c.cfg.Redial)
	defer t.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-t.C:
		}
		err := c.connect()
		if err == nil {
			c.mu.Lock()
			c.redialOn = false
			c.mu.Unlock()
			c.cfg.Logf("reconnected to %s", c.socket)
			return
		}
		if errors.Is(err, ErrClientClosed) {
			return
		}
		if !errors.Is(err, ErrUnavailable) {
			c.cfg.Logf("reconnect to %s: %v", c.socket, err)
		}
	}
}
