package offload

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/internal/envvar"
	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/internal/tiered"
	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/transfer"
)

// New pins the first region and returns; the rest is pinned in the
// background.
func New(cfg Config) (*Engine, error) {
	return newEngine(cfg, engineHooks{})
}

// Close refuses new calls, waits for the copies in flight, frees all memory.
func (e *Engine) Close() error { return e.CloseContext(context.Background()) }

// CloseContext is Close with ctx bounding its wait for the copies.
func (e *Engine) CloseContext(ctx context.Context) error {
	if e.closed.Swap(true) {
		return fmt.Errorf("%w: Close called twice", ErrClosed)
	}
	e.cancelBackground()
	done := make(chan error, 1)
	go func() { done <- e.shutdown(ctx) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("offload: Close gave up waiting for copies in flight (%d bytes); the engine is closed and releases its memory when they end: %w",
			e.stats.inFlightBytes.Load(), ctx.Err())
	}
}

// engineHooks are injections: sim and diskFaults from Config's seam of
// package hostsim (and tests), the rest test-only.
type engineHooks struct {
	// sim is the host backend's simulated device (nil: the engine makes
	// its own and closes it).
	sim        *cudadev.Sim
	loadDriver func() (*cudadev.Driver, error)
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
	copyOptions cudadev.CopyOptions
	// greedyStores runs stores on the copy kernel's unthrottled launch
	// (cudadev.CUDAOptions.GreedyStores), for comparisons: it slows a
	// compute-bound kernel beside the stores.
	greedyStores bool
	// calibrate keeps the background calibration in cudafake tests (their
	// helper otherwise gives an empty table).
	calibrate bool
	// beforeClusterCopy, when set, runs on a goroutine of its own before
	// each write-through's PutAsyncFrom (a slow copy, seen from the engine:
	// the slot must stay the block's until the tier releases it).
	beforeClusterCopy func(Key)
	// beforeDiskPut runs on the disk tier's writer before each write, with
	// its key.
	beforeDiskPut func(Key)
	// beforeDiskGet runs before each read of a promotion (Load, Prefetch).
	beforeDiskGet func(Key)
	// beforeNodePromote runs before an engine of Dial asks its node to
	// promote chunk i of a Load's disk blocks (promoteNode), on the
	// goroutine that then sends the request.
	beforeNodePromote func(i int)
	// diskFaults is internal/tier/disk's Config.Faults for the disk tier.
	diskFaults diskFaultFunc
	// dial makes an engine of Dial (dial.go): no pool of its own.
	dial *dialState
	// builders is the scheduler's Config.Builders (0: its default).
	builders int
	// partSegments replaces the constant of that name (0: keep it).
	partSegments int
	// partGrowth is how many parts of a copy grow before they reach
	// partSegments (partStarts); New sets it from partGrowthEnv, else
	// defaultPartGrowth, when the hooks leave it 0.
	partGrowth int
	// wholeFirstLayer builds a per-layer load's first layer as one part
	// (wholeFirstLayerEnv).
	wholeFirstLayer bool
	// trace is the scheduler's Config.Trace.
	trace func(point string, part int)
	// noTemplates: head-sliced copies cut into parts for Build alone,
	// never template requests (A/B benchmarks).
	noTemplates bool
	// afterDiskClear runs in Clear after the disk tier's first clear,
	// before the cache's.
	afterDiskClear func()
}

// buildersEnv, when set, is how many goroutines build a copy's parts
// (transfer.Config.Builders) instead of the default, a quarter of
// GOMAXPROCS from 1 to 4: for comparisons on a machine.
const buildersEnv = "KVOFFLOAD_COPY_BUILDERS"

// partGrowthEnv, when set (0 to 8), is how many parts of a copy grow,
// each twice the one before, up to a whole part (partStarts): 5, the
// default, starts at a 32nd; fewer start larger, giving the copy stream
// more bytes ahead of the threads that build and enqueue the next parts,
// for comparisons on a machine.
const partGrowthEnv = "KVOFFLOAD_PART_GROWTH"

const defaultPartGrowth = 5

// wholeFirstLayerEnv set to 1 builds a per-layer load's first layer as one
// part, as every later layer, instead of in parts that grow from a small
// first one (copyPlan): for comparisons on a machine.
const wholeFirstLayerEnv = "KVOFFLOAD_WHOLE_FIRST_LAYER"

// noPitchedStagingEnv set to 1 turns the copier's pitched staging DMAs off
// (internal/cudacopy Options.GatherMinRow < 0): a per-layer load's layers
// then go through the copy kernel, as before they existed: for comparisons
// on a machine.
const noPitchedStagingEnv = "KVOFFLOAD_NO_PITCHED_STAGING"

// gatherChunkEnv sets the copier's staging chunk in MiB (1 to 64; unset or
// 0: internal/cudacopy's default): fewer, larger chunks make fewer driver
// calls a staged layer (a pitched DMA, events and a scatter launch a
// chunk): for comparisons on a machine.
const gatherChunkEnv = "KVOFFLOAD_GATHER_CHUNK_MIB"

// comparisonSwitches says whether New reads the comparison switches
// (buildersEnv, partGrowthEnv, wholeFirstLayerEnv, noPitchedStagingEnv,
// gatherChunkEnv):
// builds with -tags kvocompare do (the benchmarks', make gpu-bins), and
// tests that set it; the release engine ignores those variables.
var comparisonSwitches = comparisonBuild

// compareInt is envInt for a comparison switch: def unless
// comparisonSwitches.
func compareInt(name string, def, lo, hi int, unit string) (int, error) {
	if !comparisonSwitches {
		return def, nil
	}
	return envInt(name, def, lo, hi, unit)
}

// envInt reads an integer setting for comparisons from the environment:
// unset, def; outside [lo, hi] or not an integer, ErrInvalidConfig naming
// it and the range (of unit).
func envInt(name string, def, lo, hi int, unit string) (int, error) {
	v := envvar.Get(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		return 0, fmt.Errorf("%w: %s=%q: want %d to %d %s", ErrInvalidConfig, name, v, lo, hi, unit)
	}
	return n, nil
}

// envSwitch reads a comparison switch from the environment: unset or "0"
// off, "1" on, anything else ErrInvalidConfig naming it; off unless
// comparisonSwitches.
func envSwitch(name string) (bool, error) {
	if !comparisonSwitches {
		return false, nil
	}
	switch v := envvar.Get(name); v {
	case "", "0":
		return false, nil
	case "1":
		return true, nil
	default:
		return false, fmt.Errorf("%w: %s=%q: want 0 or 1", ErrInvalidConfig, name, v)
	}
}

// openSim sets up the host backend: the simulated GPU, with a layout given
// without tensors allocated densely in it.
func (e *Engine) openSim() error {
	var err error
	if e.sim = e.hooks.sim; e.sim == nil {
		if e.sim, err = cudadev.NewSim(cudadev.SimConfig{}); err != nil {
			return err
		}
		e.ownSim = true
	}
	e.dev, e.cfg.HostDevice = e.sim, e.sim
	if layoutEmpty(e.cfg.Layout) {
		spec, _ := kvLayoutSpec(e.cfg.Layout)
		base, err := e.allocDense(&spec)
		if err != nil {
			return err
		}
		e.denseAlloc = base
		e.cfg.Layout = fromKVLayoutSpec(spec)
	}
	return nil
}

// allocDense places a layout given without tensors in the simulated device
// (the rank's heads, kvcache.DenseRankSpec) and returns the allocation.
func (e *Engine) allocDense(spec *kvcache.LayoutSpec) (uint64, error) {
	probe := kvcache.DenseRankSpec(spec.Kind, spec.Geometry, spec.Order, spec.Heads, spec.NumBlocks, denseProbeBase)
	l, err := kvcache.NewLayout(probe)
	if err != nil {
		return 0, fmt.Errorf("%w: Layout: %w", ErrInvalidConfig, err)
	}
	per := l.SlotSize()
	if spec.Order != kvcache.OrderUndeclared {
		per = l.RankBytes() // the rank's heads, no padding
	}
	base, err := e.sim.MemAlloc(per * uint64(spec.NumBlocks))
	if err != nil {
		return 0, err
	}
	*spec = kvcache.DenseRankSpec(spec.Kind, spec.Geometry, spec.Order, spec.Heads, spec.NumBlocks, base)
	return base, nil
}

// addDeviceRanges tells the scheduler where the layout's tensors are: the
// union of the extents deviceTensors computes (which the CUDA backend also
// checks). Tensors may overlap (interleaved K/V: V starts inside K's
// extent and ends past it), so overlapping extents are merged into one
// range; merely adjacent ones stay separate, as they may be separate
// allocations.
func (e *Engine) addDeviceRanges() error { return e.addRangesOf(e.deviceTensors()) }

// addRangesOf tells the scheduler about the merged extents of ts.
func (e *Engine) addRangesOf(ts []deviceTensor) error {
	for _, r := range mergeExtents(ts) {
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

// enter marks a call in progress so Close waits for it; false after Close.
func (e *Engine) enter() bool {
	e.closeMu.RLock()
	if e.closed.Load() {
		e.closeMu.RUnlock()
		return false
	}
	return true
}

func (e *Engine) leave() { e.closeMu.RUnlock() }

func (e *Engine) shutdown(ctx context.Context) error {
	e.closeMu.Lock()
	defer e.closeMu.Unlock()
	e.ops.Wait()
	err := e.writeBackAtClose(ctx)
	err = errors.Join(err, e.teardown())
	e.hub.closeAll()
	return err
}

// teardown releases everything New built; used by Close and by a failed New.
func (e *Engine) teardown() error {
	e.growth.mu.Lock()
	e.growth.stop = true
	e.growth.cond.Broadcast()
	e.growth.mu.Unlock()
	if e.reaping.stop != nil {
		close(e.reaping.stop)
	}
	e.wg.Wait()
	var errs []error
	errs = append(errs, e.closeDial()) // its regions retire while the scheduler knows them
	if e.sched != nil {
		errs = append(errs, e.sched.Close())
	}
	if e.kc != nil {
		e.kc.Close()
	}
	if e.disk != nil {
		// After the cache (no eviction any more), before the pool is
		// unmapped: the writers give the demoting slots back.
		errs = append(errs, e.disk.Close(context.Background(), false))
	}
	errs = append(errs, e.closeCluster())
	e.memory.mu.Lock()
	all := append([]*poolRegion(nil), e.memory.regions...)
	for _, pr := range e.memory.draining {
		all = append(all, pr)
	}
	if e.stage.region != nil {
		all = append(all, e.stage.region)
	}
	e.memory.regions, e.memory.draining, e.stage.region, e.memory.owned = nil, nil, nil, 0
	e.memory.mu.Unlock()
	for _, pr := range all {
		errs = append(errs, e.unmapRegion(pr))
	}
	errs = append(errs, e.closeCUDADevice(), e.releaseContext())
	if e.denseAlloc != 0 {
		errs = append(errs, e.sim.MemFree(e.denseAlloc))
	}
	e.views.mu.Lock()
	for _, a := range e.views.dense {
		errs = append(errs, e.sim.MemFree(a))
	}
	e.views.dense = nil
	e.views.mu.Unlock()
	if e.ownSim && e.sim != nil {
		errs = append(errs, e.sim.Close())
	}
	return errors.Join(errs...)
}

func newEngine(cfg Config, h engineHooks) (*Engine, error) {
	start := time.Now()
	h, err := h.withSeam(cfg)
	if err != nil {
		return nil, err
	}
	cfg, numa, slot, err := withDefaults(cfg)
	if err != nil {
		return nil, err
	}
	if h.loadDriver == nil {
		h.loadDriver = cudadev.LoadDriver
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
		node: node, slot: slot, sys: sys, tracker: h.tracker,
		growth:  growthState{plan: plan, target: target},
		memory:  poolMemory{inflight: map[kvcache.RegionID]int{}, changed: make(chan struct{})},
		stage:   stagingArea{buffers: map[string]*Staging{}},
		reaping: reaperState{kick: make(chan struct{}, 1), stop: make(chan struct{})},
		names:   namespaces{ids: map[string]kvcache.Namespace{}}}
	e.growth.cond = sync.NewCond(&e.growth.mu)
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
		e.cfg.HostDevice = nil // Config reports the device in use
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
	builders := h.builders
	if builders == 0 {
		if builders, err = compareInt(buildersEnv, 0, 1, transfer.MaxBuilders, "part builders"); err != nil {
			return nil, err
		}
	}
	if e.hooks.partGrowth == 0 {
		if e.hooks.partGrowth, err = compareInt(partGrowthEnv, defaultPartGrowth, 0, 8, "growing parts"); err != nil {
			return nil, err
		}
	}
	whole, err := envSwitch(wholeFirstLayerEnv)
	if err != nil {
		return nil, err
	}
	e.hooks.wholeFirstLayer = e.hooks.wholeFirstLayer || whole
	calls, err := traceCallsFromEnv()
	if err != nil {
		return nil, err
	}
	if calls != nil && h.trace == nil {
		e.calls = calls
		h.trace, e.hooks.trace = calls.point, calls.point
	}
	// Warm start: the op events of two per-layer loads (and a few batch
	// events) made before New returns, on the CUDA backend (events there
	// are driver objects; the host backend's cost nothing).
	prewarm := 0
	if e.cudaDev != nil {
		prewarm = 2 * (cfg.Layout.Layers + 1)
	}
	if e.sched, err = transfer.New(e.dev, transfer.Config{
		MaxInFlightBytes: uint64(cfg.MaxInFlightBytes), MaxQueuedBytes: uint64(cfg.MaxQueuedBytes), Tracker: h.tracker,
		Builders: builders, Trace: h.trace, PrewarmOpEvents: prewarm,
	}); err != nil {
		return nil, err
	}
	if err := e.addDeviceRanges(); err != nil {
		return nil, err
	}
	if h.dial != nil {
		if err := e.openDial(h.dial); err != nil {
			return nil, err
		}
		ok = true
		return e, nil
	}
	var pol kvcache.Policy
	if cfg.Policy == PolicyTinyLFU {
		if pol, err = kvcache.NewTinyLFU(kvcache.TinyLFUConfig{MaxBlocks: lfuBlocks}); err != nil {
			return nil, err
		}
	}
	// MaxSlots reserves the cache's slot table and key index for the whole
	// pool up front: without it, each region added copied the slot table
	// and rehashed the index (O(slots so far) under the cache's lock,
	// seconds over a large pool of small slots: kvcache's
	// BenchmarkAddRegionGrowth).
	kcfg := kvcache.Config{Layout: e.layout, SlotAlign: slotAlign, Policy: pol, LowWatermark: tiered.LowWatermark(maxBlocks), MaxSlots: reserve,
		PartialTimeout: cfg.PartialTimeout}
	if cfg.ZeroOnRelease {
		kcfg.OnFree = e.zeroSlot
	}
	kcfg.OnIndex = e.hub.onIndex
	if cfg.Disk != nil {
		d, err := openDisk(cfg, slot, &e.hub, h, e)
		switch {
		case errors.Is(err, disk.ErrNoUsableDir):
			// Every directory failed (full, I/O errors, permissions): the
			// engine serves from host memory without its disk tier and
			// says why (Stats.Disk.Error).
			e.diskErr = err.Error()
		case err != nil:
			return nil, err
		default:
			e.disk = d
			kcfg.Demote, kcfg.OnDemote = e.disk.Demote, e.disk.OnDemote
		}
	}
	if e.kc, err = kvcache.New(kcfg); err != nil {
		return nil, err
	}
	e.cache = e.kc
	if e.disk != nil {
		e.disk.Start(e.kc) // its writers
	}
	if cfg.Cluster != nil {
		if err := e.openCluster(cfg); err != nil {
			return nil, err
		}
	}
	if cfg.StagingBytes > 0 {
		if e.stage.region, err = e.mapRegion(cfg.StagingBytes, false); err != nil {
			return nil, fmt.Errorf("offload: staging region: %w", err)
		}
		if e.stage.dev, err = e.stagingDevicePtr(e.stage.region); err != nil {
			return nil, err
		}
	}
	if err := e.addRegion(plan[0]); err != nil {
		return nil, err
	}
	e.stats.firstSlot.Store(int64(time.Since(start)))
	e.growth.next, e.growth.committed, e.growth.from = 1, plan[0], 1
	if len(plan) == 1 {
		e.stats.fullPool.Store(int64(time.Since(start)))
	}
	e.wg.Add(2)
	go e.grow()
	go e.reaper()
	ok = true
	return e, nil
}

// uncheckedReserveSlots bounds the slots the cache's tables and TinyLFU's
// sketch are sized for up front when Config.SkipMemoryCheck leaves them
// unchecked (a few MiB).
const uncheckedReserveSlots = 1 << 16
