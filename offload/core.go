package offload

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/transfer"
	"github.com/kvoffload/kvoffload/transfer/cudacopy"
)

// engineHooks are test-only injections.
type engineHooks struct {
	loadDriver func() (cuda.Driver, error)
	sys        *system
	tracker    *transfer.Tracker
	// beforeGrow runs on the growth goroutine before it pins plan[i].
	beforeGrow func(i int)
	// rangeLimit is the CUDA pinner's registration range limit (0: 64 GiB).
	rangeLimit int64
	// copyOptions configure the CUDA copy method.
	copyOptions cudacopy.Options
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
}

func newEngine(cfg Config, h engineHooks) (*Engine, error) {
	start := time.Now()
	cfg, numa, slot, err := withDefaults(cfg)
	if err != nil {
		return nil, err
	}
	if h.loadDriver == nil {
		h.loadDriver = cuda.Load
	}
	sys := hostSystem()
	if h.sys != nil {
		sys = *h.sys
	}
	choice, err := selectBackend(cfg.Backend, cfg.Device, h.loadDriver)
	if err != nil {
		return nil, err
	}
	if choice.name == BackendCUDA && layoutEmpty(cfg.Layout) {
		// Only reachable with "auto": withDefaults refuses "cuda" without tensors.
		choice = backendChoice{name: BackendHost, reason: "auto: " + choice.reason + ", but the Layout gives no device addresses (LayerTensors, or Base and Stride), so the host backend simulates the GPU"}
	}
	node := numa.node
	if numa.auto && choice.name == BackendCUDA {
		node = sys.gpuNUMANode(choice.busID)
	}
	plan := regionPlan(cfg.PoolBytes, cfg.FirstRegionBytes, cfg.RegionBytes, slot)
	if !cfg.SkipMemoryCheck {
		need := cfg.PoolBytes + max(cfg.StagingBytes, 0)
		if err := sys.checkFits(need, cfg.HostPinning == PinMlock, node); err != nil {
			return nil, err
		}
	}
	e := &Engine{cfg: cfg, hooks: h, backend: choice.name, backendReason: choice.reason, start: start,
		node: node, slot: slot, plan: plan, tracker: h.tracker, nsIDs: map[string]kvcache.Namespace{},
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
	maxBlocks := int(cfg.PoolBytes / slot)
	if cfg.Policy == PolicyTinyLFU {
		if pol, err = kvcache.NewTinyLFU(kvcache.TinyLFUConfig{MaxBlocks: maxBlocks}); err != nil {
			return nil, err
		}
	}
	// MaxSlots reserves the cache's slot table and key index for the whole
	// pool up front: without it, each region added copied the slot table
	// and rehashed the index (O(slots so far) under the cache's lock; 4.5 s
	// over a 64 GiB pool of 8 KiB slots, measured by kvcache's
	// BenchmarkAddRegionGrowth).
	kcfg := kvcache.Config{Layout: e.layout, Policy: pol, LowWatermark: min(maxBlocks/64, 64), MaxSlots: min(maxBlocks, kvcache.MaxSlots)}
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
	e.nextRegion = 1
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
	if e.sim = e.cfg.Sim; e.sim == nil {
		if e.sim, err = NewSimGPU(SimOptions{}); err != nil {
			return err
		}
		e.ownSim = true
	}
	e.dev = e.sim.sim
	if layoutEmpty(e.cfg.Layout) {
		spec, _ := kvLayoutSpec(e.cfg.Layout)
		if err := e.allocDense(&spec); err != nil {
			return err
		}
		e.cfg.Layout = fromKVLayoutSpec(spec)
	}
	return nil
}

// allocDense places a layout given without tensors in the SimGPU.
func (e *Engine) allocDense(spec *kvcache.LayoutSpec) error {
	probe := kvcache.DenseSpec(spec.Kind, spec.Geometry, spec.NumBlocks, denseProbeBase)
	l, err := kvcache.NewLayout(probe)
	if err != nil {
		return fmt.Errorf("%w: Layout: %w", ErrInvalidConfig, err)
	}
	n := l.SlotSize() * uint64(spec.NumBlocks)
	base, err := e.sim.Alloc(n)
	if err != nil {
		return err
	}
	e.denseAlloc = base
	*spec = kvcache.DenseSpec(spec.Kind, spec.Geometry, spec.NumBlocks, base)
	return nil
}

// addDeviceRanges tells the scheduler where the layout's tensors are (the
// extents deviceTensors computes, which the CUDA backend also checks).
func (e *Engine) addDeviceRanges() error {
	for _, t := range e.deviceTensors() {
		err := e.sched.AddDeviceRange(t.start, t.end-t.start)
		if err != nil && !errors.Is(err, transfer.ErrInvalidRequest) {
			return err
		}
	}
	return nil
}

// mapRegion maps, prefaults and pins size bytes and makes them known to
// the copy layer. On error nothing of it is left mapped or pinned.
func (e *Engine) mapRegion(size int64, pool bool) (*poolRegion, error) {
	t0 := time.Now()
	steps := &e.stats.steps
	if !pool {
		steps = nil
	}
	// On CUDA the region is mapped without touching it: the pinner then
	// prefaults each registration range while registering the one before
	// (register's pipelined path), so end-to-end time approaches the larger
	// of the two instead of their sum.
	opts := mmapmem.Options{NoTHP: e.cfg.HugePages == HugePagesNone, HugeTLB: e.cfg.HugePages == HugePagesHugeTLB,
		PrefaultThreads: e.cfg.PrefaultThreads, BindNUMA: e.node >= 0, NUMANode: max(e.node, 0),
		DeferPrefault: e.pinner != nil}
	r, err := mmapmem.New(size, opts)
	if err != nil {
		return nil, err
	}
	t1 := time.Now()
	pr := &poolRegion{r: r}
	if err := e.pinRegion(pr); err != nil {
		e.unmapRegion(pr)
		return nil, err
	}
	t2 := time.Now()
	// One scheduler host range per registration range, so that copies are
	// never coalesced across two registrations.
	// On CUDA the copier may look up each range's device pointer, on a
	// thread with the context current.
	starts := append([]uint64{0}, pr.rangeStarts...)
	err = e.onThread(func() error {
		for i, off := range starts {
			end := uint64(size)
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
	if err != nil {
		e.unmapRegion(pr)
		return nil, err
	}
	if pool && e.tracker != nil {
		if err := e.tracker.Live(pr.host, uint64(size)); err != nil {
			e.unmapRegion(pr)
			return nil, err
		}
		pr.tracked = true
	}
	e.stats.pinCalls.Add(1)
	e.stats.pinNanos.Add(int64(time.Since(t0)))
	if steps != nil {
		steps.mapNanos.Add(int64(t1.Sub(t0)))
		steps.pinNanos.Add(int64(t2.Sub(t1)))
		steps.hostRangeNanos.Add(int64(time.Since(t2)))
	}
	return pr, nil
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
	host, err := e.sim.sim.RegisterHost(r.Bytes())
	if err != nil {
		return err
	}
	pr.host = host
	pr.pinned = true
	return nil
}

// unmapRegion undoes mapRegion (as far as it got).
func (e *Engine) unmapRegion(pr *poolRegion) {
	t0 := time.Now()
	e.slotMem.Delete(pr.id)
	if pr.tracked {
		_ = e.tracker.Released(pr.host, uint64(pr.r.Len()))
	}
	for _, base := range pr.known {
		_ = e.sched.RemoveHostRange(base)
	}
	if pr.pinned {
		if e.pinner != nil {
			_ = e.pinner.Unregister(pr.r)
		} else {
			_ = e.sim.sim.UnregisterHost(pr.host)
		}
	}
	if pr.mlock {
		_ = unix.Munlock(pr.r.Bytes())
	}
	_ = pr.r.Close()
	e.stats.unpinCalls.Add(1)
	e.stats.unpinNanos.Add(int64(time.Since(t0)))
}

// poison fills a released pool region with transfer.PoisonByte on the
// host backend (the gating harness's use-after-free detector).
func (e *Engine) poison(addr, n uint64) {
	if e.sim != nil {
		_ = e.sim.sim.Fill(addr, n, transfer.PoisonByte)
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

// addRegion maps one pool region and hands it to the cache.
func (e *Engine) addRegion(size int64) error {
	pr, err := e.mapRegion(size, true)
	if err != nil {
		return err
	}
	e.memMu.Lock()
	e.nextID++
	pr.id = e.nextID
	e.memMu.Unlock()
	if e.cfg.ZeroOnRelease {
		e.slotMem.Store(pr.id, pr.r.Bytes())
	}
	t0 := time.Now()
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

// grow pins the rest of the pool, one region at a time, on a goroutine
// locked to its OS thread (never unlocked: the thread, with its CUDA state,
// exits with the goroutine).
func (e *Engine) grow() {
	defer e.wg.Done()
	runtime.LockOSThread()
	if err := e.initGrowThread(); err != nil {
		e.growMu.Lock()
		e.growErr, e.growDone = err, true
		e.growCond.Broadcast()
		e.growMu.Unlock()
		return
	}
	e.growMu.Lock()
	stop := e.stopGrow
	e.growMu.Unlock()
	if !stop {
		e.calibrate()
	}
	for {
		e.growMu.Lock()
		for e.paused && !e.stopGrow {
			e.growCond.Wait()
		}
		if e.stopGrow || e.nextRegion >= len(e.plan) {
			e.growDone = true
			e.growCond.Broadcast()
			e.growMu.Unlock()
			return
		}
		size, i := e.plan[e.nextRegion], e.nextRegion
		e.growMu.Unlock()
		if e.hooks.beforeGrow != nil {
			e.hooks.beforeGrow(i)
		}
		err := e.addRegion(size)
		e.growMu.Lock()
		if err != nil {
			e.growErr = err
			e.growDone = true
			e.growCond.Broadcast()
			e.growMu.Unlock()
			return
		}
		e.nextRegion++
		if e.nextRegion == len(e.plan) {
			e.stats.fullPool.Store(int64(time.Since(e.start)))
		}
		e.growMu.Unlock()
		e.autoTrim()
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
		return fmt.Errorf("offload: background growth stopped: %w", e.growErr)
	case e.growDone && e.nextRegion < len(e.plan):
		return fmt.Errorf("%w: growth stopped by Close", ErrClosed)
	case e.growDone:
		return nil
	}
	return ctx.Err()
}
