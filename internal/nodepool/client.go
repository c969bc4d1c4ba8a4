package nodepool

// The client's API: its errors, the types its calls take and return
// (Key, Layout, Hooks, ClientConfig, Info, Slot, the store and load
// results), the Client itself, Dial, Close and the connection's accessors
// (Info, Available). The rest of the client: client_conn.go (connecting
// and reconnecting), client_call.go (a request's round trip and the
// reading of the connection), client_regions.go (the regions as this
// process maps them), client_ops.go (the ops).
//
// Locks: c.mu guards the Client fields declared after it, up to draining;
// timeout is atomic, and adds, stop, wg and the pools need no lock. The
// client's other lock, a connection's read lock connState.rmu
// (client_call.go), is taken before c.mu, never under it: whoever reads
// the socket holds rmu and takes c.mu to find a reply's waiter. The hooks
// run with c.mu released.

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"github.com/kvoffload/kvoffload/kvcache"
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

// Info describes the connection.
func (c *Client) Info() Info {
	c.mu.Lock()
	defer c.mu.Unlock()
	i := c.info
	i.RegionErrors = append([]string(nil), i.RegionErrors...)
	return i
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
