package kvcache

import (
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/kvoffload/kvoffload/internal/kvseen"
)

// Cache errors. Every error wraps one of these and names the bad value.
var (
	// errConfig: an invalid Config or policy configuration.
	errConfig = errors.New("kvcache: invalid config")
	// errClosed: the cache was closed.
	errClosed = errors.New("kvcache: cache closed")
	// errLengthMismatch: keys and block ids of different lengths.
	errLengthMismatch = errors.New("kvcache: keys and block ids differ in length")
	// errDuplicate: a key (or, for a load, a block id) appears twice in one call.
	errDuplicate = errors.New("kvcache: duplicate in one call")
	// errRegion: a region that cannot be added (duplicate id, bad ranges, or
	// no slot fits in it).
	errRegion = errors.New("kvcache: bad region")
	// errUnknownRegion: RemoveRegion of a region the cache does not hold.
	errUnknownRegion = errors.New("kvcache: unknown region")
	// errStaleSlot: a slot handle that does not name a slot in the state the
	// call needs (completed twice, already released, from an earlier
	// occupant of the slot, or never handed out).
	errStaleSlot = errors.New("kvcache: stale slot handle")
)

// defaultSlotAlign is the default alignment of slot addresses: 4 KiB, a page.
// 16 bytes is the minimum (the copy kernel's vector width). A page keeps two
// slots from ever sharing a cache line or a page, so a DMA writing one slot
// never touches a line the CPU or another DMA uses for its neighbour, and
// poisoning or protecting one slot in tests cannot hit another. Real slots are
// whole pages already (2 MiB for Llama 3 8B, 5 MiB for Llama 3 70B) or close
// to it (4.3 MiB for DeepSeek's MLA, padded by 2 KiB, 0.05%).
const defaultSlotAlign = 4096

// Namespace identifies whose blocks an entry holds (model, dtype, layout;
// not the tensor-parallel rank, whose ranks share blocks), so Clear can
// drop one model's blocks on a reload. The cache does not
// interpret it; keys of different namespaces differ anyway (see ChainKeys).
type Namespace uint32

// RegionID names a region; chosen by the caller, unique among the regions
// the cache holds.
type RegionID uint64

// Region is a piece of pinned host memory handed to the cache to carve into
// slots. The cache never reads or writes the memory: it hands out addresses.
type Region struct {
	ID   RegionID
	Base uintptr // host address of the region's first byte
	Size uint64  // bytes
	// RangeStarts are the offsets (ascending, inside (0, Size)) where a new
	// registration range begins; no slot straddles one. Nil: the region is
	// one registration range.
	RangeStarts []uint64
}

// Slot is a handle to one slot: where the block's bytes go (Addr, or Off
// inside Region) and, in ID and Gen, what CompleteStore, EndLoad and Unlease
// need. A handle is valid for one occupancy of the slot.
type Slot struct {
	ID     SlotID
	Gen    uint32
	Region RegionID
	Off    uint64  // offset of the slot inside its region
	Addr   uintptr // Region.Base + Off
	// Heads is, in a handle BeginStore gave for a head-range write, the
	// range that write stores (CompleteStore completes that range); zero in
	// every other handle (whole-block stores, loads, leases).
	Heads HeadRange
}

// Config configures a Cache.
type Config struct {
	// Layout of the GPU cache; required. Its SlotSize is the slot size and
	// its NumBlocks bounds the block ids of stores and loads.
	Layout *Layout
	// SlotAlign is the alignment of slot addresses, a power of two ≥ 16;
	// 0 means 4 KiB, a page: no two slots share one.
	SlotAlign uint64
	// Policy advises evictions; nil means exact LRU. The cache owns it and
	// closes it in Close.
	Policy Policy
	// LowWatermark is the number of free slots the cache keeps by evicting
	// ahead of demand (inline, at every call that changes the pool). 0: evict
	// only when a store finds no free slot.
	LowWatermark int
	// StoreThreshold: a key is stored only once it has been looked up at
	// least this many times (the lookup of the request that stores it
	// included), so one-off blocks cost no D2H copy. 0 or 1: store every key.
	StoreThreshold int
	// OnFree, when set, is called with a slot that held a block (evicted,
	// deleted, cleared, or whose store failed) once every reader and
	// transfer on it has ended, before it returns to the free list (the
	// owner zeroes it there). It runs without the cache's lock, on the
	// goroutine of the call that released the slot, after that call's
	// critical section: meanwhile the slot is "zeroing" (Stats.Zeroing),
	// neither free nor readable, its region is not released, and other
	// calls proceed. One exception: a store that finds no free slot zeroes
	// the slots it evicted for itself at once, under the lock
	// (Stats.ZeroedUnderLock); it is refused as pool full rather than wait
	// for slots other calls are zeroing. OnFree may run on several
	// goroutines at once (for different slots); it must not call the
	// cache. Slots of a draining region are not passed: their memory goes
	// back to the OS.
	OnFree func(Slot)
	// OnIndex, when set, is called with the cache's lock held when a block
	// becomes visible (CompleteStore succeeded) and when a visible block
	// leaves the index (evicted, rejected, deleted, cleared, trimmed), in
	// the order the cache saw them: a key's removal never comes before its
	// ready. Blocks dropped while still being written are reported by
	// neither. It must not block nor call the cache (see IndexEvent).
	OnIndex func(IndexEvent)
	// MaxSlots, when > 0, is the number of slots the pool is expected to
	// reach (its planned size over the slot size): New reserves the slot
	// table and the key index for that many, so that AddRegion, while the
	// pool grows up to it, never copies the slot table nor rehashes the
	// index (each O(slots so far), under the cache's lock). The memory is
	// reserved, not touched: a fresh large allocation is backed lazily.
	// Beyond MaxSlots both grow as without it.
	MaxSlots int
	// PartialTimeout bounds how long a block stored by head ranges
	// (StoreRequest.Heads, the ranks of a tensor-parallel group) may stay
	// incomplete: once this long has passed since its first range was
	// granted, a block still missing heads is reclaimed (never visible,
	// never loaded; Stats.PartialExpired), at the next BeginStore,
	// or ExpirePartials. 0 means DefaultPartialTimeout.
	PartialTimeout time.Duration
	// Clock, when set, replaces time.Now for PartialTimeout (tests).
	Clock func() time.Time
	// Demote, when set, is asked with the cache's lock held about each
	// block the policy evicts (IndexEvent.Evicted: not a delete, clear,
	// trim nor a TinyLFU rejection), before OnIndex reports its removal:
	// true sends its slot, once its last reader and transfer have ended,
	// into "demoting" (readable, not reusable) and hands it to OnDemote
	// instead of freeing it. needed reports an eviction the evicting
	// store needs the slot of at once (fewer slots free or zeroing than
	// it allocates): the slot is freed whatever Demote answers, so the
	// owner can count the demotion as dropped. Demote must not block nor
	// call the cache. Ignored without OnDemote.
	Demote func(s Slot, k Key, needed bool) bool
	// OnDemote is given each slot Demote accepted, with its block's key,
	// once the slot is demoting: without the cache's lock, on the
	// goroutine of the call that released the slot, after that call's
	// critical section (as OnFree). The slot's bytes stay intact and the
	// slot out of every other use (never handed to a store, its region
	// never releasable) until the owner calls Demoted with it; the owner
	// may read it meanwhile (a disk write from the slot's memory). It
	// must not block; it may call Demoted (on this goroutine or later).
	OnDemote func(s Slot, k Key)
}

// MaxSlots bounds Config.MaxSlots (slot ids are int32).
const MaxSlots = 1 << 30

// ReserveBytes returns the bytes New reserves for Config.MaxSlots = n: the
// slot table and the key index. They are reserved, not touched, but count
// against the address space and, once the pool fills, memory; callers
// sizing a pool add them to what they check.
func ReserveBytes(n int) int64 {
	if n <= 0 {
		return 0
	}
	n = min(n, MaxSlots)
	size := 16
	for size < 2*n {
		size <<= 1
	}
	return int64(n)*int64(unsafe.Sizeof(slotRec{})) + int64(size)*int64(unsafe.Sizeof(indexEntry{}))
}

// carvePresize bounds the slot offsets carve reserves up front (a 128 MiB
// slice), so that an absurd region size fails on its slot count, not on
// an allocation.
const carvePresize = 1 << 24

type slotState uint8

const (
	stateFree slotState = iota
	stateWriting
	stateReady
	stateLeased
	stateReleasing
	stateZeroing  // released, handed to Config.OnFree outside the lock
	stateDemoting // evicted and released, handed to Config.OnDemote; freed by Demoted
	stateRetired  // belongs to a released region, or an unused id
)

var stateNames = [...]string{"free", "writing", "ready", "leased", "releasing", "zeroing", "demoting", "retired"}

func (s slotState) String() string { return stateNames[s] }

type slotRec struct {
	key        Key
	off        uint64
	prev, next int32 // free list links
	region     int32
	gen        uint32
	readers    int32
	pending    int32 // outstanding transfers: the store's D2H, each load's H2D
	parent     int32 // parent's slot, -1 none
	parentGen  uint32
	children   int32 // ready/leased children linked to this slot
	ns         Namespace
	state      slotState
	storing    bool // the D2H of this occupancy has not completed (every head-range write's, for a partial block)
	chain      bool // part of the chain BeginStore is making room for
	demote     bool // evicted, accepted by Config.Demote: demoting once released (releasing or demoting)
	// dupMark and dupN are the duplicate checks' scratch (endRead,
	// Demoted): dupN counts this slot's handles in the call stamped
	// dupMark (Cache.dupEpoch).
	dupMark uint32
	dupN    int32
	// part is the head-range state of a block stored by head ranges, while
	// it is incomplete (see partial); nil otherwise.
	part *partial
}

type regionRec struct {
	r          Region
	first, n   int32 // slot ids [first, first+n)
	busy       int   // slots not free
	draining   bool
	releasable bool // drained and handed to TakeReleasable; slots retired
}

// Cache is the block index and slot pool: it maps keys to slots, runs every
// slot through the block state machine, and keeps the pool within its regions.
// All methods are safe for concurrent use (one mutex; every call works on a
// whole list of blocks under one lock acquisition).
type Cache struct {
	mu        sync.Mutex
	layout    *Layout
	slotSize  uint64
	align     uint64
	policy    Policy
	lru       *lru // policy, when it is the LRU: hits touch it without an interface call
	watermark int
	threshold int
	onFree    func(Slot)
	onIndex   func(IndexEvent)
	demote    func(Slot, Key, bool) bool
	onDemote  func(Slot, Key)
	closed    bool

	// Head-range stores: the model's KV heads, the partial timeout and
	// clock, and the partial blocks oldest first (expiries[expHead:]).
	heads          int
	partialTimeout time.Duration
	now            func() time.Time
	expiries       []expiry
	expHead        int
	nPartial       int // slots with a partial record

	// toZero holds the slots the current critical section released into
	// zeroing; unlock hands them to onFree. Empty outside a critical
	// section. zeroDone (on mu) is signalled when the last zeroing slot
	// is freed, for Close.
	toZero   []Slot
	zeroDone sync.Cond
	// zeroingLocked is set while zeroHere runs OnFree under the lock.
	zeroingLocked bool
	// toDemote holds the slots the current critical section put into
	// demoting; unlock hands them to onDemote. Empty outside a critical
	// section.
	toDemote []demotion

	slots   []slotRec
	regions []*regionRec
	holes   []idRange // slot ids of released regions, reusable
	index   keyIndex

	freeHead int32
	nFree    int // slots on the free list
	usable   int // slots of regions not draining

	seen kvseen.Sketch

	releasable []RegionID
	st         Stats
	counts     [stateRetired]int // slots per state, retired ones not counted

	victims  []victim  // scratch for maintain
	found    []int32   // scratch: slots of a call's keys
	dupKeys  dupKeySet // scratch for duplicate checks
	dupIDs   dupIDSet
	dupStore map[storeHandle]struct{}
	// dupEpoch stamps slotRec.dupMark: endRead and Demoted count how often
	// a call names each slot in the slot records they touch anyway, not in
	// a map.
	dupEpoch uint32
}

// storeHandle names one store write in CompleteStore's duplicate check: a
// slot, and for a head-range write its first head.
type storeHandle struct {
	id    SlotID
	first int
}

type idRange struct{ first, n int32 }

// New returns an empty cache (no regions yet; add them with AddRegion).
func New(cfg Config) (*Cache, error) {
	if cfg.Layout == nil {
		return nil, fmt.Errorf("%w: Layout is required", errConfig)
	}
	align := cfg.SlotAlign
	if align == 0 {
		align = defaultSlotAlign
	}
	if align < segmentAlign || align&(align-1) != 0 {
		return nil, fmt.Errorf("%w: SlotAlign %d must be a power of two ≥ %d", errConfig, align, segmentAlign)
	}
	if cfg.LowWatermark < 0 {
		return nil, fmt.Errorf("%w: LowWatermark %d is negative", errConfig, cfg.LowWatermark)
	}
	if cfg.PartialTimeout < 0 {
		return nil, fmt.Errorf("%w: PartialTimeout %v is negative", errConfig, cfg.PartialTimeout)
	}
	if cfg.StoreThreshold < 0 || cfg.StoreThreshold > kvseen.Max {
		return nil, fmt.Errorf("%w: StoreThreshold %d outside [0, %d]", errConfig, cfg.StoreThreshold, kvseen.Max)
	}
	p := cfg.Policy
	if p == nil {
		p = newLRU()
	}
	c := &Cache{
		layout: cfg.Layout, slotSize: cfg.Layout.SlotSize(), align: align, policy: p,
		watermark: cfg.LowWatermark, threshold: cfg.StoreThreshold, onFree: cfg.OnFree, onIndex: cfg.OnIndex,
		freeHead: -1,
		heads:    cfg.Layout.Geometry().KVHeads, partialTimeout: cfg.PartialTimeout, now: cfg.Clock,
		dupStore: map[storeHandle]struct{}{},
	}
	c.lru, _ = p.(*lru)
	c.zeroDone.L = &c.mu
	if cfg.OnDemote != nil {
		c.demote, c.onDemote = cfg.Demote, cfg.OnDemote
	}
	if c.partialTimeout == 0 {
		c.partialTimeout = DefaultPartialTimeout
	}
	if c.now == nil {
		c.now = time.Now
	}
	if cfg.MaxSlots < 0 || cfg.MaxSlots > MaxSlots {
		return nil, fmt.Errorf("%w: MaxSlots %d outside [0, %d]", errConfig, cfg.MaxSlots, MaxSlots)
	}
	if cfg.MaxSlots > 0 {
		c.slots = make([]slotRec, 0, cfg.MaxSlots)
		c.index.reserve(cfg.MaxSlots)
	}
	if c.threshold > 1 {
		c.seen = kvseen.NewSketch()
	}
	p.setCapacity(0)
	return c, nil
}

// Close closes the policy (stopping its goroutines) and waits for the
// Config.OnFree calls in progress. Later calls fail ("cache closed"; lookups
// report no hits), except Demoted, so that an owner may finish its
// demotions after Close. Close does not wait for transfers nor for
// demoting slots: the caller stops its transfers first.
func (c *Cache) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.closed {
		c.closed = true
		c.policy.close()
	}
	for c.counts[stateZeroing] > 0 {
		c.zeroDone.Wait()
	}
}

// unlock ends a critical section: it drops the lock, hands the slots the
// section put into demoting to Config.OnDemote and those it released to
// Config.OnFree, then re-takes the lock briefly to put the latter on the
// free list (or retire them, if their region started draining meanwhile).
// Every method that may release a slot unlocks with it.
func (c *Cache) unlock() {
	if len(c.toZero) == 0 && len(c.toDemote) == 0 {
		c.mu.Unlock()
		return
	}
	batch, demote := c.toZero, c.toDemote
	c.toZero, c.toDemote = nil, nil
	c.mu.Unlock()
	for _, d := range demote {
		c.onDemote(d.slot, d.key)
	}
	if len(batch) == 0 {
		return
	}
	for _, h := range batch {
		c.onFree(h)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, h := range batch {
		c.freeZeroed(int32(h.ID))
	}
	if c.toZero == nil {
		c.toZero = batch[:0]
	}
	c.check()
}

// ---- regions -----------------------------------------------------------------

// AddRegion carves r into slots and adds them to the pool; it may be called
// while the cache serves. It returns the number of slots. Errors (a
// duplicate id, ranges not ascending inside the region, or no slot fitting in
// any registration range) leave the pool unchanged.
func (c *Cache) AddRegion(r Region) (int, error) {
	offs, err := carve(r, c.slotSize, c.align)
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	defer c.unlock()
	if c.closed {
		return 0, errClosed
	}
	for _, rr := range c.regions {
		if rr.r.ID == r.ID && !rr.releasable {
			return 0, fmt.Errorf("%w: region id %d already in the pool", errRegion, r.ID)
		}
	}
	n := int32(len(offs))
	first := c.takeIDs(n)
	rr := &regionRec{r: r, first: first, n: n}
	rr.r.RangeStarts = append([]uint64(nil), r.RangeStarts...)
	ri := int32(len(c.regions))
	c.regions = append(c.regions, rr)
	for i := n - 1; i >= 0; i-- {
		id := first + i
		s := &c.slots[id]
		*s = slotRec{off: offs[i], region: ri, gen: s.gen, prev: -1, next: -1, parent: -1, state: stateRetired}
		c.setState(s, stateFree)
		c.pushFree(id)
	}
	c.usable += int(n)
	c.index.reserve(len(c.slots))
	c.policy.setCapacity(c.policyCapacity())
	c.check()
	return int(n), nil
}

// carve returns the offsets of the slots of r: each aligned (as an address)
// to align, none crossing a registration range boundary.
func carve(r Region, slotSize, align uint64) ([]uint64, error) {
	if r.Size == 0 {
		return nil, fmt.Errorf("%w: region %d has size 0", errRegion, r.ID)
	}
	if uint64(r.Base)+r.Size < uint64(r.Base) {
		return nil, fmt.Errorf("%w: region %d at %#x + %d bytes overflows the address space", errRegion, r.ID, r.Base, r.Size)
	}
	bounds := make([]uint64, 0, len(r.RangeStarts)+2)
	bounds = append(bounds, 0)
	for i, s := range r.RangeStarts {
		if s <= bounds[len(bounds)-1] || s >= r.Size {
			return nil, fmt.Errorf("%w: region %d range start %d (index %d) must be ascending inside (0, %d)", errRegion, r.ID, s, i, r.Size)
		}
		bounds = append(bounds, s)
	}
	bounds = append(bounds, r.Size)
	// At most one slot per aligned stride, plus one per range (a range may
	// start mid-stride): sized once (up to carvePresize slots), not regrown
	// while carving.
	stride := (slotSize + align - 1) / align * align
	offs := make([]uint64, 0, min(r.Size/stride+uint64(len(bounds)), carvePresize))
	base := uint64(r.Base)
	largest := uint64(0)
	for i := 0; i+1 < len(bounds); i++ {
		lo, hi := bounds[i], bounds[i+1]
		largest = max(largest, hi-lo)
		for {
			a, ok := alignUp(base+lo, align)
			if !ok {
				break
			}
			off := a - base
			if off >= hi || hi-off < slotSize {
				break
			}
			offs = append(offs, off)
			lo = off + slotSize
		}
	}
	if len(offs) == 0 {
		return nil, fmt.Errorf("%w: region %d: no slot of %d bytes (aligned to %d) fits in its largest registration range of %d bytes",
			errRegion, r.ID, slotSize, align, largest)
	}
	if len(offs) > 1<<30 {
		return nil, fmt.Errorf("%w: region %d holds %d slots, more than %d", errRegion, r.ID, len(offs), 1<<30)
	}
	return offs, nil
}

func (c *Cache) takeIDs(n int32) int32 {
	for i, h := range c.holes {
		if h.n >= n {
			if h.n == n {
				c.holes = append(c.holes[:i], c.holes[i+1:]...)
			} else {
				c.holes[i] = idRange{h.first + n, h.n - n}
			}
			return h.first
		}
	}
	first := int32(len(c.slots))
	c.slots = append(c.slots, make([]slotRec, n)...)
	for i := first; i < first+n; i++ {
		c.slots[i].state = stateRetired
	}
	return first
}

// RemoveRegion starts draining a region (Trim): its free slots leave the
// free list, its ready blocks are evicted, blocks being written or read are
// evicted when their transfers and leases end. It reports whether the region
// is releasable already; otherwise it becomes releasable later and
// TakeReleasable reports it. It fails for a region the cache does not hold
// (or that is draining already).
func (c *Cache) RemoveRegion(id RegionID) (bool, error) {
	c.mu.Lock()
	defer c.unlock()
	if c.closed {
		return false, errClosed
	}
	var rr *regionRec
	for _, x := range c.regions {
		if x.r.ID == id && !x.releasable {
			rr = x
		}
	}
	if rr == nil || rr.draining {
		return false, fmt.Errorf("%w: region %d is not in the pool (or is already draining)", errUnknownRegion, id)
	}
	rr.draining = true
	c.usable -= int(rr.n)
	// Free slots leave the free list first: evicting the others may finish
	// the drain, which retires every slot of the region.
	for i := rr.first; i < rr.first+rr.n; i++ {
		if s := &c.slots[i]; s.state == stateFree {
			c.unlinkFree(i)
			c.setState(s, stateRetired)
		}
	}
	for i := rr.first; i < rr.first+rr.n; i++ {
		if c.slots[i].indexed() {
			c.evict(i, &c.st.Trimmed, true)
		}
	}
	c.policy.setCapacity(c.policyCapacity())
	done := c.maybeReleasable(rr)
	c.check()
	return done, nil
}

// TakeReleasable appends to dst the regions that finished draining since the
// last call and returns it: every slot free, no transfer outstanding. The
// caller may now unregister and unmap them; the cache forgets them.
func (c *Cache) TakeReleasable(dst []RegionID) []RegionID {
	c.mu.Lock()
	defer c.mu.Unlock()
	dst = append(dst, c.releasable...)
	c.releasable = c.releasable[:0]
	return dst
}

func (c *Cache) maybeReleasable(rr *regionRec) bool {
	if !rr.draining || rr.busy > 0 || rr.releasable {
		return rr.releasable
	}
	rr.releasable = true
	for i := rr.first; i < rr.first+rr.n; i++ {
		c.setState(&c.slots[i], stateRetired)
	}
	c.holes = append(c.holes, idRange{rr.first, rr.n})
	c.releasable = append(c.releasable, rr.r.ID)
	// Forget the region record; indices of later regions shift.
	for i, x := range c.regions {
		if x == rr {
			c.regions = append(c.regions[:i], c.regions[i+1:]...)
			for j := i; j < len(c.regions); j++ {
				y := c.regions[j]
				for k := y.first; k < y.first+y.n; k++ {
					c.slots[k].region = int32(j)
				}
			}
			break
		}
	}
	return true
}

func (c *Cache) policyCapacity() int { return max(c.usable-c.watermark, 0) }

// ---- free list ---------------------------------------------------------------

func (c *Cache) pushFree(i int32) {
	s := &c.slots[i]
	s.prev, s.next = -1, c.freeHead
	if c.freeHead >= 0 {
		c.slots[c.freeHead].prev = i
	}
	c.freeHead = i
	c.nFree++
}

func (c *Cache) unlinkFree(i int32) {
	s := &c.slots[i]
	if s.prev >= 0 {
		c.slots[s.prev].next = s.next
	} else {
		c.freeHead = s.next
	}
	if s.next >= 0 {
		c.slots[s.next].prev = s.prev
	}
	s.prev, s.next = -1, -1
	c.nFree--
}

// alloc takes a free slot into writing for key; -1 when none is free.
// With none free, it zeroes under the lock a slot this call released (see
// zeroHere) rather than refuse the store.
func (c *Cache) alloc(k Key, ns Namespace) int32 {
	for c.freeHead < 0 && len(c.toZero) > 0 {
		c.zeroHere()
	}
	i := c.freeHead
	if i < 0 {
		return -1
	}
	c.unlinkFree(i)
	s := &c.slots[i]
	s.gen++
	s.key, s.ns = k, ns
	c.setState(s, stateWriting)
	s.pending, s.readers, s.storing, s.demote = 1, 0, true, false
	s.parent, s.children = -1, 0
	c.setPart(s, nil)
	c.regions[s.region].busy++
	return i
}

// release frees a releasing slot once no reader and no transfer is left:
// at once, or, with Config.OnFree, through zeroing (see unlock); a slot
// Config.Demote accepted goes into demoting instead (see Demoted).
func (c *Cache) release(i int32) {
	s := &c.slots[i]
	if s.state != stateReleasing || s.readers > 0 || s.pending > 0 {
		return
	}
	c.setPart(s, nil)
	if s.demote {
		c.setState(s, stateDemoting)
		c.st.Demotions++
		c.toDemote = append(c.toDemote, demotion{c.handle(i), s.key})
		return
	}
	if c.onFree != nil && !c.regions[s.region].draining {
		c.setState(s, stateZeroing)
		c.toZero = append(c.toZero, c.handle(i))
		return
	}
	c.freeSlot(i)
}

// zeroHere calls Config.OnFree, with the lock held, on the last slot the
// current call released, and frees it: how a store that found no free slot
// uses the slots it evicted for itself (Stats.ZeroedUnderLock). Slots other
// calls are zeroing are never waited for.
func (c *Cache) zeroHere() {
	h := c.toZero[len(c.toZero)-1]
	c.toZero = c.toZero[:len(c.toZero)-1]
	c.zeroingLocked = true
	c.onFree(h)
	c.zeroingLocked = false
	c.st.ZeroedUnderLock++
	c.freeZeroed(int32(h.ID))
}

// freeZeroed frees a slot OnFree has zeroed and wakes Close when it was the
// last one zeroing.
func (c *Cache) freeZeroed(i int32) {
	c.freeSlot(i)
	if c.counts[stateZeroing] == 0 {
		c.zeroDone.Broadcast()
	}
}

// freeSlot puts a releasing or zeroing slot on the free list, or retires
// it when its region is draining.
func (c *Cache) freeSlot(i int32) {
	s := &c.slots[i]
	c.setState(s, stateFree)
	rr := c.regions[s.region]
	rr.busy--
	if rr.draining {
		c.setState(s, stateRetired)
		c.maybeReleasable(rr)
		return
	}
	c.pushFree(i)
}

func (c *Cache) handle(i int32) Slot {
	var h Slot
	c.fillHandle(&h, i)
	return h
}

// fillHandle writes slot i's handle into *d field by field (a Slot built
// by value and copied stalls on store forwarding; see accessed).
func (c *Cache) fillHandle(d *Slot, i int32) {
	s := &c.slots[i]
	r := &c.regions[s.region].r
	d.ID, d.Gen, d.Region, d.Off, d.Addr, d.Heads = SlotID(i), s.gen, r.ID, s.off, r.Base+uintptr(s.off), HeadRange{}
}
