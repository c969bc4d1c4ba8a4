package offload

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/transfer"
)

// engineHooks are injections: sim from package hostsim (and tests), the
// rest test-only.
type engineHooks struct {
	// sim is the host backend's simulated device (nil: the engine makes
	// its own and closes it).
	sim        *transfer.Sim
	loadDriver func() (*transfer.Driver, error)
	sys        *system
	tracker    *transfer.Tracker
	// beforeGrow runs on the growth thread before it registers plan[i]
	// (prefetched: mapped and prefaulted), after the pause check.
	beforeGrow func(i int)
	// growStep runs in the growth stages at the steps growStep names, with
	// the region's plan index and mapping; a non-nil error fails that step
	// as the step's own failure would (stepPrefault, stepPrefaulted: the
	// prefetch; stepCache: kvcache AddRegion).
	growStep func(i int, s growStep, r *mmapmem.Region) error
	// rangeLimit is the CUDA pinner's registration range limit (0: 64 GiB).
	rangeLimit int64
	// copyOptions configure the CUDA copy method.
	copyOptions transfer.CopyOptions
	// calibrate keeps the background calibration in cudafake tests (their
	// helper otherwise gives an empty table).
	calibrate bool
}

// poolRegion is one mapped, pinned region of the pool (or the staging
// region). The flags say how far mapRegion got, for unmapRegion.
type poolRegion struct {
	id          kvcache.RegionID
	r           *mmapmem.Region
	host        uint64   // address the copy layer knows it by
	rangeStarts []uint64 // offsets where a registration range begins (CUDA)
	pinned      bool     // registered (CUDA) or known to the simulation (host)
	mlock       bool
	known       []uint64 // bases of the host ranges told to the scheduler
	tracked     bool     // declared live to the gating Tracker
	planned     int64    // the plan's size for a pool region (Engine.committed counts it)
}

func newEngine(cfg Config, h engineHooks) (*Engine, error) {
	start := time.Now()
	cfg, numa, slot, err := withDefaults(cfg)
	if err != nil {
		return nil, err
	}
	if h.loadDriver == nil {
		h.loadDriver = transfer.LoadDriver
	}
	sys := hostSystem()
	if h.sys != nil {
		sys = *h.sys
	}
	choice, err := selectBackend(cfg.Backend, cfg.Device, h.loadDriver)
	if err != nil {
		return nil, err
	}
	if choice.name == BackendHost && cfg.Backend == BackendAuto && h.sim == nil && !layoutEmpty(cfg.Layout) {
		// The layout's addresses are device addresses and nothing can copy
		// them: the host backend would fail every Store as device-lost.
		return nil, fmt.Errorf("%w: Backend \"auto\": the Layout gives device addresses but %s; ask for Backend \"host\" with a hostsim.GPU to simulate, or fix the driver",
			ErrNoDriver, strings.TrimPrefix(choice.reason, "auto: "))
	}
	if choice.name == BackendCUDA && layoutEmpty(cfg.Layout) {
		// Only reachable with "auto": withDefaults refuses "cuda" without tensors.
		choice = backendChoice{name: BackendHost, reason: "auto: " + choice.reason + ", but the Layout gives no device addresses (LayerTensors, or Base and Stride), so the host backend simulates the GPU"}
	}
	node := numa.node
	if numa.auto && choice.name == BackendCUDA {
		node = sys.gpuNUMANode(choice.busID)
	}
	if node >= 0 {
		if err := sys.checkNode(node); err != nil {
			return nil, err
		}
	}
	// Everything proportional to the pool's size (the region plan, the
	// cache's slot table and key index, TinyLFU's sketch) is sized and
	// checked before any of it is allocated. withDefaults bounded the
	// sums and the region count; the memory check counts the tables.
	maxBlocks := int(cfg.PoolBytes / slotStride(slot))
	reserve := min(maxBlocks, kvcache.MaxSlots)
	lfuBlocks := maxBlocks
	if cfg.SkipMemoryCheck {
		// Unchecked, the tables are bounded instead (they are Go heap,
		// whose exhaustion is fatal): beyond the bound the slot table and
		// index grow with the regions actually added, and TinyLFU's
		// sketch stays at the bound.
		reserve = min(reserve, uncheckedReserveSlots)
		lfuBlocks = min(lfuBlocks, uncheckedReserveSlots)
	} else {
		tables := kvcache.ReserveBytes(reserve)
		if cfg.Policy == PolicyTinyLFU {
			tables += kvcache.TinyLFUBytes(lfuBlocks)
		}
		need, ok := addSizes(cfg.PoolBytes, max(cfg.StagingBytes, 0))
		if ok {
			need, ok = addSizes(need, tables)
		}
		if !ok {
			return nil, fmt.Errorf("%w: PoolBytes = %d plus StagingBytes = %d plus %d bytes of slot tables overflows int64", ErrInvalidConfig, cfg.PoolBytes, cfg.StagingBytes, tables)
		}
		if err := sys.checkFits(need, cfg.HostPinning == PinMlock, node); err != nil {
			return nil, err
		}
	}
	target := planTarget(cfg)
	plan := regionPlan(target, min(cfg.FirstRegionBytes, target), cfg.RegionBytes, slot)
	e := &Engine{cfg: cfg, hooks: h, backend: choice.name, backendReason: choice.reason, start: start,
		node: node, slot: slot, plan: plan, target: target, sys: sys, tracker: h.tracker, nsIDs: map[string]kvcache.Namespace{},
		staged: map[string]*Staging{}, reapKick: make(chan struct{}, 1), inflight: map[kvcache.RegionID]int{}, changed: make(chan struct{}), stopReap: make(chan struct{})}
	e.growCond = sync.NewCond(&e.growMu)
	if e.tracker == nil && transfer.InvariantsEnabled() {
		// Invariant builds (-race, -tags kvoinvariants) always run the
		// gating harness: regions poisoned when released (host backend),
		// every copy's host range checked live at submission and completion.
		e.tracker = transfer.NewTracker(e.poison)
		h.tracker = e.tracker
	}
	ok := false
	defer func() {
		if !ok {
			e.teardown()
		}
	}()
	if choice.name == BackendCUDA {
		if err := e.openCUDA(choice); err != nil {
			return nil, err
		}
	} else if err := e.openSim(); err != nil {
		return nil, err
	}
	spec, _ := kvLayoutSpec(e.cfg.Layout)
	if e.layout, err = kvcache.NewLayout(spec); err != nil {
		return nil, fmt.Errorf("%w: Layout: %w", ErrInvalidConfig, err)
	}
	if e.sched, err = transfer.New(e.dev, transfer.Config{
		MaxInFlightBytes: uint64(cfg.MaxInFlightBytes), MaxQueuedBytes: uint64(cfg.MaxQueuedBytes), Tracker: h.tracker,
	}); err != nil {
		return nil, err
	}
	if err := e.addDeviceRanges(); err != nil {
		return nil, err
	}
	var pol kvcache.Policy
	if cfg.Policy == PolicyTinyLFU {
		if pol, err = kvcache.NewTinyLFU(kvcache.TinyLFUConfig{MaxBlocks: lfuBlocks}); err != nil {
			return nil, err
		}
	}
	// MaxSlots reserves the cache's slot table and key index for the whole
	// pool up front: without it, each region added copied the slot table
	// and rehashed the index (O(slots so far) under the cache's lock; 4.5 s
	// over a 64 GiB pool of 8 KiB slots, measured by kvcache's
	// BenchmarkAddRegionGrowth).
	kcfg := kvcache.Config{Layout: e.layout, Policy: pol, LowWatermark: min(maxBlocks/64, 64), MaxSlots: reserve}
	if cfg.ZeroOnRelease {
		kcfg.OnFree = e.zeroSlot
	}
	if e.cache, err = kvcache.New(kcfg); err != nil {
		return nil, err
	}
	if cfg.StagingBytes > 0 {
		if e.stagingRegion, err = e.mapRegion(cfg.StagingBytes, false); err != nil {
			return nil, fmt.Errorf("offload: staging region: %w", err)
		}
		if e.stagingDev, err = e.stagingDevicePtr(e.stagingRegion); err != nil {
			return nil, err
		}
	}
	if err := e.addRegion(plan[0]); err != nil {
		return nil, err
	}
	e.stats.firstSlot.Store(int64(time.Since(start)))
	e.nextRegion, e.committed, e.growFrom = 1, plan[0], 1
	if len(plan) == 1 {
		e.stats.fullPool.Store(int64(time.Since(start)))
	}
	e.wg.Add(2)
	go e.grow()
	go e.reaper()
	ok = true
	return e, nil
}

// openSim sets up the host backend: the simulated GPU, with a layout given
// without tensors allocated densely in it.
func (e *Engine) openSim() error {
	var err error
	if e.sim = e.hooks.sim; e.sim == nil {
		if e.sim, err = transfer.NewSim(transfer.SimConfig{}); err != nil {
			return err
		}
		e.ownSim = true
	}
	e.dev = e.sim
	if layoutEmpty(e.cfg.Layout) {
		spec, _ := kvLayoutSpec(e.cfg.Layout)
		if err := e.allocDense(&spec); err != nil {
			return err
		}
		e.cfg.Layout = fromKVLayoutSpec(spec)
	}
	return nil
}

// allocDense places a layout given without tensors in the simulated device.
func (e *Engine) allocDense(spec *kvcache.LayoutSpec) error {
	probe := kvcache.DenseSpec(spec.Kind, spec.Geometry, spec.NumBlocks, denseProbeBase)
	l, err := kvcache.NewLayout(probe)
	if err != nil {
		return fmt.Errorf("%w: Layout: %w", ErrInvalidConfig, err)
	}
	n := l.SlotSize() * uint64(spec.NumBlocks)
	base, err := e.sim.MemAlloc(n)
	if err != nil {
		return err
	}
	e.denseAlloc = base
	*spec = kvcache.DenseSpec(spec.Kind, spec.Geometry, spec.NumBlocks, base)
	return nil
}

// addDeviceRanges tells the scheduler where the layout's tensors are: the
// union of the extents deviceTensors computes (which the CUDA backend also
// checks). Tensors may overlap (interleaved K/V: V starts inside K's
// extent and ends past it), so overlapping extents are merged into one
// range; merely adjacent ones stay separate, as they may be separate
// allocations.
func (e *Engine) addDeviceRanges() error {
	for _, r := range mergeExtents(e.deviceTensors()) {
		if err := e.sched.AddDeviceRange(r.start, r.end-r.start); err != nil {
			return fmt.Errorf("offload: device range [%#x, %#x) of %s: %w", r.start, r.end, r.name, err)
		}
	}
	return nil
}

// mergeExtents returns the union of ts as ranges sorted by start, merging
// extents that overlap (not those that only touch).
func mergeExtents(ts []deviceTensor) []deviceTensor {
	ts = slices.Clone(ts)
	slices.SortFunc(ts, func(a, b deviceTensor) int { return cmp.Compare(a.start, b.start) })
	var out []deviceTensor
	for _, t := range ts {
		if n := len(out); n > 0 && t.start < out[n-1].end {
			last := &out[n-1]
			last.end = max(last.end, t.end)
			last.name += " and " + t.name
			continue
		}
		out = append(out, t)
	}
	return out
}

// regionOptions are the mmapmem options of every region: mapped untouched
// (DeferPrefault), prefaulted afterwards by the engine or, on CUDA for a
// region registered without being prefetched, by the pinner range by range.
func (e *Engine) regionOptions() mmapmem.Options {
	return mmapmem.Options{NoTHP: e.cfg.HugePages == HugePagesNone, HugeTLB: e.cfg.HugePages == HugePagesHugeTLB,
		PrefaultThreads: e.cfg.PrefaultThreads, PrefaultStop: e.stopReap, BindNUMA: e.node >= 0, NUMANode: max(e.node, 0), DeferPrefault: true}
}

// mapRegion maps, prefaults and pins size bytes and makes them known to
// the copy layer, on the calling goroutine (New: the staging region and
// the first pool region). On error nothing of it is left mapped or pinned.
func (e *Engine) mapRegion(size int64, pool bool) (*poolRegion, error) {
	t0 := time.Now()
	r, err := mmapmem.New(size, e.regionOptions())
	if err != nil {
		return nil, err
	}
	pr := &poolRegion{r: r}
	t1 := time.Now()
	// On CUDA the region stays untouched: the pinner prefaults each
	// registration range while registering the one before (register's
	// pipelined path), so the whole takes about the larger of the two
	// instead of their sum. The host backend has nothing to overlap the
	// prefault with.
	if e.pinner == nil {
		if err := r.Prefault(0, r.Mapped()); err != nil {
			e.unmapRegion(pr)
			return nil, fmt.Errorf("offload: prefaulting a region of %d bytes: %w", size, err)
		}
	}
	e.recordMapped(pool, t0, t1)
	if err := e.pinMapped(pr, pool); err != nil {
		return nil, err
	}
	return pr, nil
}

// prefetchRegion maps pool region i of size bytes and prefaults it whole on
// its prefault threads: the prefetch stage of background growth, which
// needs no CUDA context. The region is then resident, so registering it
// prefaults nothing again (mmapmem.Region.Deferred is false). On error
// nothing of it is left mapped.
func (e *Engine) prefetchRegion(i int, size int64) (*poolRegion, error) {
	t0 := time.Now()
	r, err := mmapmem.New(size, e.regionOptions())
	if err != nil {
		return nil, fmt.Errorf("offload: mapping pool region %d (%d bytes): %w", i, size, err)
	}
	pr := &poolRegion{r: r}
	t1 := time.Now()
	err = e.step(i, stepPrefault, r)
	if err == nil {
		err = r.Prefault(0, r.Mapped())
	}
	if err == nil {
		err = e.step(i, stepPrefaulted, r)
	}
	if err != nil {
		e.unmapRegion(pr)
		return nil, fmt.Errorf("offload: prefaulting pool region %d (%d bytes): %w", i, size, err)
	}
	e.recordMapped(true, t0, t1)
	return pr, nil
}

// recordMapped adds the map (t0 to t1) and prefault (t1 to now) times of a
// region to the counters, and to the growth steps for a pool region.
func (e *Engine) recordMapped(pool bool, t0, t1 time.Time) {
	now := time.Now()
	e.stats.pinNanos.Add(int64(now.Sub(t0)))
	if pool {
		e.stats.steps.mapNanos.Add(int64(t1.Sub(t0)))
		e.stats.steps.prefaultNanos.Add(int64(now.Sub(t1)))
	}
}

// pinMapped pins a mapped region, tells the scheduler its host ranges and
// declares it live to the gating tracker (pool regions). On error it
// unmaps the region: nothing of it is left mapped or pinned.
func (e *Engine) pinMapped(pr *poolRegion, pool bool) error {
	t0 := time.Now()
	if err := e.pinRegion(pr); err != nil {
		e.unmapRegion(pr)
		return err
	}
	t1 := time.Now()
	// One scheduler host range per registration range, so that copies are
	// never coalesced across two registrations.
	// On CUDA the copier may look up each range's device pointer, on a
	// thread with the context current.
	size := uint64(pr.r.Len())
	starts := append([]uint64{0}, pr.rangeStarts...)
	err := e.onThread(func() error {
		for i, off := range starts {
			end := size
			if i+1 < len(starts) {
				end = starts[i+1]
			}
			if err := e.sched.AddHostRange(pr.host+off, end-off); err != nil {
				return err
			}
			pr.known = append(pr.known, pr.host+off)
		}
		return nil
	})
	if err == nil && pool && e.tracker != nil {
		if err = e.tracker.Live(pr.host, size); err == nil {
			pr.tracked = true
		}
	}
	if err != nil {
		e.unmapRegion(pr)
		return fmt.Errorf("offload: host ranges of a region of %d bytes: %w", size, err)
	}
	e.stats.pinNanos.Add(int64(time.Since(t0)))
	if pool {
		e.stats.steps.pinNanos.Add(int64(t1.Sub(t0)))
		e.stats.steps.hostRangeNanos.Add(int64(time.Since(t1)))
	}
	return nil
}

// pinRegion pins a mapped region: cuMemHostRegister in ≤ 64 GiB ranges on
// CUDA; mlock (Config.HostPinning) and registration with the simulation
// on the host backend.
func (e *Engine) pinRegion(pr *poolRegion) error {
	r := pr.r
	if e.pinner != nil {
		if err := e.pinner.Register(r); err != nil {
			return fmt.Errorf("offload: pinning a region of %d bytes: %w", r.Len(), err)
		}
		pr.pinned = true
		e.stats.pinCalls.Add(1)
		pr.host = uint64(r.Addr())
		for _, rg := range e.pinner.Ranges(r)[1:] {
			pr.rangeStarts = append(pr.rangeStarts, uint64(rg.Off))
		}
		return nil
	}
	if e.cfg.HostPinning == PinMlock {
		if err := unix.Mlock(r.Bytes()); err != nil {
			return fmt.Errorf("%w: mlock of %d bytes: %w", ErrInsufficientMemory, r.Len(), err)
		}
		pr.mlock = true
	}
	host, err := e.sim.RegisterHost(r.Bytes())
	if err != nil {
		return err
	}
	pr.host = host
	pr.pinned = true
	e.stats.pinCalls.Add(1)
	return nil
}

// unmapRegion undoes mapRegion (as far as it got). A failed unpin is
// retried once (the pinner keeps the ranges it could not unpin, and a
// second Unregister retries just those); a region still pinned is not
// unmapped under the driver (mmapmem refuses while it is held). Every
// failure is returned and counted in Stats (TeardownErrors,
// TeardownError): callers that cannot return it (trim, growth rollback)
// leave it to Stats.
func (e *Engine) unmapRegion(pr *poolRegion) error {
	t0 := time.Now()
	var errs []error
	e.slotMem.Delete(pr.id)
	if pr.tracked {
		if err := e.tracker.Released(pr.host, uint64(pr.r.Len())); err != nil {
			errs = append(errs, err)
		}
	}
	for _, base := range pr.known {
		if err := e.sched.RemoveHostRange(base); err != nil {
			errs = append(errs, fmt.Errorf("forgetting host range %#x: %w", base, err))
		}
	}
	pr.known = nil
	if pr.pinned {
		var err error
		if e.pinner != nil {
			if err = e.pinner.Unregister(pr.r); err != nil {
				err = e.pinner.Unregister(pr.r)
			}
		} else {
			err = e.sim.UnregisterHost(pr.host)
		}
		e.stats.unpinCalls.Add(1)
		if err != nil {
			errs = append(errs, fmt.Errorf("unpinning a region of %d bytes: %w", pr.r.Len(), err))
		} else {
			pr.pinned = false
		}
	}
	if pr.mlock {
		if err := unix.Munlock(pr.r.Bytes()); err != nil {
			errs = append(errs, fmt.Errorf("munlock of %d bytes: %w", pr.r.Len(), err))
		}
		pr.mlock = false
	}
	if !pr.pinned {
		if err := pr.r.Close(); err != nil {
			errs = append(errs, fmt.Errorf("unmapping a region of %d bytes: %w", pr.r.Len(), err))
		}
	}
	e.stats.unpinNanos.Add(int64(time.Since(t0)))
	err := errors.Join(errs...)
	if err != nil {
		err = fmt.Errorf("offload: releasing a region: %w", err)
		e.stats.teardownErrors.Add(1)
		msg := err.Error()
		e.teardownErr.Store(&msg)
	}
	return err
}

// poison fills a released pool region with transfer.PoisonByte on the
// host backend (the gating harness's use-after-free detector).
func (e *Engine) poison(addr, n uint64) {
	if e.sim != nil {
		_ = e.sim.Fill(addr, n, transfer.PoisonByte)
	}
}

// zeroSlot zeroes a slot returning to the free list (Config.ZeroOnRelease):
// called by the cache (kvcache.Config.OnFree) once every copy and reader on
// it has ended, before the slot can be handed out again and while its region
// cannot be released; outside the cache's lock, on the goroutine of the call
// that released it, possibly alongside other zeroSlot calls.
func (e *Engine) zeroSlot(s kvcache.Slot) {
	if mem, ok := e.slotMem.Load(s.Region); ok {
		clear(mem.([]byte)[s.Off : s.Off+uint64(e.slot)])
		e.stats.zeroed.Add(1)
	}
}

// addRegion maps and pins one pool region and hands it to the cache, on
// the calling goroutine (New's first region).
func (e *Engine) addRegion(size int64) error {
	pr, err := e.mapRegion(size, true)
	if err != nil {
		return err
	}
	pr.planned = size
	return e.publishRegion(pr)
}

// uncommit forgets bytes of pool regions that were dropped before joining
// the pool or trimmed out of it.
func (e *Engine) uncommit(bytes int64) {
	e.growMu.Lock()
	e.committed -= bytes
	e.growMu.Unlock()
}

// dropGrowing unmaps a region growth mapped but will not publish.
func (e *Engine) dropGrowing(pr *poolRegion) {
	e.unmapRegion(pr)
	e.uncommit(pr.planned)
}

// nextSizeLocked is the size of plan region i that growth may map now,
// reserving it in committed; false when growth has reached its target or
// the plan's end. A region that fits only in part is shrunk to whole
// slots, and the plan ends there. growMu held.
func (e *Engine) nextSizeLocked(i int) (int64, bool) {
	if i >= len(e.plan) {
		return 0, false
	}
	size := min(e.plan[i], (e.target-e.committed)/e.slot*e.slot)
	if size < e.slot {
		e.plan = e.plan[:i]
		if e.nextRegion == len(e.plan) && e.stats.fullPool.Load() == 0 {
			e.stats.fullPool.Store(int64(time.Since(e.start)))
		}
		return 0, false
	}
	if size < e.plan[i] {
		e.plan[i] = size
		e.plan = e.plan[:i+1]
	}
	e.committed += size
	return size, true
}

// checkRoom re-checks, before growth maps a region of size bytes, that
// the machine still holds it plus Config.MemoryHeadroomBytes (other
// processes pin and allocate meanwhile: eight ranks started together all
// pass New's check). The error stops growth (Stats.GrowthError).
func (e *Engine) checkRoom(size int64) error {
	if e.cfg.SkipMemoryCheck {
		return nil
	}
	need, ok := addSizes(size, e.cfg.MemoryHeadroomBytes)
	if !ok {
		return fmt.Errorf("%w: region of %d bytes plus headroom %d bytes overflows", ErrInvalidConfig, size, e.cfg.MemoryHeadroomBytes)
	}
	if err := e.sys.checkFits(need, e.cfg.HostPinning == PinMlock, e.node); err != nil {
		return fmt.Errorf("offload: growth stopped before a region of %d bytes (with %d bytes of headroom kept): %w", size, e.cfg.MemoryHeadroomBytes, err)
	}
	return nil
}

// addSizes is a+b for non-negative sizes, false on overflow.
func addSizes(a, b int64) (int64, bool) {
	if a > math.MaxInt64-b {
		return 0, false
	}
	return a + b, true
}

// uncheckedReserveSlots bounds the slots the cache's tables and TinyLFU's
// sketch are sized for up front when Config.SkipMemoryCheck leaves them
// unchecked (a few MiB).
const uncheckedReserveSlots = 1 << 16

// mulSizes is a×b for non-negative sizes, false on overflow.
func mulSizes(a, b int64) (int64, bool) {
	if a < 0 || b < 0 {
		return 0, false
	}
	if a != 0 && b > math.MaxInt64/a {
		return 0, false
	}
	return a * b, true
}

// publishRegion hands a pinned pool region to the cache and counts it as
// owned. On error the region is unpinned and unmapped.
func (e *Engine) publishRegion(pr *poolRegion) error {
	e.memMu.Lock()
	e.nextID++
	pr.id = e.nextID
	e.memMu.Unlock()
	if e.cfg.ZeroOnRelease {
		e.slotMem.Store(pr.id, pr.r.Bytes())
	}
	t0 := time.Now()
	size := pr.r.Len()
	if _, err := e.cache.AddRegion(kvcache.Region{ID: pr.id, Base: uintptr(pr.host), Size: uint64(size), RangeStarts: pr.rangeStarts}); err != nil {
		e.unmapRegion(pr)
		return err
	}
	e.stats.steps.cacheNanos.Add(int64(time.Since(t0)))
	e.memMu.Lock()
	e.regions = append(e.regions, pr)
	e.owned += size
	e.memMu.Unlock()
	return nil
}

// growStep names a point of background growth that engineHooks.growStep
// observes.
type growStep int

const (
	// stepPrefault: the prefetch stage mapped the region and is about to
	// prefault it.
	stepPrefault growStep = iota
	// stepPrefaulted: the prefetch stage prefaulted the region and is about
	// to hand it to the growth thread.
	stepPrefaulted
	// stepCache: the publish stage is about to add the pinned region to
	// the cache.
	stepCache
)

// step runs the growStep hook, if any.
func (e *Engine) step(i int, s growStep, r *mmapmem.Region) error {
	if e.hooks.growStep == nil {
		return nil
	}
	return e.hooks.growStep(i, s, r)
}

// growItem is a pool region (plan index i) passed between growth stages,
// or the error that stopped the stage before it.
type growItem struct {
	i   int
	pr  *poolRegion
	err error
}

// growth is the state the stages of one background growth share; the
// fields are guarded by the engine's growMu.
type growth struct {
	e *Engine
	// ready is the region the prefetch stage hands to the growth thread
	// (nil: none waiting).
	ready *growItem
	// prefetching: the prefetch stage is mapping or prefaulting a region.
	prefetching bool
	// prefetchDone: the prefetch stage has ended; pinDone: the growth
	// thread has stopped taking regions.
	prefetchDone, pinDone bool
	// calibrated: the growth thread has run the copy-method calibration.
	calibrated bool
}

// grow adds plan[1:] to the pool in a pipeline of three stages, each on a
// goroutine of its own and each taking the regions in plan order, so that
// the steps of neighbouring regions overlap:
//
//   - prefetch maps region i+1 and prefaults it whole on its prefault
//     threads (CPU work, no driver call),
//   - this goroutine, locked to its OS thread with the CUDA context current
//     (never unlocked: the thread, with its CUDA state, exits with the
//     goroutine), registers region i and tells the scheduler its host
//     ranges,
//   - publish adds region i-1 to the cache (kvcache AddRegion, under the
//     cache's lock) and counts it as owned;
//     the last publication stamps Stats.FullPool.
//
// Each stage hands its region to the next one at a time (a region is
// handed over only once the previous one was taken), so at most one region
// is prefetched ahead of the one registering, and one registered region
// waits for publication. The first error of any stage
// stops growth: later regions are dropped (unpinned and unmapped), earlier
// ones still join, and WaitGrown reports the error. PauseGrowth stops the
// growth thread from taking another region to register, and the prefetch
// stage from mapping another (the one it prefetched meanwhile is held).
// Once the stages have ended (the
// pool grown, or growth stopped by an error) the copy methods are
// calibrated, on this thread, with no prefault competing for the CPUs;
// only then does WaitGrown return.
func (e *Engine) grow() {
	defer e.wg.Done()
	runtime.LockOSThread()
	if err := e.initGrowThread(); err != nil {
		e.growFailed(err)
		e.endGrowth()
		return
	}
	g := &growth{e: e}
	pinned := make(chan growItem)
	var stages sync.WaitGroup
	stages.Go(g.prefetch)
	stages.Go(func() { g.publish(pinned) })
	for {
		it, ok := g.next()
		if !ok {
			break
		}
		if it.err != nil {
			e.growFailed(it.err)
			break
		}
		if e.hooks.beforeGrow != nil {
			e.hooks.beforeGrow(it.i)
		}
		if err := e.pinMapped(it.pr, true); err != nil {
			e.uncommit(it.pr.planned)
			e.growFailed(err)
			break
		}
		pinned <- it
	}
	e.growMu.Lock()
	g.pinDone = true
	held := g.ready
	g.ready = nil
	e.growCond.Broadcast()
	e.growMu.Unlock()
	if held != nil && held.pr != nil {
		e.dropGrowing(held.pr)
	}
	close(pinned)
	stages.Wait()
	e.growMu.Lock()
	calibrate := !e.stopGrow && !g.calibrated
	e.growMu.Unlock()
	if calibrate {
		e.calibrate()
	}
	e.endGrowth()
}

// stoppedLocked reports whether growth must stop: Close, or an error in
// any stage. The caller holds growMu.
func (e *Engine) stoppedLocked() bool { return e.stopGrow || e.growErr != nil }

// growFailed records the first error of background growth and wakes every
// stage waiting on growCond, so that they stop.
func (e *Engine) growFailed(err error) {
	e.growMu.Lock()
	if e.growErr == nil {
		e.growErr = err
	}
	e.growCond.Broadcast()
	e.growMu.Unlock()
}

// endGrowth marks background growth finished, for WaitGrown.
func (e *Engine) endGrowth() {
	e.growMu.Lock()
	e.growDone = true
	e.growCond.Broadcast()
	e.growMu.Unlock()
}

// next waits for the next region to register, and reports false when
// there is none (the plan done, or growth stopped). While growth is paused
// it takes none: a region the prefetch stage hands over meanwhile is held
// until growth resumes. While paused, once the prefetch stage is idle, it
// runs the copy-method calibration (if not done yet), so that a long pause
// does not leave the copier uncalibrated.
func (g *growth) next() (growItem, bool) {
	e := g.e
	e.growMu.Lock()
	defer e.growMu.Unlock()
	for !e.stoppedLocked() {
		switch {
		case g.ready == nil && g.prefetchDone:
			// Nothing left to register: a pause has nothing to hold.
			return growItem{}, false
		case e.paused && !g.calibrated && !g.prefetching:
			g.calibrated = true
			e.growMu.Unlock()
			e.calibrate()
			e.growMu.Lock()
			continue
		case e.paused:
		case g.ready != nil:
			it := *g.ready
			g.ready = nil
			e.growCond.Broadcast()
			return it, true
		}
		e.growCond.Wait()
	}
	return growItem{}, false
}

// prefetch is the first growth stage: it maps and prefaults plan[1:] in
// order, each region handed to the growth thread (through g.ready) before
// the next starts, and starts none while growth is paused. It ends when
// the plan is done, growth stops, or the growth thread has stopped taking
// regions; a region it cannot hand over then is unmapped.
func (g *growth) prefetch() {
	e := g.e
	defer func() {
		e.growMu.Lock()
		g.prefetchDone = true
		e.growCond.Broadcast()
		e.growMu.Unlock()
	}()
	e.growMu.Lock()
	from := e.growFrom
	e.growMu.Unlock()
	for i := from; ; i++ {
		e.growMu.Lock()
		if i >= len(e.plan) {
			// Nothing left: a pause has nothing to hold.
			e.growMu.Unlock()
			return
		}
		for e.paused && !e.stoppedLocked() {
			e.growCond.Wait()
		}
		if e.stoppedLocked() {
			e.growMu.Unlock()
			return
		}
		size, ok := e.nextSizeLocked(i)
		if !ok {
			e.growMu.Unlock()
			return
		}
		g.prefetching = true
		e.growMu.Unlock()
		err := e.checkRoom(size)
		var pr *poolRegion
		if err == nil {
			pr, err = e.prefetchRegion(i, size)
		}
		if err != nil {
			e.uncommit(size)
		} else {
			pr.planned = size
		}
		e.growMu.Lock()
		g.prefetching = false
		e.growCond.Broadcast()
		for g.ready != nil && !g.pinDone {
			e.growCond.Wait()
		}
		gone := g.pinDone
		if !gone {
			g.ready = &growItem{i: i, pr: pr, err: err}
			e.growCond.Broadcast()
		}
		e.growMu.Unlock()
		if gone && pr != nil {
			e.dropGrowing(pr)
		}
		if gone || err != nil {
			return
		}
	}
}

// publish is the last growth stage: it adds the pinned regions to the cache
// in order and counts them as owned; the last one stamps Stats.FullPool.
// After Close or a failure of its own it unpins and unmaps what it gets
// instead (a failure of a later region in an earlier stage does not stop
// the regions before it from joining). It ends when in is closed.
func (g *growth) publish(in <-chan growItem) {
	e := g.e
	failed := false
	for it := range in {
		e.growMu.Lock()
		drop := failed || e.stopGrow
		e.growMu.Unlock()
		if drop {
			e.dropGrowing(it.pr)
			continue
		}
		err := e.step(it.i, stepCache, it.pr.r)
		if err != nil {
			e.dropGrowing(it.pr)
		} else if err = e.publishRegion(it.pr); err != nil {
			e.uncommit(it.pr.planned)
		}
		if err != nil {
			failed = true
			e.growFailed(fmt.Errorf("offload: adding pool region %d to the cache: %w", it.i, err))
			continue
		}
		e.growMu.Lock()
		e.nextRegion++
		if e.nextRegion == len(e.plan) {
			e.stats.fullPool.Store(int64(time.Since(e.start)))
		}
		e.growMu.Unlock()
	}
}

func (e *Engine) waitGrown(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() {
		e.growMu.Lock()
		e.growCond.Broadcast()
		e.growMu.Unlock()
	})
	defer stop()
	e.growMu.Lock()
	defer e.growMu.Unlock()
	for !e.growDone && ctx.Err() == nil {
		e.growCond.Wait()
	}
	switch {
	case e.growErr != nil:
		return fmt.Errorf("%w: %w", ErrGrowth, e.growErr)
	case e.growDone && e.nextRegion < len(e.plan):
		return fmt.Errorf("%w: growth stopped by Close", ErrClosed)
	case e.growDone:
		return nil
	}
	return ctx.Err()
}
