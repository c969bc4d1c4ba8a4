package nodepool

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/nodepool/wire"
	"golang.org/x/sys/unix"
)

// Client errors (errors.Is).
var (
	// ErrUnavailable: the node is not reachable (not started, gone, or
	// restarting). The client keeps trying to reconnect; ops fail fast
	// meanwhile. A node that went away takes its index with it: a
	// reconnected client finds an empty pool (misses), never wrong blocks.
	ErrUnavailable = errors.New("nodepool: node unavailable")
	// ErrVersion: the node speaks another protocol version.
	ErrVersion = errors.New("nodepool: protocol version mismatch")
	// ErrLayout: the node serves the namespace with another layout (or its
	// pool is carved in slots of another size).
	ErrLayout = errors.New("nodepool: layout mismatch")
	// ErrRefused: the node refused the connection (peer credentials).
	ErrRefused = errors.New("nodepool: connection refused by the node")
	// ErrClientClosed: Close was called.
	ErrClientClosed = errors.New("nodepool: client closed")
	// ErrNotYours: a slot handle this client holds no reservation or lease
	// for (given back twice, or never its own).
	ErrNotYours = errors.New("nodepool: slot not held by this client")
	// ErrInvalid: the node refused the request's arguments (duplicate key,
	// unsupported head range, ...).
	ErrInvalid = errors.New("nodepool: invalid request")
)

// Key is a block key.
type Key = kvcache.Key

// Layout is what every client of one namespace must agree on.
type Layout = wire.Layout

// LayoutOf returns the wire layout of a kvcache layout kind and geometry.
func LayoutOf(kind kvcache.LayoutKind, g kvcache.Geometry) Layout {
	return Layout{Kind: uint8(kind), Layers: uint32(g.Layers), KVHeads: uint32(g.KVHeads), HeadDim: uint32(g.HeadDim),
		DTypeBytes: uint32(g.DTypeBytes), TokensPerBlock: uint32(g.TokensPerBlock)}
}

// Region is one region of the node's pool as this client maps it.
type Region struct {
	ID      uint32
	Base    uintptr // this process's address of the region's first byte
	Size    int64   // bytes
	HugeTLB bool    // hugetlbfs pages back it
	mr      *mmapmem.Region
	epoch   uint32
	usable  atomic.Bool
}

// Bytes is the region's memory in this process.
func (r *Region) Bytes() []byte { return r.mr.Bytes() }

// Mapping is the region's mapping in this process, for pinning it
// (register.Pinner, mlock); the client unmaps it after RegionRetiring.
func (r *Region) Mapping() *mmapmem.Region { return r.mr }

// Epoch is the connection the region came with (Info.Epoch then): the
// node's region ids restart with a new node, so (ID, Epoch) names a region
// for the client's lifetime, as (Slot.Region, Slot.Epoch) names a slot's.
func (r *Region) Epoch() uint32 { return r.epoch }

// Hooks let the engine that owns the client (offload) pin and unpin the
// regions in its CUDA context. Both run on the client's own goroutines,
// never on a caller's.
type Hooks struct {
	// RegionAdded runs once a region is mapped in this process and its
	// page tables populated (in parallel), before any slot of it is
	// handed out: register it here (cuMemHostRegister). The first region
	// is added inside Dial, the others while serving, one at a time in
	// the node's order. An error leaves the region unusable by this client
	// (its slots are refused or missed, see StoreUnusable) and is kept in
	// Info().RegionErrors.
	RegionAdded func(r *Region) error
	// RegionRetiring runs when the region goes away: Trim on the node
	// (every slot of it already free: no copy of this client can touch
	// it) or the node lost (copies of this client may still be in flight
	// on its slots). It must return only once no copy of the client
	// touches the region and it is unregistered; the client then unmaps it
	// and, for a Trim, acknowledges to the node.
	RegionRetiring func(r *Region)
}

// ClientConfig configures Dial.
type ClientConfig struct {
	// Namespace names the model whose blocks the client stores (the node
	// keeps one layout per namespace and Clear works on it).
	Namespace string
	// Layout is the namespace's layout; a node serving the namespace with
	// another is ErrLayout.
	Layout Layout
	Hooks  Hooks
	// PrefaultThreads populate a region's mapping before RegionAdded
	// (0: mmapmem's default); NoPrefault skips it (tests).
	PrefaultThreads int
	NoPrefault      bool
	// Timeout bounds one round trip (default 10 s); a request it expires
	// is ErrUnavailable, and whatever its late reply reserved or leased is
	// given back by the client.
	Timeout time.Duration
	// Redial is the wait between reconnection attempts after the node
	// went away (default 200 ms); negative: never reconnect.
	Redial time.Duration
	// NoMap is for a client without a GPU (a scheduler, a router): it
	// maps no region (the node's fds are closed as they come, Hooks are
	// never called) and uses Lookup (with leases), Unlease, Delete, Clear,
	// Stats and events; its leased slots have no address (Addr 0).
	// BeginStore and BeginLoad are ErrInvalid.
	NoMap bool
	// OnEvents, when set, subscribes to the node's KV events (every
	// namespace; Event.NS against Info().NamespaceID): blocks becoming
	// ready and leaving the index. It runs on whichever goroutine reads
	// the connection (a caller of an op waiting for its reply, or the
	// client's idle reader), so it must not block nor call the client.
	OnEvents func([]wire.Event)
	// Logf, when set, is told about reconnections and region changes.
	Logf func(format string, args ...any)
}

// Info describes the connection.
type Info struct {
	ClientID     uint32
	NamespaceID  uint32
	SlotSize     uint64
	PageMode     string // the node's: hugetlbfs, THP as shmem_enabled allows, or base pages
	Epoch        uint32 // connections made so far (1 after Dial)
	RegionErrors []string
	announced    int
}

// Slot is a reserved or leased slot: where this process reads or writes
// the block (Addr, or Region+Off in the region's memfd), and the handle
// the node needs back (ID, Gen) for the connection it was given on
// (Epoch, Info.Epoch then). A caller that keeps slots in another form
// (offload's kvcache.Slot) rebuilds them with the same four fields and
// Off, Addr: a slot of an earlier connection is recognised by its Epoch.
type Slot struct {
	ID, Gen uint32
	Region  uint32
	Epoch   uint32
	Off     uint64
	Addr    uintptr
}

// StoreOutcome is BeginStore's answer for one key.
type StoreOutcome uint8

// Store outcomes.
const (
	StoreWrite            StoreOutcome = StoreOutcome(wire.OutcomeWrite)   // reserved to this client: copy, then CommitStore
	StorePresent          StoreOutcome = StoreOutcome(wire.OutcomePresent) // stored or being stored by someone
	StoreRefusedFull      StoreOutcome = StoreOutcome(wire.OutcomeRefusedFull)
	StoreRefusedAdmission StoreOutcome = StoreOutcome(wire.OutcomeRefusedAdmission)
	// StoreUnusable: the node reserved a slot in a region this client has
	// not mapped and registered yet (or failed to): the client gave it
	// back at once. Treat as refused busy.
	StoreUnusable StoreOutcome = 100
)

// StoreRequest is one BeginStore: keys, their parents, the head range.
type StoreRequest struct {
	Keys []Key
	// Parent is the parent of Keys[0], and Keys[i-1] of Keys[i], unless
	// Parents (one per key) is given.
	Parent  Key
	Parents []Key
	// HeadLo, HeadHi: the KV heads [HeadLo, HeadHi) this client writes of
	// each block; 0, 0 means all. The ranks of a tensor-parallel group
	// store their ranges into one slot; the block is visible once every
	// head is committed (a range beyond the namespace's heads: ErrInvalid).
	HeadLo, HeadHi int
}

// StoreResult is BeginStore's answer for one key.
type StoreResult struct {
	Outcome StoreOutcome
	Slot    Slot // when Outcome is StoreWrite
}

// LoadResult is BeginLoad's answer for one key.
type LoadResult struct {
	Found bool
	Slot  Slot // when Found: leased, and counted as a copy, until EndLoad
	// OnDisk (BeginLoadTiers only): not found in the pool, and the node's
	// disk tier holds it: Promote brings it in.
	OnDisk bool
}

// Client is a connection to a node (see the package comment). Its methods
// are safe for concurrent use; each op is one round trip (ops longer than
// wire.MaxKeys keys are split).
type Client struct {
	cfg    ClientConfig
	socket string

	mu       sync.Mutex
	conn     *wire.Conn
	cs       *connState
	epoch    uint32
	info     Info
	regions  map[uint32]*Region
	waiters  map[uint32]*waiter
	retired  map[retiredKey]bool
	nextReq  uint32
	closed   bool
	redialOn bool
	// draining: Close is waiting for the goroutines (wg); spawn starts no
	// more (an Add from zero must happen before the Wait).
	draining bool

	timeout atomic.Int64 // ClientConfig.Timeout (tests change it)
	adds    chan regionAdd
	stop    chan struct{}
	wg      sync.WaitGroup
	msgs    sync.Pool
	waitrs  sync.Pool
}

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

type retiredKey struct{ id, epoch uint32 }

type regionAdd struct {
	reg   wire.Region
	fd    int
	epoch uint32
}

// Dial connects to the node at socket: the version handshake, the
// namespace's layout check, and the first region mapped, populated and
// passed to Hooks.RegionAdded before it returns; the other regions follow
// in the background. Errors: ErrUnavailable (no node), ErrVersion,
// ErrLayout, ErrRefused.
func Dial(socket string, cfg ClientConfig) (*Client, error) {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.Redial == 0 {
		cfg.Redial = 200 * time.Millisecond
	}
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	c := &Client{cfg: cfg, socket: socket, regions: map[uint32]*Region{}, waiters: map[uint32]*waiter{}, retired: map[retiredKey]bool{},
		adds: make(chan regionAdd, 4096), stop: make(chan struct{})}
	c.timeout.Store(int64(cfg.Timeout))
	c.msgs.New = func() any { return new(wire.Msg) }
	c.waitrs.New = func() any { return &waiter{ch: make(chan *wire.Msg, 1)} }
	if err := c.connect(); err != nil {
		return nil, err
	}
	c.spawn(c.mapper)
	return c, nil
}

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

// addRegion maps a region (populating its page tables in parallel),
// calls Hooks.RegionAdded, and makes it usable.
func (c *Client) addRegion(a regionAdd) {
	if c.cfg.NoMap {
		_ = unix.Close(a.fd)
		return
	}
	mr, err := mmapmem.OpenMemfd(a.fd, int64(a.reg.Size), mmapmem.Options{PrefaultThreads: c.cfg.PrefaultThreads, NoPrefault: c.cfg.NoPrefault})
	if err != nil {
		_ = unix.Close(a.fd)
		c.regionError(fmt.Sprintf("region %d: map: %v", a.reg.ID, err))
		return
	}
	r := &Region{ID: a.reg.ID, Base: mr.Addr(), Size: mr.Len(), HugeTLB: mr.HugeTLB(), mr: mr, epoch: a.epoch}
	if h := c.cfg.Hooks.RegionAdded; h != nil {
		if err := h(r); err != nil {
			_ = mr.Close()
			c.regionError(fmt.Sprintf("region %d: RegionAdded: %v", a.reg.ID, err))
			return
		}
	}
	c.mu.Lock()
	if c.epoch != a.epoch || c.closed || c.retired[retiredKey{r.ID, a.epoch}] {
		c.mu.Unlock()
		c.retireLocal(r)
		return
	}
	c.regions[r.ID] = r
	r.usable.Store(true)
	c.mu.Unlock()
	c.cfg.Logf("region %d mapped: %d bytes at %#x", r.ID, r.Size, r.Base)
}

func (c *Client) regionError(s string) {
	c.mu.Lock()
	c.info.RegionErrors = append(c.info.RegionErrors, s)
	c.mu.Unlock()
	c.cfg.Logf("%s", s)
}

// retireLocal runs the retiring hook and unmaps.
func (c *Client) retireLocal(r *Region) {
	r.usable.Store(false)
	if h := c.cfg.Hooks.RegionRetiring; h != nil {
		h(r)
	}
	_ = r.mr.Close()
}

// mapper maps the regions announced after the first, one at a time.
func (c *Client) mapper() {
	for {
		select {
		case <-c.stop:
			for {
				select {
				case a := <-c.adds:
					_ = unix.Close(a.fd)
				default:
					return
				}
			}
		case a := <-c.adds:
			c.addRegion(a)
		}
	}
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

// retire answers the node's RegionRetire: hook, unmap, acknowledge.
func (c *Client) retire(id, epoch uint32) {
	c.mu.Lock()
	r := c.regions[id]
	if r != nil && r.epoch == epoch {
		delete(c.regions, id)
	} else {
		r = nil
		// Not mapped (yet): the mapper must not map it later.
		c.retired[retiredKey{id, epoch}] = true
	}
	c.mu.Unlock()
	if r != nil {
		c.retireLocal(r)
		c.cfg.Logf("region %d retired", id)
	}
	// Acknowledge a region never mapped here too (its map failed, or it
	// is still queued: the mapper skips it), so that the node can free it.
	_, _ = c.call(&wire.Msg{Type: wire.TRetireAck, Region: wire.Region{ID: id}}, wire.TOK)
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

// resolver turns node slots into this process's addresses, looking a
// region up once per run of slots in it (a reply's slots mostly share a
// few regions).
type resolver struct {
	c        *Client
	epoch    uint32
	slotSize uint64
	noMap    bool
	valid    bool // lastID's fields below are loaded
	lastID   uint32
	usable   bool
	base     uintptr
	size     uint64
}

// resolverAt returns a resolver for connection epoch.
func (c *Client) resolverAt(epoch uint32) resolver {
	c.mu.Lock()
	defer c.mu.Unlock()
	return resolver{c: c, epoch: epoch, slotSize: c.info.SlotSize, noMap: c.cfg.NoMap}
}

func (rv *resolver) load(id uint32) {
	c := rv.c
	c.mu.Lock()
	r := c.regions[id]
	c.mu.Unlock()
	rv.valid, rv.lastID = true, id
	rv.usable = r != nil && r.usable.Load() && r.epoch == rv.epoch
	if rv.usable {
		rv.base, rv.size = r.Base, uint64(r.Size)
	}
}

// put resolves node slot s into *d, this process's slot (its address
// set when its region is usable here); it reports whether the region is
// usable. It fills d's fields in place: a Slot built field by field and
// returned by value was copied whole through the stack, which stalled on
// store forwarding at about 20 ns a slot (20 µs of a 1024-key Lookup).
func (rv *resolver) put(d *Slot, s *wire.Slot) bool {
	d.ID, d.Gen, d.Region, d.Epoch, d.Off, d.Addr = s.ID, s.Gen, s.Region, rv.epoch, s.Off, 0
	if rv.noMap {
		return true // a lease without an address
	}
	if !rv.valid || s.Region != rv.lastID {
		rv.load(s.Region)
	}
	if !rv.usable || s.Off+rv.slotSize > rv.size {
		return false
	}
	d.Addr = rv.base + uintptr(s.Off)
	return true
}

// SlotBytes is the slot's memory in this process (SlotSize bytes at
// s.Addr), or nil when its region is not mapped here (any more). For the
// host backend and tests; a GPU engine copies to and from s.Addr.
func (c *Client) SlotBytes(s Slot) []byte {
	c.mu.Lock()
	r := c.regions[s.Region]
	size := c.info.SlotSize
	c.mu.Unlock()
	if r == nil || r.epoch != s.Epoch || s.Off+size > uint64(r.Size) {
		return nil
	}
	b := r.mr.Bytes()
	if b == nil {
		return nil
	}
	return b[s.Off : s.Off+size : s.Off+size]
}

// Info describes the connection.
func (c *Client) Info() Info {
	c.mu.Lock()
	defer c.mu.Unlock()
	i := c.info
	i.RegionErrors = append([]string(nil), i.RegionErrors...)
	return i
}

// Regions lists the regions mapped and usable in this process.
func (c *Client) Regions() []*Region {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]*Region, 0, len(c.regions))
	for _, r := range c.regions {
		if r.usable.Load() {
			out = append(out, r)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// WaitRegions waits until every region the node announced on the current
// connection is mapped and usable here (or failed to map: see
// Info().RegionErrors), at most d; it reports whether they are.
func (c *Client) WaitRegions(d time.Duration) bool {
	if c.cfg.NoMap {
		return true
	}
	deadline := time.Now().Add(d)
	for {
		c.mu.Lock()
		n, want, failed := 0, c.info.announced, len(c.info.RegionErrors)
		for _, r := range c.regions {
			if r.epoch == c.epoch && r.usable.Load() {
				n++
			}
		}
		c.mu.Unlock()
		if n+failed >= want {
			return failed == 0
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
}

// Available reports whether the client is connected.
func (c *Client) Available() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.conn != nil
}

func (c *Client) curEpoch() uint32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.epoch
}

// ---- ops ---------------------------------------------------------------------

// Lookup returns how many leading keys are ready in the pool; with lease,
// it leases them (give them back with Unlease) and appends their slots to
// dst. A leased block whose region is not usable here ends the hits (and
// is unleased).
func (c *Client) Lookup(keys []Key, lease bool, dst []Slot) (hits int, leased []Slot, err error) {
	hits, _, leased, err = c.LookupTiers(keys, lease, dst)
	return hits, leased, err
}

// LookupTiers is Lookup that also returns lower: how many keys after the
// hits the node's disk tier holds (ServerConfig.Disk; 0 without one),
// which a BeginLoad of them promotes into the pool first.
func (c *Client) LookupTiers(keys []Key, lease bool, dst []Slot) (hits, lower int, leased []Slot, err error) {
	leased = dst
	start := len(dst)
	for len(keys) > 0 {
		n := min(len(keys), wire.MaxKeys)
		m := c.msgs.Get().(*wire.Msg)
		m.Reset()
		m.Type, m.Keys = wire.TLookup, append(m.Keys, keys[:n]...)
		if lease {
			m.Flags = wire.FlagLease
		}
		epoch := c.curEpoch()
		r, err := c.callEpoch(m, wire.TLookupOK, epoch)
		c.msgs.Put(m)
		if err != nil {
			_ = c.Unlease(leased[start:])
			return 0, 0, leased[:start], err
		}
		h := int(r.N)
		replied, low := h, int(r.Lower) // r goes back to the pool below
		var drop []Slot
		rv := c.resolverAt(epoch)
		leased = slices.Grow(leased, len(r.Slots))
		for i := range r.Slots {
			k := len(leased)
			leased = leased[:k+1]
			if !rv.put(&leased[k], &r.Slots[i]) || h < i {
				h = min(h, i)
				drop = append(drop, leased[k])
				leased = leased[:k]
			}
		}
		c.done(r)
		if len(drop) > 0 {
			_ = c.Unlease(drop)
		}
		hits += h
		if h < n {
			if h == replied {
				lower = low // not when a leased block ended the hits early
			}
			break
		}
		keys = keys[n:]
	}
	return hits, lower, leased, nil
}

// handles sends slots back in requests of type t, split by epoch and by
// wire.MaxKeys. Slots of an earlier connection are already released (the
// node that held them is gone): only stale is returned for them, nil when
// stale is nil.
func (c *Client) handles(t wire.Type, slots []Slot, stale error) error {
	epoch := c.curEpoch()
	var first error
	m := c.msgs.Get().(*wire.Msg)
	defer c.msgs.Put(m)
	for len(slots) > 0 {
		m.Reset()
		m.Type = t
		i := 0
		for ; i < len(slots) && len(m.Handles) < wire.MaxKeys; i++ {
			if slots[i].Epoch != epoch {
				if first == nil {
					first = stale
				}
				continue
			}
			m.Handles = append(m.Handles, wire.Handle{ID: slots[i].ID, Gen: slots[i].Gen})
		}
		slots = slots[i:]
		if len(m.Handles) == 0 {
			continue
		}
		r, err := c.callEpoch(m, wire.TOK, epoch)
		if err != nil {
			if errors.Is(err, ErrUnavailable) {
				err = stale
			}
			if first == nil {
				first = err
			}
			continue
		}
		c.done(r)
	}
	return first
}

// Unlease gives back leases of Lookup. Leases of a node that went away
// are gone with it (nil).
func (c *Client) Unlease(slots []Slot) error { return c.handles(wire.TUnlease, slots, nil) }

// CommitStore makes the blocks of slots (reserved by BeginStore) ready.
// Call it only once every copy into them has retired. If the node went
// away since BeginStore, nothing was stored: ErrUnavailable.
func (c *Client) CommitStore(slots []Slot) error {
	return c.handles(wire.TCommitStore, slots, ErrUnavailable)
}

// AbortStore gives back reservations whose copies failed (or were never
// made): the blocks never become ready. Call it once no copy into them is
// in flight.
func (c *Client) AbortStore(slots []Slot) error { return c.handles(wire.TAbortStore, slots, nil) }

// EndLoad ends loads of BeginLoad once their copies retired.
func (c *Client) EndLoad(slots []Slot) error { return c.handles(wire.TEndLoad, slots, nil) }

// BeginStore reserves a slot for each key to store, appending one result
// per key to dst.
func (c *Client) BeginStore(req StoreRequest, dst []StoreResult) ([]StoreResult, error) {
	if c.cfg.NoMap {
		return dst, fmt.Errorf("%w: a client without mappings (NoMap) cannot store", ErrInvalid)
	}
	if req.Parents != nil && len(req.Parents) != len(req.Keys) {
		return dst, fmt.Errorf("%w: %d parents for %d keys", ErrInvalid, len(req.Parents), len(req.Keys))
	}
	if req.HeadLo < 0 || req.HeadHi < req.HeadLo || req.HeadHi > 1<<16-1 {
		return dst, fmt.Errorf("%w: head range [%d, %d)", ErrInvalid, req.HeadLo, req.HeadHi)
	}
	start := len(dst)
	parent := req.Parent
	keys := req.Keys
	m := c.msgs.Get().(*wire.Msg)
	defer c.msgs.Put(m)
	for off := 0; off < len(keys); {
		n := min(len(keys)-off, wire.MaxKeys)
		m.Reset()
		m.Type, m.HeadLo, m.HeadHi = wire.TBeginStore, uint16(req.HeadLo), uint16(req.HeadHi)
		m.Keys = append(m.Keys, keys[off:off+n]...)
		if req.Parents != nil {
			m.Parents = append(m.Parents, req.Parents[off:off+n]...)
		} else {
			m.Flags, m.Parent = wire.FlagChain, parent
		}
		epoch := c.curEpoch()
		r, err := c.callEpoch(m, wire.TBeginStoreOK, epoch)
		if err != nil {
			c.abortResults(dst[start:])
			return dst[:start], err
		}
		if len(r.Outcomes) != n {
			// Results would land on the wrong keys: give back what the
			// reply reserved, and what earlier replies did.
			dst = c.storeResults(dst, r, epoch)
			c.abortResults(dst[start:])
			return dst[:start], fmt.Errorf("%w: the node answered %d outcomes to BeginStore of %d keys", ErrInvalid, len(r.Outcomes), n)
		}
		dst = c.storeResults(dst, r, epoch)
		off += n
		parent = keys[off-1]
	}
	return dst, nil
}

// storeResults appends a BeginStore reply's results to dst (aborting the
// reservations of regions not usable here) and gives r back.
func (c *Client) storeResults(dst []StoreResult, r *wire.Msg, epoch uint32) []StoreResult {
	var unusable []Slot
	si := 0
	rv := c.resolverAt(epoch)
	dst = slices.Grow(dst, len(r.Outcomes))
	for _, o := range r.Outcomes {
		dst = append(dst, StoreResult{Outcome: StoreOutcome(o)})
		if o == wire.OutcomeWrite {
			res := &dst[len(dst)-1]
			if !rv.put(&res.Slot, &r.Slots[si]) {
				res.Outcome = StoreUnusable
				unusable = append(unusable, res.Slot)
			}
			si++
		}
	}
	c.done(r)
	if len(unusable) > 0 {
		_ = c.AbortStore(unusable)
	}
	return dst
}

func (c *Client) abortResults(rs []StoreResult) {
	var slots []Slot
	for _, r := range rs {
		if r.Outcome == StoreWrite {
			slots = append(slots, r.Slot)
		}
	}
	_ = c.AbortStore(slots)
}

// BeginLoad leases each key's ready block and counts a copy on it,
// appending one result per key to dst. A found block whose region is not
// usable here is reported missing (and its load ended). With a disk tier
// on the node, the keys the pool lacks and the disk holds are promoted
// first, all of them before the node answers.
func (c *Client) BeginLoad(keys []Key, dst []LoadResult) ([]LoadResult, error) {
	return c.beginLoad(wire.TBeginLoad, 0, keys, nil, dst)
}

// BeginLoadTiers is BeginLoad without the promotion: a key the pool lacks
// and the node's disk tier holds is reported OnDisk (not Found), for
// Promote to bring in, in chunks of the caller's choosing; the node reads
// nothing for it. The same round trip as BeginLoad's.
func (c *Client) BeginLoadTiers(keys []Key, dst []LoadResult) ([]LoadResult, error) {
	return c.beginLoad(wire.TBeginLoad, wire.FlagDiskLater, keys, nil, dst)
}

// Promote promotes keys from the node's disk tier into its pool (the
// records read into slots reserved as a store of this client's namespace
// would, key i's parent parents[i]; a record that fails a check stays
// missing) and then begins their load, as BeginLoad: one result per key
// appended to dst, Found (a load to end with EndLoad) or not. A key
// already in the pool is found without a read. The node serves a
// client's Promotes in order, in the background: its other calls are
// answered meanwhile, and a Promote sent before the last one's reply has
// its reads started as soon as the last one's end. Up to four Promotes
// wait on the node; past them the node reads the client's next requests
// only as its promoter takes one (bounded memory for the keys waiting).
func (c *Client) Promote(keys, parents []Key, dst []LoadResult) ([]LoadResult, error) {
	if len(parents) != len(keys) {
		return dst, fmt.Errorf("%w: %d parents for %d keys", ErrInvalid, len(parents), len(keys))
	}
	return c.beginLoad(wire.TPromote, 0, keys, parents, dst)
}

// beginLoad is BeginLoad (t TBeginLoad, flags) or Promote (TPromote, with
// parents).
func (c *Client) beginLoad(t wire.Type, flags uint8, keys, parents []Key, dst []LoadResult) ([]LoadResult, error) {
	if c.cfg.NoMap {
		return dst, fmt.Errorf("%w: a client without mappings (NoMap) cannot load", ErrInvalid)
	}
	start := len(dst)
	m := c.msgs.Get().(*wire.Msg)
	defer c.msgs.Put(m)
	for off := 0; off < len(keys); {
		n := min(len(keys)-off, wire.MaxKeys)
		m.Reset()
		m.Type, m.Flags = t, flags
		m.Keys = append(m.Keys, keys[off:off+n]...)
		if parents != nil {
			m.Parents = append(m.Parents, parents[off:off+n]...)
		}
		epoch := c.curEpoch()
		r, err := c.callEpoch(m, wire.TBeginLoadOK, epoch)
		if err == nil && len(r.Outcomes) != n {
			// Results would land on the wrong keys: end the loads the
			// reply began, and those of earlier replies.
			got := len(r.Outcomes)
			dst = c.loadResults(dst, r, epoch)
			err = fmt.Errorf("%w: the node answered %d outcomes to %v of %d keys", ErrInvalid, got, t, n)
		}
		if err != nil {
			var slots []Slot
			for _, x := range dst[start:] {
				if x.Found {
					slots = append(slots, x.Slot)
				}
			}
			_ = c.EndLoad(slots)
			return dst[:start], err
		}
		dst = c.loadResults(dst, r, epoch)
		off += n
	}
	return dst, nil
}

// loadResults appends a BeginLoad or Promote reply's results to dst
// (ending the loads of regions not usable here) and gives r back.
func (c *Client) loadResults(dst []LoadResult, r *wire.Msg, epoch uint32) []LoadResult {
	var unusable []Slot
	si := 0
	rv := c.resolverAt(epoch)
	dst = slices.Grow(dst, len(r.Outcomes))
	for _, o := range r.Outcomes {
		dst = append(dst, LoadResult{OnDisk: o == wire.OutcomeOnDisk})
		if o == wire.OutcomeFound {
			res := &dst[len(dst)-1]
			res.Found = rv.put(&res.Slot, &r.Slots[si])
			if !res.Found {
				unusable = append(unusable, res.Slot)
				res.Slot = Slot{}
			}
			si++
		}
	}
	c.done(r)
	if len(unusable) > 0 {
		_ = c.EndLoad(unusable)
	}
	return dst
}

// Delete removes keys from the index (any namespace); it returns how many
// were removed.
func (c *Client) Delete(keys []Key) (int, error) {
	total := 0
	for len(keys) > 0 {
		n := min(len(keys), wire.MaxKeys)
		r, err := c.call(&wire.Msg{Type: wire.TDelete, Keys: keys[:n]}, wire.TOK)
		if err != nil {
			return total, err
		}
		total += int(r.N)
		c.done(r)
		keys = keys[n:]
	}
	return total, nil
}

// Clear removes every block of the client's namespace.
func (c *Client) Clear() (int, error) {
	r, err := c.call(&wire.Msg{Type: wire.TClear}, wire.TOK)
	if err != nil {
		return 0, err
	}
	defer c.done(r)
	return int(r.N), nil
}

// Stats returns the node's state.
func (c *Client) Stats() (Stats, error) {
	var st Stats
	r, err := c.call(&wire.Msg{Type: wire.TStats}, wire.TStatsOK)
	if err != nil {
		return st, err
	}
	defer c.done(r)
	return st, json.Unmarshal(r.JSON, &st)
}

// Trim asks the node to give back at least bytes of its pool (see
// Server.Trim); this client, like every other, is told to unmap the
// regions as they retire.
func (c *Client) Trim(bytes int64) (TrimResult, error) {
	var res TrimResult
	if bytes < 0 {
		return res, fmt.Errorf("%w: trim of %d bytes", ErrInvalid, bytes)
	}
	r, err := c.call(&wire.Msg{Type: wire.TTrim, N: uint64(bytes)}, wire.TTrimOK)
	if err != nil {
		return res, err
	}
	defer c.done(r)
	return res, json.Unmarshal(r.JSON, &res)
}

// Close says goodbye to the node (the client vouches that none of its
// copies is in flight: the caller ended them, so what it still holds is
// released at once), retires every region locally (Hooks.RegionRetiring,
// unmap) and stops reconnecting.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return ErrClientClosed
	}
	c.closed = true
	close(c.stop)
	conn := c.conn
	c.mu.Unlock()
	if conn != nil {
		if r, err := c.call(&wire.Msg{Type: wire.TBye}, wire.TOK); err == nil {
			c.done(r)
		}
		_ = conn.Close()
	}
	c.mu.Lock()
	c.draining = true
	c.mu.Unlock()
	c.wg.Wait()
	c.mu.Lock()
	var rs []*Region
	for id, r := range c.regions {
		rs = append(rs, r)
		delete(c.regions, id)
	}
	c.mu.Unlock()
	for _, r := range rs {
		c.retireLocal(r)
	}
	return nil
}
