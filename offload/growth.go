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

// PauseGrowth stops background pinning after the region in progress (for a
// caller that wants no pinning during its own graph capture; the engine's
// relaxed capture mode makes that unnecessary). Idempotent. The region
// being registered finishes and joins the pool. The region being
// prefetched (mapped and prefaulted ahead of registration) finishes its
// prefault and is held, mapped but not pinned, not counted in
// Stats.OwnedBytes or Stats.Regions, until ResumeGrowth registers it or
// Close unmaps it. No further region is mapped meanwhile.
// If the copy methods are not calibrated yet, the growth thread calibrates
// them during the pause.
func (e *Engine) PauseGrowth() {
	e.growMu.Lock()
	e.paused = true
	e.growMu.Unlock()
}

// ResumeGrowth lets background pinning continue. Idempotent.
func (e *Engine) ResumeGrowth() {
	e.growMu.Lock()
	e.paused = false
	e.growCond.Broadcast()
	e.growMu.Unlock()
}

// GrowTo sets the pool size that background growth aims at to bytes
// (capped at Config.PoolBytes and Config.MaxCachedBytes) and, when growth
// has ended below it, starts growing again in the background: the way to
// have memory back after Trim, or after growth stopped on an error
// (Stats.GrowthError, which GrowTo clears). A lower size stops growth
// there; it never trims (Trim does). WaitGrown waits for the new growth.
func (e *Engine) GrowTo(bytes int64) error {
	if !e.enter() {
		return fmt.Errorf("%w: GrowTo after Close", ErrClosed)
	}
	defer e.leave()
	if bytes < 0 {
		return fmt.Errorf("%w: GrowTo(%d): must not be negative", ErrInvalidArgument, bytes)
	}
	limit := e.cfg.PoolBytes
	if e.cfg.MaxCachedBytes > 0 {
		limit = min(limit, e.cfg.MaxCachedBytes)
	}
	e.growMu.Lock()
	defer e.growMu.Unlock()
	e.target = min(bytes, limit)
	if !e.growDone || e.stopGrow || e.committed+e.slot > e.target {
		return nil
	}
	// Growth has ended: plan regions for the rest and start it again.
	e.growErr = nil
	e.growFrom = len(e.plan)
	e.plan = append(e.plan, regionPlan(e.target-e.committed, e.cfg.RegionBytes, e.cfg.RegionBytes, e.slot)...)
	e.growDone = false
	e.stats.fullPool.Store(0)
	e.wg.Add(1)
	go e.grow()
	return nil
}

// WaitGrown blocks until background growth has ended: the whole pool
// pinned, or growth stopped on an error (returned), and then, on CUDA, the
// copy methods calibrated (Stats.CopyCalibration); or until the engine is
// closed (ErrClosed), or ctx ends.
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
