package nodepool

import (
	"errors"
	"fmt"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"github.com/kvoffload/kvoffload/kvcache"
)

// Defaults of ServerConfig's limits on what one client may cost the node.
const (
	// DefaultMaxConns caps the node's connections (lowered to what
	// RLIMIT_NOFILE allows).
	DefaultMaxConns = 1024
	// DefaultMaxConnsPerClient caps one client process's connections (at
	// most a quarter of MaxConns).
	DefaultMaxConnsPerClient = 64
	// DefaultHelloTimeout: a connection silent this long after it was
	// accepted is closed.
	DefaultHelloTimeout = 10 * time.Second
	// DefaultClientShare is the fraction of the pool's slots one client
	// process may hold at once.
	DefaultClientShare = 0.5
	// DefaultReserveTimeout: a reservation neither committed nor aborted
	// this long after it was made expires.
	DefaultReserveTimeout = 60 * time.Second
	// fdsPerConn: a connection costs the node its socket and the client's
	// pidfd.
	fdsPerConn = 2
	// fdsSpare: descriptors kept out of the connection cap's reach
	// (regions' memfds are counted apart, the disk tier's files, the
	// listener, a metrics server, the runtime's own).
	fdsSpare = 64
	// maxSlotReads bounds one client's leases, and its loads, of one slot
	// (the 32-bit counts of holding); a request past it is refused.
	maxSlotReads = 1 << 24
	// preHelloRecv is the receive buffer of a connection before its Hello
	// (the largest Hello is a namespace of wire.MaxString bytes and a
	// layout): a connection that never says Hello costs little.
	preHelloRecv = 2*wire.MaxString + 256
)

// errExpired fails a reservation not committed within ReserveTimeout.
var errExpired = errors.New("nodepool: reservation expired (not committed within the node's reserve timeout)")

// limits are the node's bounds on one client, resolved from ServerConfig.
type limits struct {
	maxConns, perClient, perUser int
	hello, reserve               time.Duration
	share                        float64
}

// resolveLimits checks ServerConfig's limits and fills in the defaults;
// regions is the number of memfds the pool keeps open.
func resolveLimits(cfg *ServerConfig, regions int64) (limits, error) {
	l := limits{maxConns: cfg.MaxConns, perClient: cfg.MaxConnsPerClient, perUser: cfg.MaxConnsPerUser, hello: cfg.HelloTimeout,
		reserve: cfg.ReserveTimeout, share: cfg.ClientShare}
	switch {
	case l.maxConns < 0:
		return l, fmt.Errorf("nodepool: MaxConns %d: must not be negative (0: the default)", l.maxConns)
	case l.perClient < 0:
		return l, fmt.Errorf("nodepool: MaxConnsPerClient %d: must not be negative (0: the default)", l.perClient)
	case l.perUser < 0:
		return l, fmt.Errorf("nodepool: MaxConnsPerUser %d: must not be negative (0: MaxConns)", l.perUser)
	case l.hello < 0:
		return l, fmt.Errorf("nodepool: HelloTimeout %v: must not be negative (0: the default)", l.hello)
	case l.reserve < 0:
		return l, fmt.Errorf("nodepool: ReserveTimeout %v: must not be negative (0: the default)", l.reserve)
	case math.IsNaN(l.share) || l.share < 0 || l.share > 1:
		return l, fmt.Errorf("nodepool: ClientShare %v: want a fraction of the pool in (0, 1] (0: the default %v)", l.share, DefaultClientShare)
	}
	if l.maxConns == 0 {
		l.maxConns = DefaultMaxConns
		var r unix.Rlimit
		if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &r); err == nil && r.Cur < math.MaxInt32 {
			l.maxConns = max(1, min(l.maxConns, (int(r.Cur)-fdsSpare-int(min(regions, math.MaxInt32)))/fdsPerConn))
		}
	}
	if l.perClient == 0 {
		// A quarter of the total at most: one process cannot take every
		// connection when RLIMIT_NOFILE makes the total small.
		l.perClient = min(DefaultMaxConnsPerClient, max(1, l.maxConns/4))
	}
	if l.perUser == 0 {
		l.perUser = l.maxConns
	}
	if l.hello == 0 {
		l.hello = DefaultHelloTimeout
	}
	if l.reserve == 0 {
		l.reserve = DefaultReserveTimeout
	}
	if l.share == 0 {
		l.share = DefaultClientShare
	}
	return l, nil
}

// account is one client process's (peer pid) connections and the slots
// its connections hold: its share of the pool is counted across them.
type account struct {
	pid   int32
	uid   uint32
	conns int          // live connections, Server.lim's
	slots atomic.Int64 // slots held (a slot once per connection holding it) or granted to a request
	share int64        // slots it may hold; 0 until the index exists
}

// grant takes up to n slots of the account's share for a request and
// returns how many it got; what the request does not use goes back
// (refund). With no index yet (share 0) nothing is granted.
func (a *account) grant(n int) int {
	for {
		cur := a.slots.Load()
		g := min(int64(n), a.share-cur)
		if g <= 0 {
			return 0
		}
		if a.slots.CompareAndSwap(cur, cur+g) {
			return int(g)
		}
	}
}

func (a *account) refund(n int) {
	if n > 0 {
		a.slots.Add(-int64(n))
	}
}

// accounts is the node's table of client processes, under its own lock
// (the accept loop takes it for every connection).
type accounts struct {
	mu    sync.Mutex
	conns int
	byPid map[int32]*account
	byUid map[uint32]int // connections per user
	share int64          // slots each account may hold, once the index exists
}

// open counts a new connection of a process (pid, of user uid), or says
// which cap it would pass.
func (as *accounts) open(l limits, pid int32, uid uint32) (*account, error) {
	as.mu.Lock()
	defer as.mu.Unlock()
	if as.conns >= l.maxConns {
		return nil, fmt.Errorf("the node has %d connections, at most %d (ServerConfig.MaxConns, serve --max-conns)", as.conns, l.maxConns)
	}
	if n := as.byUid[uid]; n >= l.perUser {
		return nil, fmt.Errorf("uid %d has %d connections to the node, at most %d (ServerConfig.MaxConnsPerUser, serve --max-conns-per-user)", uid, n, l.perUser)
	}
	a := as.byPid[pid]
	if a == nil {
		a = &account{pid: pid, uid: uid, share: as.share}
		as.byPid[pid] = a
	}
	if a.conns >= l.perClient {
		return nil, fmt.Errorf("process %d has %d connections to the node, at most %d (ServerConfig.MaxConnsPerClient, serve --max-conns-per-client)", pid, a.conns, l.perClient)
	}
	a.conns++
	as.conns++
	as.byUid[uid]++
	return a, nil
}

// closed counts a connection's end; the account goes once it has neither
// connections nor slots.
func (as *accounts) closed(a *account) {
	as.mu.Lock()
	defer as.mu.Unlock()
	a.conns--
	as.conns--
	if as.byUid[a.uid]--; as.byUid[a.uid] <= 0 {
		delete(as.byUid, a.uid)
	}
	as.forget(a)
}

// forget drops an account with nothing left. as.mu held.
func (as *accounts) forget(a *account) {
	if a.conns == 0 && a.slots.Load() == 0 && as.byPid[a.pid] == a {
		delete(as.byPid, a.pid)
	}
}

// setShare fixes every account's share once the index knows its slots.
func (as *accounts) setShare(slots int, share float64) {
	as.mu.Lock()
	defer as.mu.Unlock()
	as.share = max(1, int64(math.Ceil(float64(slots)*share)))
	for _, a := range as.byPid {
		a.share = as.share
	}
}

// admit reads the peer's credentials and counts the connection against the
// caps (total, and per client process); a connection past one is told why
// and closed. It reports the connection's account, nil when refused.
func (s *Server) admit(c *net.UnixConn) (*account, unix.Ucred) {
	cred, err := peerUcred(c)
	if err == nil {
		var a *account
		if a, err = s.accts.open(s.lim, cred.Pid, cred.Uid); err == nil {
			return a, cred
		}
		s.counter.refusedCap.Add(1)
	}
	s.counter.refused.Add(1)
	s.logRare(&s.refusedLog, "refused a connection: %v", err)
	conn := wire.NewConnSize(c, 0)
	_ = c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	_ = conn.Send(&wire.Msg{Type: wire.TError, Code: wire.CodeHandshake, Text: err.Error()}, -1)
	_ = c.Close()
	return nil, cred
}

// logRare logs the first of a kind of event and then one in 1024 (a
// hostile client's refusals must not flood the log).
func (s *Server) logRare(n *atomic.Uint64, format string, args ...any) {
	if k := n.Add(1); k == 1 || k%1024 == 0 {
		s.cfg.Logf(format+fmt.Sprintf(" (%d such)", k), args...)
	}
}

// acceptBackoff waits after a failed accept (EMFILE, ENFILE, ENOMEM,
// ECONNABORTED, ...): 5 ms doubling to 1 s, ended by Close. It reports
// whether the node is stopping.
func (s *Server) acceptBackoff(delay *time.Duration, err error) bool {
	s.counter.acceptErrors.Add(1)
	s.logRare(&s.acceptLog, "accept: %v: retrying", err)
	if *delay == 0 {
		*delay = 5 * time.Millisecond
	} else {
		*delay = min(2**delay, time.Second)
	}
	t := time.NewTimer(*delay)
	defer t.Stop()
	select {
	case <-s.stop:
		return true
	case <-t.C:
		return false
	}
}

// expirer ends reservations older than ReserveTimeout, every client's
// (those of clients that left without goodbye included), a few times per
// timeout, until Close.
func (s *Server) expirer() {
	defer s.wg.Done()
	every := min(max(s.lim.reserve/4, 10*time.Millisecond), 5*time.Second)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
			s.expireReservations(time.Now())
		}
	}
}

// expireReservations fails every reservation made before now minus
// ReserveTimeout: the block never becomes ready, the slot is the pool's
// again, and a later CommitStore of it is refused (wire.CodeNotYours).
func (s *Server) expireReservations(now time.Time) {
	s.mu.Lock()
	if s.cache == nil || s.closed {
		s.mu.Unlock()
		return
	}
	c := s.cache
	peers := make([]*peer, 0, len(s.peers))
	for _, p := range s.peers {
		peers = append(peers, p)
	}
	for _, w := range s.waits {
		peers = append(peers, w.peers...)
	}
	s.mu.Unlock()
	cut := now.Add(-s.lim.reserve).UnixNano()
	var slots []kvcache.Slot
	for _, p := range peers {
		p.mu.Lock()
		slots = p.held.expire(cut, slots[:0])
		p.mu.Unlock()
		if len(slots) == 0 {
			continue
		}
		s.counter.expired.Add(uint64(len(slots)))
		s.cfg.Logf("client %d (pid %d): %d reservations expired (not committed within %v)", p.id, p.cred.Pid, len(slots), s.lim.reserve)
		if err := c.CompleteStore(slots, errExpired); err != nil {
			s.cfg.Logf("client %d: expiring its reservations: %v", p.id, err)
		}
	}
	s.reap()
}

// fitLeases returns how many of the leases a Lookup just took (p.slots,
// the hits' prefix) the client may keep: the slots it does not hold yet
// within its share (granted into p.grant, which settle uses and refunds),
// and no slot past maxSlotReads of its leases. p.mu held.
func (p *peer) fitLeases() int {
	need := 0
	for i := range p.slots {
		if p.held.peek(uint32(p.slots[i].ID)) == nil {
			need++
		}
	}
	p.grant = 0
	if need > 0 {
		p.grant = p.acct.grant(need)
	}
	left := p.grant
	for i := range p.slots {
		e := p.held.peek(uint32(p.slots[i].ID))
		switch {
		case e == nil && left == 0:
			p.s.counter.overShare.Add(1)
			return i
		case e == nil:
			left--
		case int(e.leases)+len(p.slots) > maxSlotReads:
			p.s.counter.overShare.Add(1)
			return i
		}
	}
	return len(p.slots)
}
