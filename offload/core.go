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
)

// engineHooks are test-only injections.
type engineHooks struct {
	loadDriver func() (cuda.Driver, error)
	sys        *system
	tracker    *transfer.Tracker
	// beforeGrow runs on the growth goroutine before it pins plan[i].
	beforeGrow func(i int)
}

// poolRegion is one mapped, pinned region of the pool.
type poolRegion struct {
	id    kvcache.RegionID
	r     *mmapmem.Region
	host  uint64 // address the copy layer knows it by
	mlock bool
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
	if choice.name == BackendCUDA {
		// The CUDA Device of package transfer and package register have not
		// landed: this build runs the host backend only.
		if cfg.Backend == BackendCUDA {
			return nil, fmt.Errorf("%w: the CUDA backend is not wired into this build of the engine", ErrNoDriver)
		}
		choice = backendChoice{name: BackendHost, reason: "auto: CUDA found, but this build of the engine runs the host backend only"}
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
	ok := false
	defer func() {
		if !ok {
			e.teardown()
		}
	}()
	if e.sim = cfg.Sim; e.sim == nil {
		if e.sim, err = NewSimGPU(SimOptions{}); err != nil {
			return nil, err
		}
		e.ownSim = true
	}
	spec, _ := kvLayoutSpec(cfg.Layout)
	if layoutEmpty(cfg.Layout) {
		if err := e.allocDense(&spec); err != nil {
			return nil, err
		}
		e.cfg.Layout = fromKVLayoutSpec(spec)
	}
	if e.layout, err = kvcache.NewLayout(spec); err != nil {
		return nil, fmt.Errorf("%w: Layout: %w", ErrInvalidConfig, err)
	}
	e.dev = e.sim.sim
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
	if e.cache, err = kvcache.New(kvcache.Config{Layout: e.layout, Policy: pol, LowWatermark: min(maxBlocks/64, 64)}); err != nil {
		return nil, err
	}
	if cfg.StagingBytes > 0 {
		if e.stagingRegion, err = e.mapRegion(cfg.StagingBytes, false); err != nil {
			return nil, fmt.Errorf("offload: staging region: %w", err)
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

// addDeviceRanges tells the scheduler where the layout's tensors are.
func (e *Engine) addDeviceRanges() error {
	l := e.cfg.Layout
	seg := uint64(e.slot)
	n := uint64(l.NumBlocks)
	add := func(base, stride, segLen uint64) error {
		err := e.sched.AddDeviceRange(base, (n-1)*stride+segLen)
		if err != nil && !errors.Is(err, transfer.ErrInvalidRequest) {
			return err
		}
		return nil
	}
	if l.Kind == LayoutCrossLayer {
		return add(l.Base, l.Stride, seg)
	}
	segLen := uint64(l.KVHeads * l.HeadDim * l.DTypeBytes * l.TokensPerBlock)
	for _, t := range l.LayerTensors {
		if err := add(t.K, t.Stride, segLen); err != nil {
			return err
		}
		if t.V != 0 {
			if err := add(t.V, t.Stride, segLen); err != nil {
				return err
			}
		}
	}
	return nil
}

// mapRegion maps, prefaults and pins size bytes and makes them known to
// the copy layer.
func (e *Engine) mapRegion(size int64, pool bool) (*poolRegion, error) {
	t0 := time.Now()
	opts := mmapmem.Options{NoTHP: e.cfg.HugePages == HugePagesNone, HugeTLB: e.cfg.HugePages == HugePagesHugeTLB,
		PrefaultThreads: e.cfg.PrefaultThreads, BindNUMA: e.node >= 0, NUMANode: max(e.node, 0)}
	r, err := mmapmem.New(size, opts)
	if err != nil {
		return nil, err
	}
	pr := &poolRegion{r: r}
	if e.cfg.HostPinning == PinMlock {
		if err := unix.Mlock(r.Bytes()); err != nil {
			_ = r.Close()
			return nil, fmt.Errorf("%w: mlock of %d bytes: %w", ErrInsufficientMemory, size, err)
		}
		pr.mlock = true
	}
	host, err := e.sim.sim.RegisterHost(r.Bytes())
	if err != nil {
		e.unmapRegion(pr)
		return nil, err
	}
	pr.host = host
	if err := e.sched.AddHostRange(host, uint64(size)); err != nil {
		_ = e.sim.sim.UnregisterHost(host)
		pr.host = 0
		e.unmapRegion(pr)
		return nil, err
	}
	e.stats.pinCalls.Add(1)
	e.stats.pinNanos.Add(int64(time.Since(t0)))
	if pool && e.tracker != nil {
		if err := e.tracker.Live(host, uint64(size)); err != nil {
			return nil, err
		}
	}
	return pr, nil
}

// unmapRegion undoes mapRegion.
func (e *Engine) unmapRegion(pr *poolRegion) {
	t0 := time.Now()
	if pr.host != 0 {
		_ = e.sched.RemoveHostRange(pr.host)
		_ = e.sim.sim.UnregisterHost(pr.host)
	}
	if pr.mlock {
		_ = unix.Munlock(pr.r.Bytes())
	}
	_ = pr.r.Close()
	e.stats.unpinCalls.Add(1)
	e.stats.unpinNanos.Add(int64(time.Since(t0)))
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
	if _, err := e.cache.AddRegion(kvcache.Region{ID: pr.id, Base: uintptr(pr.host), Size: uint64(size)}); err != nil {
		e.unmapRegion(pr)
		return err
	}
	e.memMu.Lock()
	e.regions = append(e.regions, pr)
	e.owned += size
	e.memMu.Unlock()
	return nil
}

// grow pins the rest of the pool, one region at a time, on a goroutine
// locked to its OS thread.
func (e *Engine) grow() {
	defer e.wg.Done()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
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
