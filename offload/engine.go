package offload

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/internal/tier/cluster"
	"github.com/kvoffload/kvoffload/internal/tiered"
	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/register"
	"github.com/kvoffload/kvoffload/transfer"
)

// Engine is the offload engine; its methods are safe for concurrent use.
type Engine struct {
	// Set by New and never changed.
	cfg       Config
	blockBits sync.Pool // *[]uint64, a bit per layout block (checkBlocks)
	// calls traces Store and Load calls (traceCallsEnv; nil: off).
	calls *callTracer
	// loadResults holds *[]kvcache.LoadResult, the lookups of a Load
	// (loadLeased), used only while the call runs: a Load of 2048 keys
	// otherwise allocated 112 KiB a call, and the garbage of every op
	// paced the GC, whose pauses landed in calls.
	loadResults   sync.Pool
	backend       Backend
	backendReason string
	start         time.Time
	hooks         engineHooks
	sys           system
	node          int
	slot          int64
	layout        *kvcache.Layout
	cache         index          // the block index: kc, or the node's (Dial); locks itself
	kc            *kvcache.Cache // the embedded index (New); nil in an engine of Dial
	sched         *transfer.Scheduler
	tracker       *transfer.Tracker

	// The copy device. Set by New; the CUDA fields are nil on the host
	// backend, sim is nil on CUDA.
	dev        transfer.Device  // the Sim or the CUDA device
	sim        *cudadev.Sim     // the host backend's simulated device
	ownSim     bool             // the engine made sim, and closes it
	denseAlloc uint64           // the layout's tensors allocated in sim (0: none)
	gpu        *cudadev.Context // the device's primary context
	cudaDev    *cudadev.CUDA
	pinner     register.Pinner
	events     bool // ops carry CUDA events (CUDA backend)

	// Atomics, read by Stats and the calls at any time.
	stats counters
	lost  atomic.Pointer[error] // the sticky error that lost the device
	// teardownErr is the last error releasing a region (Stats.Pool.TeardownError).
	teardownErr atomic.Pointer[string]
	// calibration is what the growth goroutine reported of calibrating
	// the copy methods, which it does once growth has ended (or while it
	// is paused).
	calibration atomic.Pointer[string]

	// Lifecycle: closed is set once by Close; closeMu is held (read) by
	// calls in progress (enter, leave), and Close takes it to drain them.
	closed  atomic.Bool
	closeMu sync.RWMutex
	ops     sync.WaitGroup // ops not finished
	wg      sync.WaitGroup // grow and reaper goroutines

	growth  growthState
	memory  poolMemory
	stage   stagingArea
	reaping reaperState
	names   namespaces
	hub     eventHub     // Events' streams (events.go)
	slotMem sync.Map     // RegionID → the region's bytes, for ZeroOnRelease and the disk and cluster tiers
	disk    *tiered.Tier // the disk tier (Config.Disk), nil without one
	// diskErr is why a configured disk tier is off (no usable directory
	// at New): Stats.Disk.Error.
	diskErr string
	// background are the PrefetchBestEffort calls running (prefetch.go).
	background backgroundPrefetches
	// cluster is the cluster tier (Config.Cluster), nil without one; it
	// connects in the background when the cluster did not answer at New.
	cluster *cluster.Store
	views   rankViews // Rank's (rank.go)
	// dial is the node connection of an engine of Dial (dial.go), nil
	// in one of New.
	dial *dialState
}

// growthState is background growth's plan and progress; mu guards every
// field, and cond (on mu) wakes the growth stages and WaitGrown.
type growthState struct {
	mu     sync.Mutex
	cond   *sync.Cond
	paused bool  // PauseGrowth
	stop   bool  // Close: growth ends after the region in progress
	done   bool  // the running growth has ended
	err    error // why growth stopped (Stats.Pool.GrowthError), until GrowTo
	next   int   // the plan index of the next region to prefetch
	plan   []int64
	// target is the bytes of pool regions growth may have mapped at once
	// (PoolBytes, or MaxCachedBytes when smaller; Trim lowers it to what is
	// left, GrowTo raises it); committed is the bytes of pool regions
	// mapped by New or growth and not yet trimmed or dropped (planned
	// sizes). Growth maps a region only while committed + its size ≤
	// target. from is the plan index the running growth starts at.
	target, committed int64
	from              int
}

// poolMemory is the pool's regions; mu guards every field.
type poolMemory struct {
	mu       sync.Mutex
	regions  []*poolRegion // in the cache, oldest first
	draining map[kvcache.RegionID]*poolRegion
	nextID   kvcache.RegionID
	owned    int64 // bytes of the regions in the pool
	// inflight counts, per region, the slots with a copy in flight;
	// changed is closed and replaced whenever a region is freed or its
	// in-flight count drops to zero, waking Trim.
	inflight map[kvcache.RegionID]int
	changed  chan struct{}
}

// stagingArea is the reserved staging region and the buffers carved from
// it. region and dev are set by New; used and buffers are guarded by the
// engine's memory.mu.
type stagingArea struct {
	region  *poolRegion
	dev     uint64 // device address of the region
	used    int64
	buffers map[string]*Staging
}

// reaperState drives the reaper goroutine: kick wakes it, stop ends it,
// and mu serialises reap.
type reaperState struct {
	mu   sync.Mutex
	kick chan struct{}
	stop chan struct{}
}

// namespaces are the cache's namespace ids by name; mu guards ids.
type namespaces struct {
	mu  sync.Mutex
	ids map[string]kvcache.Namespace
}

// Lease keeps the blocks Lookup found from eviction until Release or Load.
type Lease struct {
	eng      *Engine
	keys     []Key
	slots    []kvcache.Slot
	released atomic.Bool
}

// leasedKeys returns the leased keys (the prefix Lookup found), in order.
func (l *Lease) leasedKeys() []Key { return append([]Key(nil), l.keys...) }

// checkOpen returns ErrClosed after Close.
func (e *Engine) checkOpen(call string) error {
	if e.closed.Load() {
		return fmt.Errorf("%w: %s after Close", ErrClosed, call)
	}
	return nil
}

// Config returns the engine's configuration, defaults filled in.
func (e *Engine) Config() Config { return e.cfg }

// Lookup returns how many leading keys are ready in the pool, never
// blocking.
func (e *Engine) Lookup(keys []Key, opts LookupOptions) (LookupResult, error) {
	if err := e.checkOpen("Lookup"); err != nil {
		return LookupResult{}, err
	}
	return e.lookup(keys, opts)
}

// Store copies GPU blocks blockIDs[i] to the pool under keys[i], not
// waiting.
func (e *Engine) Store(ctx context.Context, keys []Key, blockIDs []int, opts StoreOptions) (op *Op, err error) {
	if e.calls.begin("Store", len(keys)) {
		defer func() { e.calls.end(err) }()
	}
	if err := e.checkOpen("Store"); err != nil {
		return nil, err
	}
	if err := e.checkBlocks("Store", keys, blockIDs); err != nil {
		return nil, err
	}
	e.tracePoint("checked")
	return e.store(ctx, e.layout, keys, blockIDs, opts)
}

// Load copies keys' blocks to GPU blocks blockIDs[i], not waiting.
func (e *Engine) Load(ctx context.Context, keys []Key, blockIDs []int, opts LoadOptions) (op *Op, err error) {
	if e.calls.begin("Load", len(keys)) {
		defer func() { e.calls.end(err) }()
	}
	if err := e.checkOpen("Load"); err != nil {
		return nil, err
	}
	if err := e.checkBlocks("Load", keys, blockIDs); err != nil {
		return nil, err
	}
	e.tracePoint("checked")
	return e.load(ctx, e.layout, keys, blockIDs, opts)
}

// Delete removes keys and returns how many were present.
func (e *Engine) Delete(keys []Key) (int, error) {
	if err := e.checkOpen("Delete"); err != nil {
		return 0, err
	}
	return e.delete(keys), nil
}

// Clear removes every block stored with namespace and returns how many.
func (e *Engine) Clear(namespace string) (int, error) {
	if err := e.checkOpen("Clear"); err != nil {
		return 0, err
	}
	return e.clear(namespace), nil
}

// Release gives the lease's blocks back to the policy.
func (l *Lease) Release() error {
	if l.released.Swap(true) {
		return ErrReleased
	}
	l.eng.unlease(l.slots)
	return nil
}

// checkBlocks validates the arguments of Store and Load.
func (e *Engine) checkBlocks(call string, keys []Key, blockIDs []int) error {
	if err := e.checkDialed(call); err != nil {
		return err
	}
	if len(keys) != len(blockIDs) {
		return fmt.Errorf("%w: %s: %d keys but %d block ids", ErrInvalidArgument, call, len(keys), len(blockIDs))
	}
	n := e.cfg.Layout.NumBlocks
	// A bit per block of the layout, pooled: the ids this call marks are
	// cleared again before the set goes back (a map of the call's ids
	// cost about 25 ns an id, 50 µs for 2048 blocks).
	bp, _ := e.blockBits.Get().(*[]uint64)
	if bp == nil {
		b := make([]uint64, (n+63)/64)
		bp = &b
	}
	bits := *bp
	marked := 0
	defer func() {
		for _, id := range blockIDs[:marked] {
			bits[id>>6] = 0
		}
		e.blockBits.Put(bp)
	}()
	for i, id := range blockIDs {
		if id < 0 || id >= n {
			return fmt.Errorf("%w: %s: block id %d (index %d) outside the layout's %d blocks", ErrInvalidArgument, call, id, i, n)
		}
		w, bit := id>>6, uint64(1)<<(id&63)
		if bits[w]&bit != 0 {
			return fmt.Errorf("%w: %s: block id %d appears twice (index %d)", ErrInvalidArgument, call, id, i)
		}
		bits[w] |= bit
		marked++
	}
	return nil
}
