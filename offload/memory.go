package offload

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/transfer"
)

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
	planned     int64    // the plan's size for a pool region (growthState.committed counts it)
	borrowed    bool     // a node's region (Dial): nodepool unmaps it, unmapRegion only unpins
}

// regionOptions are the mmapmem options of every region: mapped untouched
// (DeferPrefault), prefaulted afterwards by the engine or, on CUDA for a
// region registered without being prefetched, by the pinner range by range.
func (e *Engine) regionOptions() mmapmem.Options {
	return mmapmem.Options{NoTHP: e.cfg.HugePages == HugePagesNone, HugeTLB: e.cfg.HugePages == HugePagesHugeTLB,
		PrefaultThreads: e.cfg.PrefaultThreads, PrefaultNice: e.cfg.PrefaultNice, PrefaultStop: e.reaping.stop, BindNUMA: e.node >= 0, NUMANode: max(e.node, 0), DeferPrefault: true}
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
// failure is returned and counted in Stats (Pool.TeardownErrors,
// Pool.TeardownError): callers that cannot return it (trim, growth rollback)
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
			// cuMemHostUnregister may wait for the device to go idle,
			// which it does: no stream of the engine's waits on work a
			// host thread has yet to enqueue.
			unregister := func() error { return e.pinner.Unregister(pr.r) }
			if err = unregister(); err != nil {
				err = unregister()
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
	if !pr.pinned && !pr.borrowed {
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
	if e.sim != nil && e.dial == nil { // a node's regions are shared: never poisoned
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

// Trim gives at least bytes back to the OS in whole regions, newest first.
func (e *Engine) Trim(ctx context.Context, bytes int64) (TrimResult, error) {
	if !e.enter() {
		return TrimResult{}, fmt.Errorf("%w: Trim after Close", ErrClosed)
	}
	defer e.leave()
	if e.dial != nil {
		return e.trimNode(bytes)
	}
	return e.trim(ctx, bytes)
}

func (e *Engine) kickReaper() {
	select {
	case e.reaping.kick <- struct{}{}:
	default:
	}
}

// reaper unpins and unmaps regions the cache has finished draining, and
// reclaims blocks stored by head ranges that are still missing heads after
// Config.PartialTimeout (checked every quarter of it; stores check too).
func (e *Engine) reaper() {
	defer e.wg.Done()
	tick := time.NewTicker(max(e.cfg.PartialTimeout/4, time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-e.reaping.kick:
			e.reap()
		case <-tick.C:
			e.cache.ExpirePartials()
			e.reap()
		case <-e.reaping.stop:
			return
		}
	}
}

func (e *Engine) reap() {
	// One reap at a time: when reap returns, every region the cache had
	// released by the time it was called is unmapped, whoever took it.
	e.reaping.mu.Lock()
	defer e.reaping.mu.Unlock()
	if e.kc == nil {
		return
	}
	ids := e.kc.TakeReleasable(nil)
	if len(ids) == 0 {
		return
	}
	// The region stays in draining (where Trim counts it pending) until it
	// is unmapped and counted.
	for _, id := range ids {
		e.memory.mu.Lock()
		pr := e.memory.draining[id]
		e.memory.mu.Unlock()
		if pr == nil {
			continue
		}
		e.unmapRegion(pr)
		e.stats.trimmedBytes.Add(pr.r.Len())
		e.memory.mu.Lock()
		delete(e.memory.draining, id)
		e.memory.mu.Unlock()
	}
	e.memory.mu.Lock()
	e.notifyLocked()
	e.memory.mu.Unlock()
}

// notifyLocked wakes every Trim waiting for a region to settle. memory.mu held.
func (e *Engine) notifyLocked() {
	close(e.memory.changed)
	e.memory.changed = make(chan struct{})
}

// hold counts slots as having a copy in flight (Trim waits for those, not
// for leases).
func (e *Engine) hold(slots []kvcache.Slot) {
	if e.dial != nil {
		return // gate (dial.go) counted them
	}
	e.memory.mu.Lock()
	forRegionRuns(slots, func(r kvcache.RegionID, n int) { e.memory.inflight[r] += n })
	e.memory.mu.Unlock()
}

// forRegionRuns calls f once per run of consecutive slots in one region,
// with the run's length: a map update a run instead of one a slot (2048
// slots of a few regions: 20–40 µs of a Load's call otherwise).
func forRegionRuns(slots []kvcache.Slot, f func(r kvcache.RegionID, n int)) {
	for i := 0; i < len(slots); {
		j := i + 1
		for j < len(slots) && slots[j].Region == slots[i].Region {
			j++
		}
		f(slots[i].Region, j-i)
		i = j
	}
}

// unhold ends hold; a draining region whose last copy ended wakes Trim.
func (e *Engine) unhold(slots []kvcache.Slot) {
	e.memory.mu.Lock()
	wake := false
	forRegionRuns(slots, func(r kvcache.RegionID, n int) {
		if e.memory.inflight[r] -= n; e.memory.inflight[r] == 0 {
			delete(e.memory.inflight, r)
			wake = wake || e.memory.draining[r] != nil
		}
	})
	if wake {
		e.notifyLocked()
	}
	e.memory.mu.Unlock()
}

func (e *Engine) trim(ctx context.Context, bytes int64) (TrimResult, error) {
	res := TrimResult{RequestedBytes: bytes}
	if bytes <= 0 {
		return res, nil
	}
	e.stats.trims.Add(1)
	e.memory.mu.Lock()
	if e.memory.draining == nil {
		e.memory.draining = map[kvcache.RegionID]*poolRegion{}
	}
	var picked []*poolRegion
	var want int64
	for i := len(e.memory.regions) - 1; i >= 0 && want < bytes; i-- {
		pr := e.memory.regions[i]
		picked = append(picked, pr)
		want += pr.r.Len()
	}
	var pickedBytes int64
	for _, pr := range picked {
		e.memory.regions = slices.DeleteFunc(e.memory.regions, func(x *poolRegion) bool { return x == pr })
		e.memory.draining[pr.id] = pr
		e.memory.owned -= pr.r.Len()
		pickedBytes += pr.planned
	}
	e.memory.mu.Unlock()
	// Growth must not undo the trim: the pool may grow back only to what
	// is left (regions already being grown included), until GrowTo.
	e.growth.mu.Lock()
	e.growth.committed -= pickedBytes
	e.growth.target = min(e.growth.target, e.growth.committed)
	e.growth.mu.Unlock()
	cs := e.cache.Stats()
	for _, pr := range picked {
		if _, err := e.kc.RemoveRegion(pr.id); err != nil {
			return res, err
		}
	}
	res.EvictedBlocks = int(e.cache.Stats().Trimmed - cs.Trimmed)
	res.Regions = len(picked)
	// Wait for the copies in flight on the picked regions, never for
	// leases: a region still leased once its copies are done is pending and
	// is freed by the reaper when its last lease ends.
	for {
		e.reap()
		e.memory.mu.Lock()
		busy := false
		res.FreedBytes, res.PendingBytes = 0, 0
		for _, pr := range picked {
			if e.memory.draining[pr.id] == nil {
				res.FreedBytes += pr.r.Len()
				continue
			}
			res.PendingBytes += pr.r.Len()
			busy = busy || e.memory.inflight[pr.id] > 0
		}
		changed := e.memory.changed
		e.memory.mu.Unlock()
		if !busy {
			return res, nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return res, nil
		}
	}
}
