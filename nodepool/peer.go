package nodepool

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/nodepool/wire"
	"golang.org/x/sys/unix"
)

// peer is one connected client. Its bookkeeping (held: reservations,
// leases, loads) is its serving goroutine's and its promoter's, under mu,
// and after both end release's; regions and subscribed are guarded by
// Server.mu.
type peer struct {
	s     *Server
	id    uint32
	conn  *wire.Conn
	cred  unix.Ucred
	pidfd int
	ns    *nsRec
	acct  *account // the client process's: connections and share

	helloed atomic.Bool // Hello done: the hello timer leaves it be
	// grant is what a leasing Lookup was granted of the account's share
	// for the slots settle records (the rest refunded there).
	grant int

	mu   sync.Mutex // held, between the serving goroutine and the promoter
	held holdings

	// promoq feeds the promoter (Promote requests, served in the
	// background: promoter); nil until the first. promoting ends with it.
	promoq    chan promoteReq
	promoting sync.WaitGroup

	regions    map[uint32]bool // announced and not acknowledged retired
	subscribed bool

	pushq    chan push
	done     chan struct{}
	doneOnce sync.Once
	bye      bool

	in, out   wire.Msg
	unsettled bool // p.slots holds leases to record once the reply is sent
	slots     []kvcache.Slot
	storeRes  []kvcache.StoreResult
	loadRes   []kvcache.LoadResult
}

type push struct {
	m  *wire.Msg
	fd int
}

// blockIDs are the block ids the node gives kvcache: a request's keys are
// numbered by position (the node knows no GPU).
var blockIDs = func() []int {
	ids := make([]int, wire.MaxKeys)
	for i := range ids {
		ids[i] = i
	}
	return ids
}()

// errPeerGone fails the stores of a client that exited without committing.
var errPeerGone = errors.New("nodepool: client exited before committing")

func (p *peer) disconnect() {
	p.doneOnce.Do(func() {
		close(p.done)
		_ = p.conn.Close()
	})
}

// push queues a message for the client's writer; a client that lets
// DefaultPushQueue pushes pile up is disconnected.
func (p *peer) push(m *wire.Msg, fd int) {
	select {
	case p.pushq <- push{m, fd}:
	case <-p.done:
	default:
		p.s.counter.peersDropped.Add(1)
		p.s.cfg.Logf("client %d (pid %d) does not read its pushes: disconnected", p.id, p.cred.Pid)
		p.disconnect()
	}
}

func (p *peer) writer() {
	for {
		select {
		case <-p.done:
			return
		case x := <-p.pushq:
			if err := p.conn.Send(x.m, x.fd); err != nil {
				p.disconnect()
				return
			}
		}
	}
}

// peerUcred reads SO_PEERCRED (no descriptor opened: the accept loop
// checks the connection caps with it first).
func peerUcred(c *net.UnixConn) (unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return unix.Ucred{}, err
	}
	var cred *unix.Ucred
	var cerr error
	err = rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		return unix.Ucred{}, fmt.Errorf("SO_PEERCRED: %w", err)
	}
	return *cred, nil
}

// peerPidfd opens a pidfd for the peer: from SO_PEERPIDFD where the kernel
// has it (6.5+: the pidfd of the very process that connected), else
// pidfd_open of the SO_PEERCRED pid.
func peerPidfd(c *net.UnixConn, cred unix.Ucred) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	pidfd := -1
	_ = rc.Control(func(fd uintptr) {
		if v, e := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PEERPIDFD); e == nil && v >= 0 {
			pidfd = v
			unix.CloseOnExec(v)
		}
	})
	if pidfd < 0 {
		if pidfd, err = unix.PidfdOpen(int(cred.Pid), 0); err != nil {
			return -1, fmt.Errorf("pidfd_open(%d): %w", cred.Pid, err)
		}
	}
	return pidfd, nil
}

// admitted: the node's uid, root, or (with Group) a member of the group
// (primary or supplementary, from /proc/PID/status).
func (s *Server) admitted(cred unix.Ucred) bool {
	if int(cred.Uid) == os.Getuid() || cred.Uid == 0 {
		return true
	}
	if s.gid < 0 {
		return false
	}
	if int(cred.Gid) == s.gid {
		return true
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(int(cred.Pid)) + "/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if g, ok := strings.CutPrefix(line, "Groups:"); ok {
			for _, f := range strings.Fields(g) {
				if f == strconv.Itoa(s.gid) {
					return true
				}
			}
		}
	}
	return false
}

// servePeer serves one admitted connection (Serve counted it against the
// caps, in account a). Until its Hello it costs a small receive buffer and
// this goroutine, and it has HelloTimeout to say Hello.
func (s *Server) servePeer(c *net.UnixConn, a *account, cred unix.Ucred) {
	conn := wire.NewConnSize(c, preHelloRecv)
	pidfd := -1
	var err error
	if !s.admitted(cred) {
		err = fmt.Errorf("uid %d gid %d is not admitted to this node", cred.Uid, cred.Gid)
	} else {
		pidfd, err = peerPidfd(c, cred)
	}
	if err != nil {
		s.counter.refused.Add(1)
		s.logRare(&s.refusedLog, "refused a connection: %v", err)
		_ = conn.Send(&wire.Msg{Type: wire.TError, Code: wire.CodeHandshake, Text: err.Error()}, -1)
		_ = conn.Close()
		return
	}
	s.counter.accepted.Add(1)
	p := &peer{s: s, conn: conn, cred: cred, pidfd: pidfd, acct: a, regions: map[uint32]bool{}, done: make(chan struct{})}
	p.held.acct = a
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = unix.Close(pidfd)
		_ = conn.Close()
		return
	}
	s.unhelloed[p] = true
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.unhelloed, p)
		s.mu.Unlock()
	}()
	timer := time.AfterFunc(s.lim.hello, func() {
		if !p.helloed.Load() {
			s.counter.helloTimeouts.Add(1)
			s.logRare(&s.helloLog, "pid %d said no Hello within %v: connection closed", cred.Pid, s.lim.hello)
			p.disconnect()
		}
	})
	registered := p.serve()
	timer.Stop()
	p.disconnect()
	p.stopPromoter()
	if !registered {
		_ = unix.Close(pidfd)
		return
	}
	if p.bye {
		s.release(p)
		s.counter.releasedOnBye.Add(1)
		return
	}
	// The client may still be running, its copies in flight: its
	// reservations and leases are released only once it has exited.
	s.waitExit(p)
}

// exitWait is the wait for one client process's exit, shared by every
// connection of that process that ended without goodbye.
type exitWait struct {
	f     *os.File // the first such connection's pidfd
	peers []*peer
}

// exited reports whether a pidfd is readable: its process has exited.
func exited(fd int) bool {
	n, _ := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 0)
	return n > 0
}

// waitExit waits for the client's process to exit (its pidfd turns
// readable once the process has exited: its memory and files, GPU
// contexts among them, are gone), then releases what it held. The wait
// parks on the runtime's poller (the pidfd is pollable), not on a thread,
// and one wait serves every dropped connection of a process: a connection
// joins the wait of its pid only while that wait's pidfd is not readable,
// that is while the process that owned the pid is alive, so it is the
// same process (a pid is not reused while its process lives).
func (s *Server) waitExit(p *peer) {
	pid := p.cred.Pid
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = unix.Close(p.pidfd)
		return // the index is closing: nothing to release into
	}
	if w := s.waits[pid]; w != nil && !exited(int(w.f.Fd())) {
		w.peers = append(w.peers, p)
		s.mu.Unlock()
		_ = unix.Close(p.pidfd)
		p.pidfd = -1
		return
	}
	if err := unix.SetNonblock(p.pidfd, true); err != nil {
		s.mu.Unlock()
		s.cfg.Logf("client %d (pid %d): pidfd: %v; its holdings stay until the node stops", p.id, pid, err)
		_ = unix.Close(p.pidfd)
		return
	}
	w := &exitWait{f: os.NewFile(uintptr(p.pidfd), "pidfd"), peers: []*peer{p}}
	p.pidfd = -1
	s.waits[pid] = w // a stale wait of an earlier process with this pid keeps running on its own
	s.mu.Unlock()
	done := false
	rc, err := w.f.SyscallConn()
	if err == nil {
		err = rc.Read(func(fd uintptr) bool {
			done = exited(int(fd))
			return done
		})
	}
	s.mu.Lock()
	if s.waits[pid] == w {
		delete(s.waits, pid)
	}
	peers := w.peers
	s.mu.Unlock()
	_ = w.f.Close()
	if !done {
		select {
		case <-s.stop: // Close closed the pidfd
		default:
			s.cfg.Logf("pid %d: waiting for its exit: %v; what its clients hold stays until the node stops", pid, err)
		}
		return
	}
	for _, q := range peers {
		s.cfg.Logf("client %d (pid %d) exited: releasing %d reservations, %d leases, %d loads",
			q.id, pid, q.held.reserved, q.held.leases, q.held.loads)
		s.release(q)
		s.counter.releasedOnExit.Add(1)
	}
}

// release gives back everything p held: its reservations fail (their
// blocks never become ready), its leases and loads end, and its regions
// count as unmapped.
func (s *Server) release(p *peer) {
	if p.pidfd >= 0 {
		_ = unix.Close(p.pidfd)
	}
	s.mu.Lock()
	c := s.cache
	delete(s.peers, p.id)
	if p.subscribed {
		p.subscribed = false
		s.subscribers.Add(-1)
	}
	for id := range p.regions {
		s.acked(p, id)
	}
	s.mu.Unlock()
	p.mu.Lock()
	reserved, reads := p.held.drain()
	p.mu.Unlock()
	if c != nil {
		if len(reserved) > 0 {
			_ = c.CompleteStore(reserved, errPeerGone)
		}
		if len(reads) > 0 {
			if err := c.EndReads(reads); err != nil {
				s.counter.internal.Add(1)
				s.cfg.Logf("client %d: releasing its leases and loads: %v", p.id, err)
			}
		}
	}
	if p.acct != nil {
		s.accts.mu.Lock()
		s.accts.forget(p.acct)
		s.accts.mu.Unlock()
	}
	s.reap()
}

// serve reads requests until the connection ends; it reports whether the
// client completed the handshake (and so may hold anything).
func (p *peer) serve() (registered bool) {
	for {
		fd, err := p.conn.Recv(&p.in)
		if fd >= 0 {
			_ = unix.Close(fd)
			err = fmt.Errorf("%w: a client sent a file descriptor", wire.ErrMalformed)
		}
		if err != nil {
			if !errors.Is(err, wire.ErrMalformed) {
				return registered
			}
			p.s.counter.malformed.Add(1)
			p.s.cfg.Logf("client %d (pid %d): %v", p.id, p.cred.Pid, err)
			if p.reply(&wire.Msg{Type: wire.TError, ReqID: p.in.ReqID, Code: wire.CodeMalformed, Text: err.Error()}) != nil {
				return registered
			}
			continue
		}
		m := &p.in
		if m.ReqID == 0 {
			p.s.counter.malformed.Add(1)
			if p.reply(errMsg(0, wire.CodeMalformed, "%v with request id 0 (reserved for pushes)", m.Type)) != nil {
				return registered
			}
			continue
		}
		if !registered {
			if m.Type != wire.THello {
				_ = p.reply(&wire.Msg{Type: wire.TError, ReqID: m.ReqID, Code: wire.CodeHandshake,
					Text: fmt.Sprintf("%v before Hello: the first message must be Hello", m.Type)})
				return false
			}
			if !p.hello(m) {
				return false
			}
			registered = true
			continue
		}
		if m.Type == wire.TPromote && p.s.disk != nil {
			// Not under mu: the promoter takes it to record its loads.
			p.queuePromote(m)
			continue // the promoter replies
		}
		p.mu.Lock()
		out := p.handle(m)
		p.mu.Unlock()
		if out == nil {
			continue
		}
		err = p.reply(out)
		p.settle() // whether or not the reply went out: what is held is recorded
		if err != nil || p.bye {
			return registered
		}
	}
}

func (p *peer) reply(m *wire.Msg) error {
	if h := p.s.beforeReply.Load(); h != nil {
		(*h)(m)
	}
	return p.conn.Send(m, -1)
}

func errMsg(req uint32, code uint16, format string, args ...any) *wire.Msg {
	return &wire.Msg{Type: wire.TError, ReqID: req, Code: code, Text: fmt.Sprintf(format, args...)}
}

// hello checks the version and the namespace's layout, creates the index
// with the first layout, and queues HelloOK and the region announcements.
func (p *peer) hello(m *wire.Msg) bool {
	s := p.s
	if m.Version != wire.Version {
		_ = p.reply(errMsg(m.ReqID, wire.CodeVersion,
			"the client speaks protocol version %d, this node speaks version %d: use a client and node of one release", m.Version, wire.Version))
		return false
	}
	g := kvcache.Geometry{Layers: int(m.Layout.Layers), KVHeads: int(m.Layout.KVHeads), HeadDim: int(m.Layout.HeadDim),
		DTypeBytes: int(m.Layout.DTypeBytes), TokensPerBlock: int(m.Layout.TokensPerBlock)}
	layout, err := kvcache.NewLayout(kvcache.DenseSpec(kvcache.LayoutKind(m.Layout.Kind), g, wire.MaxKeys, 1<<44))
	if err != nil {
		_ = p.reply(errMsg(m.ReqID, wire.CodeLayout, "layout %+v: %v", m.Layout, err))
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		_ = p.reply(errMsg(m.ReqID, wire.CodeClosed, "the node is stopping"))
		return false
	}
	ns := s.namespaces[m.Namespace]
	if ns != nil && ns.layout != m.Layout {
		_ = p.reply(errMsg(m.ReqID, wire.CodeLayout, "namespace %q is served with layout %+v; the client's is %+v",
			m.Namespace, ns.layout, m.Layout))
		return false
	}
	if s.cache == nil {
		if err := s.newCache(layout); err != nil {
			_ = p.reply(errMsg(m.ReqID, wire.CodeInternal, "%v", err))
			return false
		}
	} else if layout.SlotSize() != s.slotSize {
		_ = p.reply(errMsg(m.ReqID, wire.CodeLayout, "layout %+v has %d-byte slots; this node's pool is carved in %d-byte slots (one slot size per node)",
			m.Layout, layout.SlotSize(), s.slotSize))
		return false
	}
	if ns == nil {
		ns = &nsRec{id: uint32(len(s.namespaces) + 1), layout: m.Layout}
		s.namespaces[m.Namespace] = ns
	}
	p.ns = ns
	s.nextPeer++
	p.id = s.nextPeer
	s.peers[p.id] = p
	delete(s.unhelloed, p)
	p.helloed.Store(true)
	p.conn.SetRecvSize()
	p.pushq = make(chan push, DefaultPushQueue)
	go p.writer()
	var active []*regionRec
	for _, rr := range s.regions {
		if rr.state == regionActive {
			active = append(active, rr)
		}
	}
	sortRegions(active)
	p.push(&wire.Msg{Type: wire.THelloOK, ReqID: m.ReqID, Version: wire.Version, ClientID: p.id, NamespaceID: ns.id,
		SlotSize: s.slotSize, Regions: uint32(len(active)), Text: s.pageMode}, -1)
	for _, rr := range active {
		p.regions[rr.id] = true
		p.push(&wire.Msg{Type: wire.TRegionAdded, Region: wire.Region{ID: rr.id, Size: uint64(rr.r.Len())}}, rr.r.Fd())
	}
	s.cfg.Logf("client %d connected: pid %d uid %d, namespace %q", p.id, p.cred.Pid, p.cred.Uid, m.Namespace)
	return true
}

func sortRegions(rs []*regionRec) {
	for i := 1; i < len(rs); i++ {
		for j := i; j > 0 && rs[j].id < rs[j-1].id; j-- {
			rs[j], rs[j-1] = rs[j-1], rs[j]
		}
	}
}

// newCache creates the index with the first client's layout and hands it
// every region. s.mu held.
func (s *Server) newCache(layout *kvcache.Layout) error {
	var pol kvcache.Policy
	slots := 0
	for _, rr := range s.regions {
		slots += int(uint64(rr.r.Len()) / layout.SlotSize())
	}
	if s.cfg.Policy == "tinylfu" {
		t, err := kvcache.NewTinyLFU(kvcache.TinyLFUConfig{MaxBlocks: max(slots, 1)})
		if err != nil {
			return err
		}
		pol = t
	}
	// The disk tier opens first: its Demote and OnDemote are the cache's.
	var d *nodeDisk
	if s.cfg.Disk != nil {
		var err error
		if d, err = s.openDisk(layout, layout.Kind()); err != nil {
			s.diskErr = err.Error()
			s.cfg.Logf("%v: serving without the disk tier", err)
		}
	}
	kcfg := kvcache.Config{Layout: layout, Policy: pol, LowWatermark: s.cfg.LowWatermark,
		OnIndex: s.onIndex, MaxSlots: min(slots, kvcache.MaxSlots)}
	switch {
	case kcfg.LowWatermark < 0:
		kcfg.LowWatermark = 0
	case kcfg.LowWatermark == 0 && s.cfg.Disk != nil:
		// The embedded engine's: evictions run ahead of stores, so that
		// the blocks written back go from their demoting slots, not
		// copied out under the cache's lock.
		kcfg.LowWatermark = min(slots/64, 64)
	}
	if d != nil {
		kcfg.Demote, kcfg.OnDemote = d.demote, d.wb.OnDemote
	}
	c, err := kvcache.New(kcfg)
	if err != nil {
		if d != nil {
			_ = d.store.Close()
		}
		return err
	}
	ids := make([]*regionRec, 0, len(s.regions))
	for _, rr := range s.regions {
		ids = append(ids, rr)
	}
	sortRegions(ids)
	// Highest id first: the free list hands out the slots of the region
	// added last first, and clients map regions in id order, so the
	// first region (mapped inside Dial) serves the first stores.
	for i := len(ids) - 1; i >= 0; i-- {
		rr := ids[i]
		if _, err := c.AddRegion(kvcache.Region{ID: kvcache.RegionID(rr.id), Base: rr.r.Addr(), Size: uint64(rr.r.Len())}); err != nil {
			c.Close()
			if d != nil {
				_ = d.store.Close()
			}
			return fmt.Errorf("nodepool: region %d: %w", rr.id, err)
		}
	}
	s.cache, s.slotSize = c, layout.SlotSize()
	s.accts.setShare(min(slots, kvcache.MaxSlots), s.lim.share)
	if d != nil {
		d.start(c)
		s.disk = d
	}
	return nil
}

// onIndex runs under the cache's lock: it only copies the event out, and
// drops it (counted) when the fan-out is behind.
func (s *Server) onIndex(e kvcache.IndexEvent) {
	if e.Ready && s.disk != nil {
		s.disk.onReady(e.Key)
	}
	if s.subscribers.Load() == 0 {
		return
	}
	k := wire.EventRemoved
	if e.Ready {
		k = wire.EventStored
	}
	select {
	case s.events <- wire.Event{Kind: k, NS: uint32(e.Namespace), Key: e.Key}:
	default:
		s.counter.eventsDropped.Add(1)
	}
}

func (s *Server) fanOutEvents() {
	batch := make([]wire.Event, 0, wire.MaxKeys)
	for {
		select {
		case <-s.stop:
			return
		case e := <-s.events:
			batch = append(batch[:0], e)
		more:
			for len(batch) < wire.MaxKeys {
				select {
				case e := <-s.events:
					batch = append(batch, e)
				default:
					break more
				}
			}
			if f := s.cfg.OnEvents; f != nil {
				f(batch)
			}
			s.mu.Lock()
			for _, p := range s.peers {
				if p.subscribed {
					p.push(&wire.Msg{Type: wire.TEvents, Events: append([]wire.Event(nil), batch...)}, -1)
				}
			}
			s.mu.Unlock()
		}
	}
}

func toWire(sl kvcache.Slot) wire.Slot {
	return wire.Slot{ID: uint32(sl.ID), Gen: sl.Gen, Region: uint32(sl.Region), Off: sl.Off}
}

// putWire is toWire in place, for the 1024-slot loop of a leasing Lookup
// (a struct returned by value and appended is copied through the stack).
func putWire(d *wire.Slot, sl *kvcache.Slot) {
	d.ID, d.Gen, d.Region, d.Off = uint32(sl.ID), sl.Gen, uint32(sl.Region), sl.Off
}

// handle serves one request and returns its reply.
func (p *peer) handle(m *wire.Msg) *wire.Msg {
	s := p.s
	c := s.cache // set before any peer registers, never changed
	o := &p.out
	o.Reset()
	o.ReqID = m.ReqID
	o.Type = wire.TOK
	ns := kvcache.Namespace(p.ns.id)
	switch m.Type {
	case wire.TLookup:
		o.Type = wire.TLookupOK
		if m.Flags&wire.FlagLease == 0 {
			o.N = uint64(c.Lookup(m.Keys))
			if s.disk != nil {
				s.disk.saw(m.Keys)
				o.Lower = uint32(s.disk.diskPrefix(m.Keys[o.N:]))
				s.disk.lookupHits.Add(int64(o.Lower))
			}
			return o
		}
		var n int
		// The policy hears of the hits after the reply is sent (settle):
		// the LRU's moves are off the round trip.
		n, p.slots = c.LookupLeaseDeferred(m.Keys, p.slots[:0])
		if k := p.fitLeases(); k < n {
			// Past the client's share (or a slot's lease count): a
			// shorter prefix is leased.
			if err := c.Unlease(p.slots[k:]); err != nil {
				p.s.counter.internal.Add(1)
			}
			p.slots, n = p.slots[:k], k
		}
		o.N = uint64(n)
		if s.disk != nil {
			s.disk.saw(m.Keys)
			o.Lower = uint32(s.disk.diskPrefix(m.Keys[n:]))
			s.disk.lookupHits.Add(int64(o.Lower))
		}
		o.Slots = slices.Grow(o.Slots, len(p.slots))[:len(p.slots)]
		for i := range p.slots {
			putWire(&o.Slots[i], &p.slots[i])
		}
		// Recorded after the reply is sent (settle): the client cannot
		// give them back before it has the reply, and this goroutine
		// reads its next request only after settling.
		p.unsettled = true
	case wire.TUnlease, wire.TEndLoad:
		load := m.Type == wire.TEndLoad
		p.slots = p.slots[:0]
		for i, h := range m.Handles {
			e := p.held.get(h)
			if e == nil || (load && e.loads == 0) || (!load && e.leases == 0) {
				p.restore(m.Handles[:i], load)
				return errMsg(m.ReqID, wire.CodeNotYours, "%v of slot %d gen %d: this client holds no (more) %s on it",
					m.Type, h.ID, h.Gen, map[bool]string{true: "load", false: "lease"}[load])
			}
			if load {
				p.held.dropLoad(e)
			} else {
				p.held.dropLease(e)
			}
			p.slots = appendSlotOf(p.slots, h)
		}
		var err error
		if load {
			err = c.EndLoad(p.slots)
		} else {
			err = c.Unlease(p.slots)
		}
		if err != nil {
			return errMsg(m.ReqID, wire.CodeInternal, "%v: %v", m.Type, err)
		}
		o.N = uint64(len(m.Handles))
		s.reap()
	case wire.TBeginStore:
		return p.beginStore(m, ns)
	case wire.TCommitStore, wire.TAbortStore:
		p.slots = p.slots[:0]
		for i, h := range m.Handles {
			e := p.held.get(h)
			if e == nil || !e.reserved {
				now := time.Now().UnixNano()
				for k, g := range m.Handles[:i] {
					e, _ := p.held.take(g.ID, g.Gen)
					p.held.reserve(e, p.slots[k].Heads, now, nil)
				}
				return errMsg(m.ReqID, wire.CodeNotYours, "%v of slot %d gen %d: this client holds no reservation on it (given twice, another's, or expired after %v)",
					m.Type, h.ID, h.Gen, p.s.lim.reserve)
			}
			p.slots = appendSlotOf(p.slots, h)
			p.slots[len(p.slots)-1].Heads = p.held.unreserve(e)
		}
		var cerr error
		if m.Type == wire.TAbortStore {
			cerr = errAborted
		}
		if err := c.CompleteStore(p.slots, cerr); err != nil {
			return errMsg(m.ReqID, wire.CodeInternal, "%v: %v", m.Type, err)
		}
		o.N = uint64(len(m.Handles))
		s.reap()
	case wire.TBeginLoad:
		var err error
		p.loadRes, err = c.BeginLoad(m.Keys, blockIDs[:len(m.Keys)], p.loadRes[:0])
		if err != nil {
			return errMsg(m.ReqID, wire.CodeInvalid, "BeginLoad: %v", err)
		}
		var onDisk func(j int) bool
		switch {
		case s.disk == nil:
		case m.Flags&wire.FlagDiskLater != 0:
			// Not promoted here: the client asks for them in chunks
			// (Promote), copying each while the next is read.
			onDisk = func(j int) bool { return s.disk.has(m.Keys[j]) }
		default:
			s.promoteMissing(ns, m.Keys, chainParent(m.Keys), p.loadRes)
		}
		return p.loadReply(o, p.loadRes, onDisk)
	case wire.TPromote:
		// Without a disk tier (with one, serve hands it to the promoter):
		// nothing to read, a BeginLoad answered at once.
		var err error
		p.loadRes, err = c.BeginLoad(m.Keys, blockIDs[:len(m.Keys)], p.loadRes[:0])
		if err != nil {
			return errMsg(m.ReqID, wire.CodeInvalid, "Promote: %v", err)
		}
		return p.loadReply(o, p.loadRes, nil)
	default:
		return p.handleRare(m, o, ns)
	}
	return o
}

// loadReply records a load on each found result of res (this client's
// BeginLoad of o's request) and fills o, BeginLoadOK: found, or
// OutcomeOnDisk where onDisk (nil: none) says the node's disk holds a key
// not found, or missing. p.mu held.
func (p *peer) loadReply(o *wire.Msg, res []kvcache.LoadResult, onDisk func(j int) bool) *wire.Msg {
	o.Type = wire.TBeginLoadOK
	need := 0
	for _, r := range res {
		if r.Found && p.held.peek(uint32(r.Slot.ID)) == nil {
			need++
		}
	}
	grant := 0
	if need > 0 {
		grant = p.acct.grant(need)
	}
	var over []kvcache.Slot
	defer func() {
		p.acct.refund(grant)
		if len(over) > 0 {
			// Past the client's share, or a slot's load count: missing.
			p.s.counter.overShare.Add(1)
			if err := p.s.cache.EndLoad(over); err != nil {
				p.s.counter.internal.Add(1)
			}
		}
	}()
	for j, r := range res {
		if r.Found {
			if e := p.held.peek(uint32(r.Slot.ID)); (e == nil && grant == 0) || (e != nil && e.loads >= maxSlotReads) {
				over = append(over, r.Slot)
				res[j].Found = false
				r.Found = false
			}
		}
		if !r.Found {
			if onDisk != nil && onDisk(j) {
				o.Outcomes = append(o.Outcomes, wire.OutcomeOnDisk)
			} else {
				o.Outcomes = append(o.Outcomes, wire.OutcomeMissing)
			}
			continue
		}
		e, ok := p.held.take(uint32(r.Slot.ID), r.Slot.Gen)
		if !ok {
			// The index never reoccupies a slot this client holds: if it
			// ever did, the client gets an error and this request holds
			// nothing (the loads recorded so far undone, every load it
			// began ended).
			p.s.counter.internal.Add(1)
			p.endLoads(res, j)
			return errMsg(o.ReqID, wire.CodeInternal, "slot %d loaded in generation %d while this client holds generation %d", r.Slot.ID, r.Slot.Gen, e.gen)
		}
		p.held.addLoad(e, &grant)
		o.Outcomes = append(o.Outcomes, wire.OutcomeFound)
		o.Slots = append(o.Slots, toWire(r.Slot))
	}
	return o
}

// endLoads (mu held) gives back the loads of a load reply that failed at
// result j: those of res[:j] recorded in held are taken out again, and
// every found result's load is ended in the cache.
func (p *peer) endLoads(res []kvcache.LoadResult, j int) {
	var slots []kvcache.Slot
	for i, r := range res {
		if !r.Found {
			continue
		}
		if i < j {
			e, _ := p.held.take(uint32(r.Slot.ID), r.Slot.Gen)
			p.held.dropLoad(e)
		}
		slots = append(slots, r.Slot)
	}
	if err := p.s.cache.EndLoad(slots); err != nil {
		p.s.cfg.Logf("client %d: ending the loads of a failed reply: %v", p.id, err)
	}
}

// chainParent is the parents of keys that form one chain (key j's parent
// key j-1, the first's none): what the promotions of a BeginLoad without
// FlagDiskLater reserve with.
func chainParent(keys []kvcache.Key) func(j int) kvcache.Key {
	return func(j int) kvcache.Key {
		if j == 0 {
			return kvcache.Key{}
		}
		return keys[j-1]
	}
}

// promoteReq is a Promote request for the promoter (its keys copied out
// of the serving goroutine's message).
type promoteReq struct {
	reqID         uint32
	keys, parents []kvcache.Key
}

// promoteQueue bounds the Promote requests of one client waiting for its
// promoter (their keys are held meanwhile); beyond it the serving
// goroutine waits until the promoter takes one, and the client's requests
// behind it wait with it (a chunk's reads at most). The embedded engine
// asks one chunk ahead per Load, so only more than two Loads promoting at
// once through one client reach it.
const promoteQueue = 4

// queuePromote hands a Promote request to the client's promoter, started
// on the first (the serving goroutine, not under mu).
func (p *peer) queuePromote(m *wire.Msg) {
	if p.promoq == nil {
		p.promoq = make(chan promoteReq, promoteQueue)
		p.promoting.Add(1)
		go p.promoter()
	}
	r := promoteReq{reqID: m.ReqID, keys: slices.Clone(m.Keys), parents: slices.Clone(m.Parents)}
	select {
	case p.promoq <- r:
	case <-p.done:
	}
}

// promoter serves a client's Promote requests in order, in the
// background: the disk reads of one do not hold up the client's other
// requests (its EndLoads of the chunk before, its lookups), and the next
// request's reads start as soon as the last ones end. Each promotes the
// keys the pool lacks and the disk holds (Server.promoteMissing, key j's
// parent parents[j]), records the loads of the keys then found under mu,
// and replies BeginLoadOK. After the client disconnected it takes no
// further request; the one in progress finishes its reads and records its
// loads, which release gives back (servePeer waits for the promoter
// first).
func (p *peer) promoter() {
	defer p.promoting.Done()
	s := p.s
	ns := kvcache.Namespace(p.ns.id)
	var o wire.Msg
	var res []kvcache.LoadResult
	for r := range p.promoq {
		select {
		case <-p.done:
			continue
		default:
		}
		o.Reset()
		o.ReqID = r.reqID
		var err error
		res, err = s.cache.BeginLoad(r.keys, blockIDs[:len(r.keys)], res[:0])
		out := &o
		if err != nil {
			out = errMsg(r.reqID, wire.CodeInvalid, "Promote: %v", err)
		} else {
			s.promoteMissing(ns, r.keys, func(j int) kvcache.Key { return r.parents[j] }, res)
			p.mu.Lock()
			out = p.loadReply(&o, res, nil)
			p.mu.Unlock()
		}
		clear(res) // no slot handles kept
		if p.reply(out) != nil {
			p.disconnect()
		}
	}
}

// stopPromoter ends the promoter once the serving goroutine has ended and
// waits for it: what it holds is then in held.
func (p *peer) stopPromoter() {
	if p.promoq != nil {
		close(p.promoq)
	}
	p.promoting.Wait()
}

// handleRare serves the requests that are not on a serving stack's hot
// path (kept out of handle, whose cases run for every op).
func (p *peer) handleRare(m *wire.Msg, o *wire.Msg, ns kvcache.Namespace) *wire.Msg {
	s := p.s
	c := s.cache
	switch m.Type {
	case wire.TDelete:
		o.N = uint64(c.Delete(m.Keys))
		if s.disk != nil {
			s.disk.delete(m.Keys)
		}
		s.reap()
	case wire.TClear:
		o.N = uint64(c.Clear(ns))
		if s.disk != nil {
			s.disk.clear()
		}
		s.reap()
	case wire.TStats:
		b, err := json.Marshal(s.Stats())
		if err != nil {
			return errMsg(m.ReqID, wire.CodeInternal, "stats: %v", err)
		}
		o.Type, o.JSON = wire.TStatsOK, b
	case wire.TTrim:
		res, err := s.Trim(int64(min(m.N, 1<<62)))
		if err != nil {
			return errMsg(m.ReqID, wire.CodeClosed, "%v", err)
		}
		b, _ := json.Marshal(res)
		o.Type, o.JSON = wire.TTrimOK, b
	case wire.TRetireAck:
		s.mu.Lock()
		rr := s.regions[m.Region.ID]
		ok := p.regions[m.Region.ID] && rr != nil && rr.state == regionRetiring
		if ok {
			s.acked(p, m.Region.ID)
		}
		s.mu.Unlock()
		if !ok {
			return errMsg(m.ReqID, wire.CodeNotYours, "RetireAck of region %d: not a region this client was told to unmap", m.Region.ID)
		}
	case wire.TSubscribe:
		s.mu.Lock()
		if !p.subscribed {
			p.subscribed = true
			s.subscribers.Add(1)
		}
		s.mu.Unlock()
	case wire.TBye:
		p.bye = true
	case wire.THello:
		return errMsg(m.ReqID, wire.CodeHandshake, "Hello twice")
	default:
		return errMsg(m.ReqID, wire.CodeMalformed, "%v is not a request", m.Type)
	}
	return o
}

var errAborted = errors.New("nodepool: store aborted by its client")

// settle records the leases a Lookup took, after its reply was sent.
func (p *peer) settle() {
	if !p.unsettled {
		return
	}
	p.unsettled = false
	p.s.cache.Accessed(p.slots)
	p.mu.Lock()
	defer p.mu.Unlock()
	defer func() {
		p.acct.refund(p.grant)
		p.grant = 0
	}()
	for _, sl := range p.slots {
		e, ok := p.held.take(uint32(sl.ID), sl.Gen)
		if !ok {
			// The index never reoccupies a slot this client holds: if it
			// ever did, keep the lease unrecorded (released with the
			// index) rather than mix two generations.
			p.s.counter.internal.Add(1)
			p.s.cfg.Logf("client %d: slot %d leased in generation %d while it holds generation %d", p.id, sl.ID, sl.Gen, e.gen)
			continue
		}
		p.held.addLease(e, &p.grant)
	}
}

// restore gives back the counts taken for handles before a failing one.
func (p *peer) restore(hs []wire.Handle, load bool) {
	for _, h := range hs {
		e, _ := p.held.take(h.ID, h.Gen)
		if load {
			p.held.addLoad(e, nil)
		} else {
			p.held.addLease(e, nil)
		}
	}
}

// beginStore reserves slots for the keys: maximal runs of keys that chain
// (parent of key i is key i-1) go to kvcache as one StoreRequest each.
func (p *peer) beginStore(m *wire.Msg, ns kvcache.Namespace) *wire.Msg {
	c := p.s.cache
	kvHeads := uint16(p.ns.layout.KVHeads)
	// Head ranges: a reservation covers heads [HeadLo, HeadHi) of each
	// block ([0, 0) or [0, KVHeads): the whole block). kvcache keeps the
	// per-range state: a second client's range of a block being written
	// is a write into the same slot, not "present"; the block becomes
	// ready when every head is committed, and one still missing heads
	// after the cache's PartialTimeout (a rank died) is reclaimed. A client
	// holds one range per block (a tensor-parallel rank writes its heads).
	var heads kvcache.HeadRange
	if !(m.HeadLo == 0 && (m.HeadHi == 0 || m.HeadHi == kvHeads)) {
		if m.HeadLo >= m.HeadHi || m.HeadHi > kvHeads {
			return errMsg(m.ReqID, wire.CodeInvalid, "head range [%d, %d): want first < end ≤ %d (the namespace's KV heads)",
				m.HeadLo, m.HeadHi, kvHeads)
		}
		heads = kvcache.HeadRange{First: int(m.HeadLo), Count: int(m.HeadHi - m.HeadLo)}
	}
	o := &p.out
	o.Type = wire.TBeginStoreOK
	keys := m.Keys
	if d := p.s.disk; d != nil && m.HeadLo == 0 {
		// A use of each block, once per tensor-parallel group (the range
		// at head 0), for the disk tier's admission.
		d.saw(keys)
	}
	var refused map[wire.Key]uint8
	// The client's share: each key written takes one slot of the grant;
	// the index is asked for at most as many keys as are left of it, and
	// once none is left the rest are refused full (the keys of a chain cut
	// short go to the index with the last key given as their parent).
	grant := p.acct.grant(len(keys))
	defer func() { p.acct.refund(grant) }()
	now := time.Now().UnixNano()
	for i := 0; i < len(keys); {
		parent := m.Parent
		switch {
		case m.Flags&wire.FlagChain == 0:
			parent = m.Parents[i]
		case i > 0:
			parent = keys[i-1]
		}
		if out, ok := refused[parent]; ok && parent != (wire.Key{}) {
			// The parent was refused in this call: so is its child.
			o.Outcomes = append(o.Outcomes, out)
			refused[keys[i]] = out
			i++
			continue
		}
		if grant == 0 {
			p.s.counter.overShare.Add(1)
			for range keys[i:] {
				o.Outcomes = append(o.Outcomes, wire.OutcomeRefusedFull)
			}
			break
		}
		j := i + 1
		if m.Flags&wire.FlagChain != 0 {
			j = len(keys)
		} else {
			for j < len(keys) && m.Parents[j] == keys[j-1] {
				j++
			}
		}
		j = min(j, i+grant)
		var err error
		p.storeRes, err = c.BeginStore(kvcache.StoreRequest{Namespace: ns, Parent: parent, Keys: keys[i:j], BlockIDs: blockIDs[i:j], Heads: heads}, p.storeRes[:0])
		if err != nil {
			// Undo this request's reservations: an error leaves nothing held.
			p.slots = p.slots[:0]
			for _, sl := range o.Slots {
				e := p.held.get(sl.Handle())
				ks := slotOf(sl.Handle())
				ks.Heads = p.held.unreserve(e)
				p.slots = append(p.slots, ks)
			}
			if len(p.slots) > 0 {
				_ = c.CompleteStore(p.slots, errAborted)
			}
			return errMsg(m.ReqID, wire.CodeInvalid, "BeginStore: %v", err)
		}
		for k, r := range p.storeRes {
			var out uint8
			switch r.Outcome {
			case kvcache.StoreWrite:
				out = wire.OutcomeWrite
				e, ok := p.held.take(uint32(r.Slot.ID), r.Slot.Gen)
				if !ok || e.reserved {
					return errMsg(m.ReqID, wire.CodeInternal, "slot %d reserved in generation %d while this client holds generation %d", r.Slot.ID, r.Slot.Gen, e.gen)
				}
				p.held.reserve(e, r.Slot.Heads, now, &grant)
				o.Slots = append(o.Slots, toWire(r.Slot))
			case kvcache.StorePresent:
				out = wire.OutcomePresent
			case kvcache.StoreRefusedAdmission:
				out = wire.OutcomeRefusedAdmission
			default:
				out = wire.OutcomeRefusedFull
			}
			if out == wire.OutcomeRefusedFull || out == wire.OutcomeRefusedAdmission {
				if refused == nil {
					refused = map[wire.Key]uint8{}
				}
				refused[keys[i+k]] = out
			}
			o.Outcomes = append(o.Outcomes, out)
		}
		i = j
	}
	return o
}

// Stats is a node's state, as a client's Stats call returns it.
type Stats struct {
	PoolBytes       int64  `json:"pool_bytes"`
	Regions         int    `json:"regions"`
	RegionsRetiring int    `json:"regions_retiring"`
	FreedBytes      int64  `json:"freed_bytes"`
	SlotSize        uint64 `json:"slot_size"`
	PageMode        string `json:"page_mode"`
	Clients         int    `json:"clients"`
	// WaitingExit: clients disconnected without goodbye whose processes
	// still run; their reservations and leases are held until they exit.
	WaitingExit    int               `json:"waiting_exit"`
	Namespaces     map[string]uint32 `json:"namespaces"`
	Cache          kvcache.Stats     `json:"cache"`
	Accepted       uint64            `json:"accepted"`
	Refused        uint64            `json:"refused"`
	Malformed      uint64            `json:"malformed"`
	ReleasedOnExit uint64            `json:"released_on_exit"`
	ReleasedOnBye  uint64            `json:"released_on_bye"`
	EventsDropped  uint64            `json:"events_dropped"`
	PeersDropped   uint64            `json:"peers_dropped"`
	// InternalErrors counts states the node never expects (a client
	// holding two generations of one slot); 0 unless there is a bug.
	InternalErrors uint64 `json:"internal_errors"`
	// Connections: connections open now (said Hello or not); ConnsRefused:
	// connections refused past MaxConns or MaxConnsPerClient (also counted
	// in Refused); AcceptErrors: accepts that failed (out of descriptors or
	// memory, a connection aborted) and were retried; HelloTimeouts:
	// connections closed for saying no Hello within HelloTimeout.
	Connections   int    `json:"connections"`
	ConnsRefused  uint64 `json:"conns_refused"`
	AcceptErrors  uint64 `json:"accept_errors"`
	HelloTimeouts uint64 `json:"hello_timeouts"`
	// ShareSlots: the slots one client process may hold at once
	// (ClientShare of the pool; 0 before the first client). OverShare:
	// requests cut short by it (or by a slot's lease or load count).
	// ReservationsExpired: reservations not committed within
	// ReserveTimeout.
	ShareSlots          int64  `json:"share_slots"`
	OverShare           uint64 `json:"over_share"`
	ReservationsExpired uint64 `json:"reservations_expired"`
	// The disk tier (ServerConfig.Disk); all 0 without one.
	DiskLookupHits  int64  `json:"disk_lookup_hits"`  // keys Lookups found on disk after the pool's hits
	DiskHits        int64  `json:"disk_hits"`         // blocks BeginLoad promoted from disk
	DiskMisses      int64  `json:"disk_misses"`       // promotions whose record was missing or failed a check
	DiskWrites      int64  `json:"disk_writes"`       // blocks written to disk: evictions written back, and with WriteThrough blocks written through
	DiskWriteErrors int64  `json:"disk_write_errors"` // writes the store refused or failed
	DiskDropped     int64  `json:"disk_dropped"`      // blocks not written: an admitted eviction past WriteBackBytes waiting, or a ready block finding the write-through queue full
	DiskRecords     int64  `json:"disk_records"`      // records on disk now
	DiskCorrupt     int64  `json:"disk_corrupt"`      // records that failed a check when read
	DiskError       string `json:"disk_error,omitempty"`
	DiskOpen        bool   `json:"disk_open,omitempty"` // the tier is open and serving
	// DiskNotAdmitted: evictions the admission filter kept off disk (key
	// seen fewer than AdmitAfter times).
	DiskNotAdmitted int64 `json:"disk_not_admitted"`
	// DiskCopies: write-backs copied out of their slot first (a store
	// needed the slot at once); the others are written from their demoting
	// slot (Cache.Demotions).
	DiskCopies int64 `json:"disk_copies"`
	// DiskHitsWriting: DiskHits copied from a write-back in flight (the
	// block's slot or copy) rather than read from its record.
	DiskHitsWriting int64 `json:"disk_hits_writing"`
	// DiskWrittenAtClose: the pool's blocks Close wrote to disk
	// (DiskConfig.WriteBackOnClose); not counted in DiskWrites.
	DiskWrittenAtClose int64 `json:"disk_written_at_close"`
	// DiskLeftAtClose: blocks not on disk that Close did not write
	// because CloseContext's context ended first.
	DiskLeftAtClose int64 `json:"disk_left_at_close"`
}

// Stats returns a snapshot of the node's state.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	st := Stats{PoolBytes: s.cfg.PoolBytes, Regions: len(s.regions), FreedBytes: s.freedBytes, SlotSize: s.slotSize,
		PageMode: s.pageMode, Clients: len(s.peers), Namespaces: map[string]uint32{}}
	for _, rr := range s.regions {
		if rr.state != regionActive {
			st.RegionsRetiring++
		}
	}
	for n, ns := range s.namespaces {
		st.Namespaces[n] = ns.id
	}
	for _, w := range s.waits {
		st.WaitingExit += len(w.peers)
	}
	c := s.cache
	d := s.disk
	st.DiskError = s.diskErr
	s.mu.Unlock()
	if c != nil {
		st.Cache = c.Stats()
	}
	if d != nil {
		st.DiskOpen = true
		ds := d.store.Stats()
		st.DiskLookupHits, st.DiskHits, st.DiskMisses = d.lookupHits.Load(), d.hits.Load(), d.misses.Load()
		st.DiskWrites, st.DiskWriteErrors, st.DiskDropped = d.wb.Writes.Load(), d.wb.WriteErrors.Load(), d.wb.Dropped.Load()
		st.DiskRecords, st.DiskCorrupt = ds.Records, ds.Corrupt
		st.DiskNotAdmitted, st.DiskCopies, st.DiskHitsWriting = d.notAdmitted.Load(), d.wb.Copies.Load(), d.wb.Served.Load()
		st.DiskWrittenAtClose, st.DiskLeftAtClose = d.atClose.Load(), d.leftAtClose.Load()
	}
	st.Accepted = s.counter.accepted.Load()
	st.Refused = s.counter.refused.Load()
	st.Malformed = s.counter.malformed.Load()
	st.ReleasedOnExit = s.counter.releasedOnExit.Load()
	st.ReleasedOnBye = s.counter.releasedOnBye.Load()
	st.EventsDropped = s.counter.eventsDropped.Load()
	st.PeersDropped = s.counter.peersDropped.Load()
	st.InternalErrors = s.counter.internal.Load()
	st.ConnsRefused, st.AcceptErrors = s.counter.refusedCap.Load(), s.counter.acceptErrors.Load()
	st.HelloTimeouts, st.OverShare, st.ReservationsExpired = s.counter.helloTimeouts.Load(), s.counter.overShare.Load(), s.counter.expired.Load()
	s.accts.mu.Lock()
	st.Connections, st.ShareSlots = s.accts.conns, s.accts.share
	s.accts.mu.Unlock()
	return st
}
