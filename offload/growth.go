package offload

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/mmapmem"
)

// PauseGrowth stops pinning after the region in progress, until
// ResumeGrowth.
func (e *Engine) PauseGrowth() {
	e.growth.mu.Lock()
	e.growth.paused = true
	// The region being registered finishes and joins the pool. The one
	// being prefetched (mapped and prefaulted ahead of registration)
	// finishes its prefault and is held, mapped but not pinned, not counted
	// in Stats.Pool.OwnedBytes or Regions, until ResumeGrowth registers it
	// or Close unmaps it; no further region is mapped meanwhile. A caller
	// capturing a CUDA graph needs no pause (the engine's capture mode is
	// relaxed).
	//
	// Wake the stages waiting for a region, so that the growth thread sees
	// the pause (and calibrates during it) without waiting for the next
	// hand-over, which a paused prefetch stage may never make.
	e.growth.cond.Broadcast()
	e.growth.mu.Unlock()
}

// ResumeGrowth lets background pinning continue. Idempotent.
func (e *Engine) ResumeGrowth() {
	e.growth.mu.Lock()
	e.growth.paused = false
	e.growth.cond.Broadcast()
	e.growth.mu.Unlock()
}

// GrowTo sets the pool size growth aims at, growing again up to it.
func (e *Engine) GrowTo(bytes int64) error {
	if !e.enter() {
		return fmt.Errorf("%w: GrowTo after Close", ErrClosed)
	}
	defer e.leave()
	if bytes < 0 {
		return fmt.Errorf("%w: GrowTo(%d): must not be negative", ErrInvalidArgument, bytes)
	}
	if e.dial != nil {
		return fmt.Errorf("%w: GrowTo: an engine of Dial has no pool of its own (the node's is fixed when it starts)", ErrInvalidArgument)
	}
	limit := e.cfg.PoolBytes
	if e.cfg.MaxCachedBytes > 0 {
		limit = min(limit, e.cfg.MaxCachedBytes)
	}
	e.growth.mu.Lock()
	defer e.growth.mu.Unlock()
	e.growth.target = min(bytes, limit)
	if !e.growth.done || e.growth.stop || e.growth.committed+e.slot > e.growth.target {
		return nil
	}
	// Growth has ended: plan regions for the rest and start it again.
	e.growth.err = nil
	e.growth.from = len(e.growth.plan)
	e.growth.plan = append(e.growth.plan, regionPlan(e.growth.target-e.growth.committed, e.cfg.RegionBytes, e.cfg.RegionBytes, e.slot)...)
	e.growth.done = false
	e.stats.fullPool.Store(0)
	e.wg.Add(1)
	go e.grow()
	return nil
}

// WaitGrown waits until growth has ended, returning its error, or ctx ends.
func (e *Engine) WaitGrown(ctx context.Context) error {
	return e.waitGrown(ctx)
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

// uncommit forgets bytes of pool regions that were dropped before joining
// the pool or trimmed out of it.
func (e *Engine) uncommit(bytes int64) {
	e.growth.mu.Lock()
	e.growth.committed -= bytes
	e.growth.mu.Unlock()
}

// dropGrowing unmaps a region growth mapped but will not publish.
func (e *Engine) dropGrowing(pr *poolRegion) {
	e.unmapRegion(pr)
	e.uncommit(pr.planned)
}

// nextSizeLocked is the size of plan region i that growth may map now,
// reserving it in committed; false when growth has reached its target or
// the plan's end. A region that fits only in part is shrunk to whole
// slots, and the plan ends there. growth.mu held.
func (e *Engine) nextSizeLocked(i int) (int64, bool) {
	if i >= len(e.growth.plan) {
		return 0, false
	}
	size := min(e.growth.plan[i], (e.growth.target-e.growth.committed)/e.slot*e.slot)
	if size < e.slot {
		e.growth.plan = e.growth.plan[:i]
		if e.growth.next == len(e.growth.plan) && e.stats.fullPool.Load() == 0 {
			e.stats.fullPool.Store(int64(time.Since(e.start)))
		}
		return 0, false
	}
	if size < e.growth.plan[i] {
		e.growth.plan[i] = size
		e.growth.plan = e.growth.plan[:i+1]
	}
	e.growth.committed += size
	return size, true
}

// checkRoom re-checks, before growth maps a region of size bytes, that
// the machine still holds it plus Config.MemoryHeadroomBytes (other
// processes pin and allocate meanwhile: eight ranks started together all
// pass New's check). The error stops growth (Stats.Pool.GrowthError).
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

// publishRegion hands a pinned pool region to the cache and counts it as
// owned. On error the region is unpinned and unmapped.
func (e *Engine) publishRegion(pr *poolRegion) error {
	e.memory.mu.Lock()
	e.memory.nextID++
	pr.id = e.memory.nextID
	e.memory.mu.Unlock()
	if e.cfg.ZeroOnRelease || e.cfg.Disk != nil || e.cfg.Cluster != nil {
		e.slotMem.Store(pr.id, pr.r.Bytes())
	}
	t0 := time.Now()
	size := pr.r.Len()
	if _, err := e.kc.AddRegion(kvcache.Region{ID: pr.id, Base: uintptr(pr.host), Size: uint64(size), RangeStarts: pr.rangeStarts}); err != nil {
		e.unmapRegion(pr)
		return err
	}
	e.stats.steps.cacheNanos.Add(int64(time.Since(t0)))
	e.memory.mu.Lock()
	e.memory.regions = append(e.memory.regions, pr)
	e.memory.owned += size
	e.memory.mu.Unlock()
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

// growRun is the state the stages of one background growth share; the
// fields are guarded by the engine's growth.mu.
type growRun struct {
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
//     the last publication stamps Stats.Pool.FullPool.
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
	g := &growRun{e: e}
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
	e.growth.mu.Lock()
	g.pinDone = true
	held := g.ready
	g.ready = nil
	e.growth.cond.Broadcast()
	e.growth.mu.Unlock()
	if held != nil && held.pr != nil {
		e.dropGrowing(held.pr)
	}
	close(pinned)
	stages.Wait()
	e.growth.mu.Lock()
	calibrate := !e.growth.stop && !g.calibrated
	e.growth.mu.Unlock()
	if calibrate {
		e.calibrate()
	}
	e.endGrowth()
}

// stoppedLocked reports whether growth must stop: Close, or an error in
// any stage. The caller holds growth.mu.
func (e *Engine) stoppedLocked() bool { return e.growth.stop || e.growth.err != nil }

// growFailed records the first error of background growth and wakes every
// stage waiting on growCond, so that they stop.
func (e *Engine) growFailed(err error) {
	e.growth.mu.Lock()
	if e.growth.err == nil {
		e.growth.err = err
	}
	e.growth.cond.Broadcast()
	e.growth.mu.Unlock()
}

// endGrowth marks background growth finished, for WaitGrown.
func (e *Engine) endGrowth() {
	e.growth.mu.Lock()
	e.growth.done = true
	e.growth.cond.Broadcast()
	e.growth.mu.Unlock()
}

// next waits for the next region to register, and reports false when
// there is none (the plan done, or growth stopped). While growth is paused
// it takes none: a region the prefetch stage hands over meanwhile is held
// until growth resumes. While paused, once the prefetch stage is idle, it
// runs the copy-method calibration (if not done yet), so that a long pause
// does not leave the copier uncalibrated.
func (g *growRun) next() (growItem, bool) {
	e := g.e
	e.growth.mu.Lock()
	defer e.growth.mu.Unlock()
	for !e.stoppedLocked() {
		switch {
		case g.ready == nil && g.prefetchDone:
			// Nothing left to register: a pause has nothing to hold.
			return growItem{}, false
		case e.growth.paused && !g.calibrated && !g.prefetching:
			g.calibrated = true
			e.growth.mu.Unlock()
			e.calibrate()
			e.growth.mu.Lock()
			continue
		case e.growth.paused:
		case g.ready != nil:
			it := *g.ready
			g.ready = nil
			e.growth.cond.Broadcast()
			return it, true
		}
		e.growth.cond.Wait()
	}
	return growItem{}, false
}

// prefetch is the first growth stage: it maps and prefaults plan[1:] in
// order, each region handed to the growth thread (through g.ready) before
// the next starts, and starts none while growth is paused. It ends when
// the plan is done, growth stops, or the growth thread has stopped taking
// regions; a region it cannot hand over then is unmapped.
func (g *growRun) prefetch() {
	e := g.e
	defer func() {
		e.growth.mu.Lock()
		g.prefetchDone = true
		e.growth.cond.Broadcast()
		e.growth.mu.Unlock()
	}()
	e.growth.mu.Lock()
	from := e.growth.from
	e.growth.mu.Unlock()
	for i := from; ; i++ {
		e.growth.mu.Lock()
		if i >= len(e.growth.plan) {
			// Nothing left: a pause has nothing to hold.
			e.growth.mu.Unlock()
			return
		}
		for e.growth.paused && !e.stoppedLocked() {
			e.growth.cond.Wait()
		}
		if e.stoppedLocked() {
			e.growth.mu.Unlock()
			return
		}
		size, ok := e.nextSizeLocked(i)
		if !ok {
			e.growth.mu.Unlock()
			return
		}
		g.prefetching = true
		e.growth.mu.Unlock()
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
		e.growth.mu.Lock()
		g.prefetching = false
		e.growth.cond.Broadcast()
		for g.ready != nil && !g.pinDone {
			e.growth.cond.Wait()
		}
		gone := g.pinDone
		if !gone {
			g.ready = &growItem{i: i, pr: pr, err: err}
			e.growth.cond.Broadcast()
		}
		e.growth.mu.Unlock()
		if gone && pr != nil {
			e.dropGrowing(pr)
		}
		if gone || err != nil {
			return
		}
	}
}

// publish is the last growth stage: it adds the pinned regions to the cache
// in order and counts them as owned; the last one stamps Stats.Pool.FullPool.
// After Close or a failure of its own it unpins and unmaps what it gets
// instead (a failure of a later region in an earlier stage does not stop
// the regions before it from joining). It ends when in is closed.
func (g *growRun) publish(in <-chan growItem) {
	e := g.e
	failed := false
	for it := range in {
		e.growth.mu.Lock()
		drop := failed || e.growth.stop
		e.growth.mu.Unlock()
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
		e.growth.mu.Lock()
		e.growth.next++
		if e.growth.next == len(e.growth.plan) {
			e.stats.fullPool.Store(int64(time.Since(e.start)))
		}
		e.growth.mu.Unlock()
	}
}

func (e *Engine) waitGrown(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() {
		e.growth.mu.Lock()
		e.growth.cond.Broadcast()
		e.growth.mu.Unlock()
	})
	defer stop()
	e.growth.mu.Lock()
	defer e.growth.mu.Unlock()
	for !e.growth.done && ctx.Err() == nil {
		e.growth.cond.Wait()
	}
	switch {
	case e.growth.err != nil:
		return fmt.Errorf("%w: %w", ErrGrowth, e.growth.err)
	case e.growth.done && e.growth.next < len(e.growth.plan):
		return fmt.Errorf("%w: growth stopped by Close", ErrClosed)
	case e.growth.done:
		return nil
	}
	return ctx.Err()
}
