package nodepool

// A request's round trip and the reading of the connection: connState
// (one connection's reading state), the waiters, call and callEpoch,
// readOne (a reply to its waiter, a push handled), the idle reader, lead
// (a caller reading until its own reply comes), and compensate (giving
// back what a reply nobody waits for any more holds).
//
// Locks: cs.rmu makes one goroutine at a time the connection's reader
// (readOne, readFailed and lead run with it held); under it readOne takes
// c.mu to find and remove a reply's waiter (rmu, then c.mu). callEpoch
// takes c.mu only to register its waiter, and releases it before it
// sends or tries rmu.

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"golang.org/x/sys/unix"
)

// connState is one connection's reading state. Whoever holds rmu reads
// the socket and dispatches what it reads: a caller waiting for its reply
// (the leader: it reads until its own reply comes, handing others' to
// their waiters, so that a lone caller is woken by the socket itself, not
// by another goroutine), or, when no call is in flight, the idle reader
// (pushes, and noticing the node go away).
type connState struct {
	conn     *wire.Conn
	epoch    uint32
	rmu      sync.Mutex
	free     chan struct{} // cap 1: rmu was released (a hint to waiters)
	inflight atomic.Int32
	activity atomic.Uint64
	dead     atomic.Bool
	// idleReading: the idle reader holds rmu; a caller kicks it off the
	// socket with a read deadline in the past.
	idleReading atomic.Bool
}

func (cs *connState) release() {
	cs.rmu.Unlock()
	select {
	case cs.free <- struct{}{}:
	default:
	}
}

type waiter struct {
	ch        chan *wire.Msg
	abandoned bool
	epoch     uint32
}

// readOne reads one message with cs.rmu held and dispatches it: a push
// is handled, a reply goes to its waiter, unless it is me's, which is
// returned. err is the socket's (a deadline, or the connection's end).
func (c *Client) readOne(cs *connState, me *waiter) (*wire.Msg, error) {
	m := c.msgs.Get().(*wire.Msg)
	fd, err := cs.conn.Recv(m)
	if err != nil {
		c.msgs.Put(m)
		if errors.Is(err, wire.ErrMalformed) {
			return nil, nil // a bad packet from the node: skip it
		}
		return nil, err
	}
	switch m.Type {
	case wire.TRegionAdded:
		if fd >= 0 {
			select {
			case c.adds <- regionAdd{reg: m.Region, fd: fd, epoch: cs.epoch}:
			default:
				_ = unix.Close(fd)
			}
		}
		c.msgs.Put(m)
		return nil, nil
	case wire.TRegionRetire:
		id := m.Region.ID
		c.msgs.Put(m)
		epoch := cs.epoch
		c.spawn(func() { c.retire(id, epoch) }) // refused: Close retires what is left
		return nil, nil
	case wire.TEvents:
		if f := c.cfg.OnEvents; f != nil {
			f(m.Events)
		}
		c.msgs.Put(m)
		return nil, nil
	}
	if fd >= 0 {
		_ = unix.Close(fd)
	}
	c.mu.Lock()
	w := c.waiters[m.ReqID]
	delete(c.waiters, m.ReqID)
	abandoned := w != nil && w.abandoned
	c.mu.Unlock()
	switch {
	case w == nil:
		c.msgs.Put(m)
	case w == me:
		return m, nil
	case abandoned:
		c.compensate(m, cs.epoch)
	default:
		w.ch <- m
	}
	return nil, nil
}

// readFailed handles a read error with cs.rmu held: a deadline is not a
// failure; anything else is the connection's end.
func (c *Client) readFailed(cs *connState, err error) {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return
	}
	if !cs.dead.Swap(true) {
		c.lost(cs.conn, cs.epoch)
	}
}

// idleReader reads the connection while no call is in flight: pushes
// (regions, retirements, events) and the node's going away.
func (c *Client) idleReader(cs *connState) {
	quiet := time.NewTimer(time.Hour)
	defer quiet.Stop()
	for !cs.dead.Load() {
		// A quiet millisecond first: calls back to back lead themselves.
		// While calls are in flight this polls once a millisecond rather
		// than being woken by each call that ends, which would cost a
		// goroutine wake-up (and, on a busy machine, a thread's) per op.
		a := cs.activity.Load()
		quiet.Reset(time.Millisecond)
		select {
		case <-quiet.C:
		case <-c.stop:
			return
		}
		if cs.inflight.Load() > 0 || cs.activity.Load() != a {
			continue
		}
		cs.rmu.Lock()
		if cs.dead.Load() {
			cs.release()
			return
		}
		_ = cs.conn.UnixConn().SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		cs.idleReading.Store(true)
		_, err := c.readOne(cs, nil)
		cs.idleReading.Store(false)
		if err != nil {
			c.readFailed(cs, err)
		}
		cs.release()
	}
}

// lead reads the connection (cs.rmu held, released on return) until w's
// reply comes, the deadline passes, or the connection ends (w.ch closed).
func (c *Client) lead(cs *connState, w *waiter, deadline time.Time) (*wire.Msg, bool) {
	defer cs.release()
	for {
		select {
		case r, ok := <-w.ch: // delivered before this caller led
			return r, ok
		default:
		}
		if cs.dead.Load() || !time.Now().Before(deadline) {
			return nil, true
		}
		_ = cs.conn.UnixConn().SetReadDeadline(deadline)
		r, err := c.readOne(cs, w)
		if r != nil {
			return r, true
		}
		if err != nil {
			c.readFailed(cs, err) // a deadline (ours, or a stale kick): the loop decides
		}
	}
}

// compensate gives back what a reply nobody waits for any more holds.
func (c *Client) compensate(m *wire.Msg, epoch uint32) {
	var hs []wire.Handle
	var t wire.Type
	switch m.Type {
	case wire.TLookupOK:
		t = wire.TUnlease
	case wire.TBeginStoreOK:
		t = wire.TAbortStore
	case wire.TBeginLoadOK:
		t = wire.TEndLoad
	}
	for _, s := range m.Slots {
		hs = append(hs, s.Handle())
	}
	c.msgs.Put(m)
	if t == 0 || len(hs) == 0 {
		return
	}
	// Refused while Close drains: the node ends them with the connection.
	c.spawn(func() { _, _ = c.callEpoch(&wire.Msg{Type: t, Handles: hs}, wire.TOK, epoch) })
}

// call sends a request on the current connection and waits for its reply
// of type want (an Error reply becomes a Go error). The reply is the
// caller's to put back with c.done.
func (c *Client) call(m *wire.Msg, want wire.Type) (*wire.Msg, error) {
	return c.callEpoch(m, want, 0)
}

// callEpoch is call restricted to connection epoch (0: any).
func (c *Client) callEpoch(m *wire.Msg, want wire.Type, epoch uint32) (*wire.Msg, error) {
	w := c.waitrs.Get().(*waiter)
	w.abandoned = false
	c.mu.Lock()
	if c.closed && m.Type != wire.TBye {
		c.mu.Unlock()
		c.waitrs.Put(w)
		return nil, ErrClientClosed
	}
	conn, cs := c.conn, c.cs
	if conn == nil || (epoch != 0 && epoch != c.epoch) {
		c.mu.Unlock()
		c.waitrs.Put(w)
		return nil, ErrUnavailable
	}
	c.nextReq++
	if c.nextReq == 0 {
		c.nextReq = 1
	}
	m.ReqID = c.nextReq
	w.epoch = c.epoch
	c.waiters[m.ReqID] = w
	c.mu.Unlock()
	if err := conn.Send(m, -1); err != nil {
		c.mu.Lock()
		delete(c.waiters, m.ReqID)
		c.mu.Unlock()
		if errors.Is(err, wire.ErrMalformed) {
			c.waitrs.Put(w)
			return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
		}
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	timeout := time.Duration(c.timeout.Load())
	deadline := time.Now().Add(timeout)
	cs.inflight.Add(1)
	defer func() {
		cs.inflight.Add(-1)
		cs.activity.Add(1)
	}()
	var t *time.Timer
	for {
		var r *wire.Msg
		ok, got := true, false
		select {
		case r, ok = <-w.ch:
			got = true
		default:
		}
		if !got && !time.Now().Before(deadline) {
			goto expired
		}
		if !got && cs.rmu.TryLock() {
			r, ok = c.lead(cs, w, deadline)
			got = r != nil || !ok
		}
		if !got {
			if cs.idleReading.Load() {
				_ = cs.conn.UnixConn().SetReadDeadline(time.Unix(1, 0)) // kick the idle reader off the socket
			}
			if t == nil {
				t = time.NewTimer(time.Until(deadline))
				defer t.Stop()
			}
			select {
			case r, ok = <-w.ch:
				got = true
			case <-cs.free:
				continue // the reader left: lead
			case <-t.C:
			}
		}
		if !got {
			continue
		}
	expired:
		if !got {
			c.mu.Lock()
			if _, pending := c.waiters[m.ReqID]; pending {
				w.abandoned = true
				c.mu.Unlock()
				return nil, fmt.Errorf("%w: no reply to %v in %v", ErrUnavailable, m.Type, timeout)
			}
			c.mu.Unlock()
			// The reply raced the deadline: it is in w.ch, or the
			// connection ended.
			r, ok = <-w.ch
		}
		if !ok {
			return nil, ErrUnavailable // the connection ended; w is dropped
		}
		c.waitrs.Put(w)
		if r.Type == wire.TError {
			err := replyErr(r)
			c.msgs.Put(r)
			return nil, err
		}
		if r.Type != want {
			c.msgs.Put(r)
			return nil, fmt.Errorf("%w: the node answered %v with %v", ErrInvalid, m.Type, r.Type)
		}
		return r, nil
	}
}

func (c *Client) done(m *wire.Msg) { c.msgs.Put(m) }
