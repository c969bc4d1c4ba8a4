package nodepool

// A connected client as the node sees it: peer, its push queue and
// writer, its serving loop (serve, reply) and the handshake (hello). The
// rest of the node's side of a connection: peer_lifetime.go (admission,
// the wait for a client's exit, release), peer_handle.go (serving a
// request), peer_loads.go (loads and the promoter); the index that the
// first hello creates, and its events: index.go; Stats: stats.go.
//
// Locks: p.mu guards p.held, shared by the serving goroutine (serve holds
// p.mu while handle runs) and the promoter; p.regions and p.subscribed are
// guarded by Server.mu. The order is p.mu, then Server.mu: under p.mu,
// handleRare and Server.reap take s.mu, and no code takes p.mu with s.mu
// held. hello runs with s.mu held; push, which it calls, takes no lock.

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"github.com/kvoffload/kvoffload/kvcache"
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
	layout, err := kvcache.NewLayout(kvcache.DenseRankSpec(kvcache.LayoutKind(m.Layout.Kind), g, kvcache.OrderUndeclared, kvcache.HeadRange{}, wire.MaxKeys, 1<<44))
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
