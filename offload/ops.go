package offload

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/transfer"
)

// copyCompletion is an op's handle in the copy layer. On the host
// backend (events false) there are no CUDA events and a stream wait is a
// wait on the CPU; on CUDA the events are the transfer op's.
type copyCompletion struct {
	op     *transfer.Op
	done   <-chan struct{}
	events bool
	gpu    *transfer.Context
}

func (e *Engine) newCompletion(op *transfer.Op, done <-chan struct{}) *copyCompletion {
	return &copyCompletion{op: op, done: done, events: e.events, gpu: e.gpu}
}

func (c *copyCompletion) event() uintptr {
	if !c.events {
		return 0
	}
	ev, err := c.op.Event()
	if err != nil {
		return 0
	}
	return uintptr(ev)
}

// layerEvent is layer i's event: on the host backend 0, and true only
// for a load submitted with per-layer events (LayerEnds) and i among its
// layers; Op.LayerEvent has checked both (Op.layers) before asking.
func (c *copyCompletion) layerEvent(i int) (uintptr, bool) {
	if i < 0 || i >= c.op.Layers() || c.op.Dir() != transfer.Load {
		return 0, false
	}
	if !c.events {
		return 0, true
	}
	ev, err := c.op.LayerEvent(i)
	if err != nil {
		return 0, false
	}
	return uintptr(ev), true
}

func (c *copyCompletion) streamWait(stream uintptr) error {
	if !c.events {
		<-c.done
		return nil
	}
	ev, err := c.op.Event()
	if err != nil {
		return err
	}
	if err := c.gpu.StreamWaitEvent(transfer.Stream(stream), ev); err != nil {
		return fmt.Errorf("offload: stream %#x waiting on the op's event: %w", stream, err)
	}
	return nil
}

func (c *copyCompletion) release() error { return c.op.Release() }

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

func (e *Engine) namespace(ns string) kvcache.Namespace {
	e.nsMu.Lock()
	defer e.nsMu.Unlock()
	id, ok := e.nsIDs[ns]
	if !ok {
		id = kvcache.Namespace(len(e.nsIDs) + 1)
		e.nsIDs[ns] = id
	}
	return id
}

func (e *Engine) lookup(keys []Key, opts LookupOptions) (LookupResult, error) {
	if !e.enter() {
		return LookupResult{}, fmt.Errorf("%w: Lookup after Close", ErrClosed)
	}
	defer e.leave()
	e.stats.lookups.Add(1)
	e.stats.lookupKeys.Add(int64(len(keys)))
	var res LookupResult
	if opts.Lease {
		n, slots := e.cache.LookupLease(keys, nil)
		res.Hits = n
		if n > 0 {
			res.Lease = &Lease{eng: e, keys: append([]Key(nil), keys[:n]...), slots: slots}
		}
	} else {
		res.Hits = e.cache.Lookup(keys)
	}
	e.stats.hits.Add(int64(res.Hits))
	return res, nil
}

func (e *Engine) unlease(slots []kvcache.Slot) {
	_ = e.cache.Unlease(slots)
	e.kickReaper()
}

// segments builds the copy list of blocks (device side) and slots (host).
func (e *Engine) segments(blockIDs []int, slots []kvcache.Slot, perLayer bool) ([]transfer.Segment, []int, error) {
	var segs []transfer.Segment
	var ks []kvcache.Segment
	for i, id := range blockIDs {
		var err error
		ks, err = e.layout.Segments(id, ks[:0])
		if err != nil {
			return nil, nil, fmt.Errorf("%w: %w", ErrInvalidArgument, err)
		}
		for _, s := range ks {
			segs = append(segs, transfer.Segment{Dev: s.Dev, Host: uint64(slots[i].Addr) + s.Off, Len: s.Len})
		}
	}
	if !perLayer || e.layout.Kind() == kvcache.CrossLayer {
		return segs, nil, nil
	}
	// Regroup layer by layer: every block's segments of layer 0, then 1...
	per := e.layout.SegmentsPerBlock()
	layers := e.layout.Geometry().Layers
	perLayerSegs := per / layers
	out := make([]transfer.Segment, 0, len(segs))
	ends := make([]int, 0, layers)
	for l := 0; l < layers; l++ {
		for b := range blockIDs {
			out = append(out, segs[b*per+l*perLayerSegs:b*per+(l+1)*perLayerSegs]...)
		}
		ends = append(ends, len(out))
	}
	return out, ends, nil
}

func (e *Engine) store(ctx context.Context, keys []Key, blockIDs []int, opts StoreOptions) (*Op, error) {
	if !e.enter() {
		return nil, fmt.Errorf("%w: Store after Close", ErrClosed)
	}
	defer e.leave()
	if err := e.deviceLost(); err != nil {
		return nil, err
	}
	if opts.AfterStream != 0 {
		if opts.After == 0 {
			return nil, fmt.Errorf("%w: Store: AfterStream %#x given without After", ErrInvalidArgument, opts.AfterStream)
		}
		capturing, err := e.dev.IsCapturing(transfer.Stream(opts.AfterStream))
		if err != nil {
			return nil, fmt.Errorf("offload: Store: checking AfterStream %#x: %w", opts.AfterStream, err)
		}
		if capturing {
			return nil, fmt.Errorf("%w: Store: AfterStream %#x is capturing a CUDA graph; a Store cannot be captured (record After outside the capture)", ErrCapturing, opts.AfterStream)
		}
	}
	start := time.Now()
	ns := opts.Namespace
	if ns == "" {
		ns = e.cfg.Namespace
	}
	res, err := e.beginStore(e.namespace(ns), keys, blockIDs, opts)
	if err != nil {
		return nil, err
	}
	op := newOp(e, OpStore, len(keys))
	var idx []int
	var ids []int
	var slots []kvcache.Slot
	for i, r := range res {
		switch r.Outcome {
		case kvcache.StoreWrite:
			idx, ids, slots = append(idx, i), append(ids, r.BlockID), append(slots, r.Slot)
		case kvcache.StorePresent:
			op.setOutcome(i, OutcomeAlreadyPresent, nil)
		case kvcache.StoreRefusedFull:
			op.setOutcome(i, OutcomeRefusedFull, nil)
		default:
			op.setOutcome(i, OutcomeRefusedAdmission, nil)
		}
	}
	if len(slots) == 0 {
		e.finishOp(op, start)
		return op, nil
	}
	fail := func(oc Outcome, cause error) (*Op, error) {
		_ = e.cache.CompleteStore(slots, cause)
		for _, i := range idx {
			if oc == OutcomeFailed {
				op.setOutcome(i, oc, cause)
			} else {
				op.setOutcome(i, oc, nil)
			}
		}
		e.finishOp(op, start)
		return op, nil
	}
	if ctx.Err() != nil {
		return fail(OutcomeCancelled, ctx.Err())
	}
	segs, _, err := e.segments(ids, slots, false)
	if err != nil {
		return fail(OutcomeFailed, err)
	}
	bytes := int64(len(slots)) * e.slot
	e.ops.Add(1)
	e.hold(slots)
	e.stats.inFlightBytes.Add(bytes)
	tdone := make(chan struct{})
	req := transfer.Request{Dir: transfer.Store, Segments: segs, After: transfer.Event(opts.After), Events: e.events,
		OnComplete: e.onTransferDone(op, idx, slots, bytes, start, tdone, OutcomeStored, &e.stats.store,
			func(cerr error) { _ = e.cache.CompleteStore(slots, cerr) })}
	top, err := e.sched.Submit(req)
	if err != nil {
		e.ops.Done()
		e.unhold(slots)
		e.stats.inFlightBytes.Add(-bytes)
		e.noteLost(err)
		switch {
		case errors.Is(err, transfer.ErrBusy):
			return fail(OutcomeRefusedBusy, err)
		case errors.Is(err, transfer.ErrDeviceLost):
			_ = e.cache.CompleteStore(slots, err)
			return nil, fmt.Errorf("%w: Store refused: %w", ErrDeviceLost, err)
		}
		return fail(OutcomeFailed, err)
	}
	op.completion = e.newCompletion(top, tdone)
	return op, nil
}

// storeRun is a maximal run of a Store's keys that form one chain: each
// key's parent is the key before it, the first key's is parent.
type storeRun struct {
	parent   Key
	from, to int // keys[from:to]
}

// storeRuns splits a Store's keys into chains by StoreOptions.Parent and
// Parents, after checking them (ErrInvalidArgument).
func storeRuns(keys []Key, opts StoreOptions) ([]storeRun, error) {
	if opts.Parents == nil {
		return []storeRun{{parent: opts.Parent, from: 0, to: len(keys)}}, nil
	}
	if opts.Parent != (Key{}) {
		return nil, fmt.Errorf("%w: Store: Parent %s and Parents both given; Parents names every key's parent", ErrInvalidArgument, opts.Parent)
	}
	if len(opts.Parents) != len(keys) {
		return nil, fmt.Errorf("%w: Store: %d parents for %d keys", ErrInvalidArgument, len(opts.Parents), len(keys))
	}
	seen := make(map[Key]struct{}, len(keys))
	var runs []storeRun
	for i, k := range keys {
		if _, dup := seen[k]; dup {
			return nil, fmt.Errorf("%w: Store: key %s appears twice (index %d)", ErrInvalidArgument, k, i)
		}
		seen[k] = struct{}{}
		p := opts.Parents[i]
		if p == k {
			return nil, fmt.Errorf("%w: Store: key %s (index %d) is its own parent", ErrInvalidArgument, k, i)
		}
		if i > 0 && p == keys[i-1] {
			runs[len(runs)-1].to = i + 1
			continue
		}
		runs = append(runs, storeRun{parent: p, from: i, to: i + 1})
	}
	return runs, nil
}

// beginStore reserves slots for a Store's keys, one kvcache chain per run
// (storeRuns). A run whose parent was refused earlier in the call is
// refused the same way: no lookup could reach it. On error nothing stays
// reserved.
func (e *Engine) beginStore(ns kvcache.Namespace, keys []Key, blockIDs []int, opts StoreOptions) ([]kvcache.StoreResult, error) {
	runs, err := storeRuns(keys, opts)
	if err != nil {
		return nil, err
	}
	res := make([]kvcache.StoreResult, 0, len(keys))
	var refused map[Key]kvcache.StoreOutcome
	for _, r := range runs {
		if oc, ok := refused[r.parent]; ok {
			for i := r.from; i < r.to; i++ {
				res = append(res, kvcache.StoreResult{Outcome: oc, BlockID: blockIDs[i]})
				refused[keys[i]] = oc
			}
			continue
		}
		n := len(res)
		res, err = e.cache.BeginStore(kvcache.StoreRequest{Namespace: ns, Parent: r.parent, Keys: keys[r.from:r.to], BlockIDs: blockIDs[r.from:r.to]}, res)
		if err != nil {
			var reserved []kvcache.Slot
			for _, x := range res[:n] {
				if x.Outcome == kvcache.StoreWrite {
					reserved = append(reserved, x.Slot)
				}
			}
			_ = e.cache.CompleteStore(reserved, err)
			return nil, fmt.Errorf("%w: Store: %w", ErrInvalidArgument, err)
		}
		for j, x := range res[n:] {
			if x.Outcome == kvcache.StoreRefusedFull || x.Outcome == kvcache.StoreRefusedAdmission {
				if refused == nil {
					refused = map[Key]kvcache.StoreOutcome{}
				}
				refused[keys[r.from+j]] = x.Outcome
			}
		}
	}
	return res, nil
}

func (e *Engine) load(ctx context.Context, keys []Key, blockIDs []int, opts LoadOptions) (*Op, error) {
	if !e.enter() {
		return nil, fmt.Errorf("%w: Load after Close", ErrClosed)
	}
	defer e.leave()
	lease := opts.Lease
	if lease != nil {
		if lease.eng != e {
			return nil, fmt.Errorf("%w: Load with a lease from another engine", ErrInvalidArgument)
		}
		if len(lease.keys) > len(keys) || !slices.Equal(lease.keys, keys[:len(lease.keys)]) {
			return nil, fmt.Errorf("%w: Load: the lease's %d keys must be a prefix of the %d keys loaded", ErrInvalidArgument, len(lease.keys), len(keys))
		}
		// Take the lease over now; give it back to the caller on error.
		if lease.released.Swap(true) {
			return nil, fmt.Errorf("%w: Load with a released lease", ErrReleased)
		}
	}
	op, err := e.loadLeased(ctx, keys, blockIDs, opts)
	if err != nil && lease != nil {
		lease.released.Store(false)
	}
	return op, err
}

// loadLeased is Load once the lease (if any) is owned: the leased prefix
// of keys is copied from the lease's slots, which its reader holds keep
// alive (even if the blocks were trimmed or deleted meanwhile) until the
// copy completes; the other keys are looked up now.
func (e *Engine) loadLeased(ctx context.Context, keys []Key, blockIDs []int, opts LoadOptions) (*Op, error) {
	if err := e.deviceLost(); err != nil {
		return nil, err
	}
	start := time.Now()
	var leased []kvcache.Slot
	if opts.Lease != nil {
		leased = opts.Lease.slots
	}
	n := len(leased)
	res, err := e.cache.BeginLoad(keys[n:], blockIDs[n:], nil)
	if err != nil {
		return nil, fmt.Errorf("%w: Load: %w", ErrInvalidArgument, err)
	}
	op := newOp(e, OpLoad, len(keys))
	if opts.PerLayer && e.layout.Kind() != kvcache.CrossLayer {
		op.layers = e.layout.Geometry().Layers // what segments groups the copies by
	}
	idx, ids, slots := make([]int, 0, len(keys)), make([]int, 0, len(keys)), make([]kvcache.Slot, 0, len(keys))
	for i, s := range leased {
		idx, ids, slots = append(idx, i), append(ids, blockIDs[i]), append(slots, s)
	}
	var looked []kvcache.Slot // the slots BeginLoad took reader holds on
	for j, r := range res {
		if r.Found {
			idx, ids, slots = append(idx, n+j), append(ids, r.BlockID), append(slots, r.Slot)
			looked = append(looked, r.Slot)
		} else {
			op.setOutcome(n+j, OutcomeMissing, nil)
		}
	}
	// end drops every reader hold the op has: BeginLoad's and the lease's.
	end := func() {
		_ = e.cache.EndLoad(looked)
		if n > 0 {
			e.unlease(leased)
		}
	}
	if len(slots) == 0 {
		e.finishOp(op, start)
		return op, nil
	}
	if ctx.Err() != nil {
		end()
		for _, i := range idx {
			op.setOutcome(i, OutcomeCancelled, nil)
		}
		e.finishOp(op, start)
		return op, nil
	}
	segs, ends, err := e.segments(ids, slots, opts.PerLayer)
	if err != nil {
		_ = e.cache.EndLoad(looked)
		return nil, err
	}
	bytes := int64(len(slots)) * e.slot
	e.ops.Add(1)
	e.hold(slots)
	e.stats.inFlightBytes.Add(bytes)
	tdone := make(chan struct{})
	req := transfer.Request{Dir: transfer.Load, Segments: segs, LayerEnds: ends, After: transfer.Event(opts.After),
		Events: e.events, Signal: transfer.Event(opts.Signal),
		OnComplete: e.onTransferDone(op, idx, slots, bytes, start, tdone, OutcomeLoaded, &e.stats.load,
			func(error) { end() })}
	top, err := e.sched.Submit(req)
	if err != nil {
		e.ops.Done()
		e.unhold(slots)
		e.stats.inFlightBytes.Add(-bytes)
		_ = e.cache.EndLoad(looked)
		e.noteLost(err)
		switch {
		case errors.Is(err, transfer.ErrBusy):
			return nil, fmt.Errorf("%w: %w", ErrBusy, err)
		case errors.Is(err, transfer.ErrDeviceLost):
			return nil, fmt.Errorf("%w: Load refused: %w", ErrDeviceLost, err)
		}
		return nil, err
	}
	op.completion = e.newCompletion(top, tdone)
	return op, nil
}

// onTransferDone is the OnComplete of a Store's or Load's copies (bytes
// over slots, for the blocks at idx of op; tdone closes when it returns):
// release drops what the direction holds on the slots (CompleteStore; the
// reader holds and the lease), then the slots are unheld, every block gets
// ok or OutcomeFailed, dir counts a success and op is finished.
func (e *Engine) onTransferDone(op *Op, idx []int, slots []kvcache.Slot, bytes int64, start time.Time, tdone chan struct{},
	ok Outcome, dir *direction, release func(cerr error)) func(*transfer.Op, error) {
	return func(_ *transfer.Op, cerr error) {
		defer e.ops.Done()
		defer close(tdone)
		e.noteLost(cerr)
		e.stats.inFlightBytes.Add(-bytes)
		release(cerr)
		e.unhold(slots)
		oc := ok
		if cerr != nil {
			oc = OutcomeFailed
		}
		for _, i := range idx {
			op.setOutcome(i, oc, cerr)
		}
		if cerr == nil {
			dir.blocks.Add(int64(len(slots)))
			dir.bytes.Add(bytes)
		}
		e.finishOp(op, start)
		e.kickReaper()
	}
}

// noteLost remembers a sticky device error: from then on Store and Load
// refuse new work with ErrDeviceLost and the driver's reason.
func (e *Engine) noteLost(err error) {
	if err != nil && errors.Is(err, transfer.ErrDeviceLost) {
		e.lost.CompareAndSwap(nil, &err)
	}
}

// deviceLost returns the error new work is refused with after a sticky
// device error, nil before.
func (e *Engine) deviceLost() error {
	if p := e.lost.Load(); p != nil {
		return fmt.Errorf("%w: the engine refuses new work: %w", ErrDeviceLost, *p)
	}
	return nil
}

// finishOp counts the op's outcomes and closes it.
func (e *Engine) finishOp(op *Op, start time.Time) {
	d := &e.stats.store
	if op.kind == OpLoad {
		d = &e.stats.load
	}
	op.mu.Lock()
	for _, oc := range op.outcomes {
		e.stats.outcomes[oc].Add(1)
	}
	op.mu.Unlock()
	d.ops.Add(1)
	d.latency.observe(time.Since(start))
	op.finish()
}

func (e *Engine) delete(keys []Key) int {
	n := e.cache.Delete(keys)
	e.stats.deletes.Add(int64(n))
	e.kickReaper()
	return n
}

func (e *Engine) clear(ns string) int {
	e.nsMu.Lock()
	id, ok := e.nsIDs[ns]
	e.nsMu.Unlock()
	if !ok {
		return 0
	}
	n := e.cache.Clear(id)
	e.stats.deletes.Add(int64(n))
	e.kickReaper()
	return n
}

func (e *Engine) snapshot() Stats {
	c := &e.stats
	s := Stats{Backend: e.backend, PoolBytes: e.cfg.PoolBytes, BlockBytes: e.slot,
		PinCalls: c.pinCalls.Load(), UnpinCalls: c.unpinCalls.Load(),
		PinTime: time.Duration(c.pinNanos.Load()), UnpinTime: time.Duration(c.unpinNanos.Load()),
		FirstSlot: time.Duration(c.firstSlot.Load()), FullPool: time.Duration(c.fullPool.Load()), Growth: c.steps.snapshot(),
		Trims: c.trims.Load(), TrimmedBytes: c.trimmedBytes.Load(),
		Lookups: c.lookups.Load(), LookupKeys: c.lookupKeys.Load(), Hits: c.hits.Load(),
		Deletes: c.deletes.Load(), ZeroedSlots: c.zeroed.Load(), InFlightBytes: c.inFlightBytes.Load(),
		Store: c.store.snapshot(), Load: c.load.snapshot()}
	s.Misses = s.LookupKeys - s.Hits
	if c := e.calibration.Load(); c != nil {
		s.CopyCalibration = *c
	}
	if e.cudaDev != nil {
		s.BounceCopies = e.cudaDev.BounceCopies()
		s.DeviceBytes, s.MaxDeviceBytes = e.cudaDev.DeviceBytes(), e.cudaDev.MaxDeviceBytes()
	}
	s.TeardownErrors = c.teardownErrors.Load()
	if m := e.teardownErr.Load(); m != nil {
		s.TeardownError = *m
	}
	for i := range s.Outcomes {
		s.Outcomes[i] = c.outcomes[i].Load()
	}
	e.memMu.Lock()
	s.OwnedBytes, s.Regions, s.StagingUsed = e.owned, len(e.regions), e.stagingUsed
	if e.stagingRegion != nil {
		s.StagingBytes = e.stagingRegion.r.Len()
	}
	e.memMu.Unlock()
	e.growMu.Lock()
	s.RegionsTotal, s.GrowthTargetBytes = len(e.plan), e.target
	s.GrowthPaused = e.paused
	if e.growErr != nil {
		s.GrowthError = e.growErr.Error()
	}
	e.growMu.Unlock()
	if e.cache != nil {
		cs := e.cache.Stats()
		s.SlotsTotal, s.SlotsFree = int64(cs.Slots), int64(cs.Free)
		s.BlocksReady, s.BlocksLeased = int64(cs.Ready+cs.Leased), int64(cs.Leased)
		s.InUseBytes = int64(cs.Writing+cs.Ready+cs.Leased+cs.Releasing) * e.slot
		s.Evictions = int64(cs.Evicted + cs.Rejected + cs.Trimmed)
		s.AdmissionRejections = int64(cs.StoreRefusedAdmission + cs.Rejected)
		s.Orphans = int64(cs.Orphaned)
	}
	return s
}

func (e *Engine) kickReaper() {
	select {
	case e.reapKick <- struct{}{}:
	default:
	}
}

// reaper unpins and unmaps regions the cache has finished draining.
func (e *Engine) reaper() {
	defer e.wg.Done()
	for {
		select {
		case <-e.reapKick:
			e.reap()
		case <-e.stopReap:
			return
		}
	}
}

func (e *Engine) reap() {
	// One reap at a time: when reap returns, every region the cache had
	// released by the time it was called is unmapped, whoever took it.
	e.reapMu.Lock()
	defer e.reapMu.Unlock()
	ids := e.cache.TakeReleasable(nil)
	if len(ids) == 0 {
		return
	}
	// The region stays in draining (where Trim counts it pending) until it
	// is unmapped and counted.
	for _, id := range ids {
		e.memMu.Lock()
		pr := e.draining[id]
		e.memMu.Unlock()
		if pr == nil {
			continue
		}
		e.unmapRegion(pr)
		e.stats.trimmedBytes.Add(pr.r.Len())
		e.memMu.Lock()
		delete(e.draining, id)
		e.memMu.Unlock()
	}
	e.memMu.Lock()
	e.notifyLocked()
	e.memMu.Unlock()
}

// notifyLocked wakes every Trim waiting for a region to settle. memMu held.
func (e *Engine) notifyLocked() {
	close(e.changed)
	e.changed = make(chan struct{})
}

// hold counts slots as having a copy in flight (Trim waits for those, not
// for leases).
func (e *Engine) hold(slots []kvcache.Slot) {
	e.memMu.Lock()
	for _, s := range slots {
		e.inflight[s.Region]++
	}
	e.memMu.Unlock()
}

// unhold ends hold; a draining region whose last copy ended wakes Trim.
func (e *Engine) unhold(slots []kvcache.Slot) {
	e.memMu.Lock()
	wake := false
	for _, s := range slots {
		if e.inflight[s.Region]--; e.inflight[s.Region] == 0 {
			delete(e.inflight, s.Region)
			wake = wake || e.draining[s.Region] != nil
		}
	}
	if wake {
		e.notifyLocked()
	}
	e.memMu.Unlock()
}

func (e *Engine) trim(ctx context.Context, bytes int64) (TrimResult, error) {
	res := TrimResult{RequestedBytes: bytes}
	if bytes <= 0 {
		return res, nil
	}
	e.stats.trims.Add(1)
	e.memMu.Lock()
	if e.draining == nil {
		e.draining = map[kvcache.RegionID]*poolRegion{}
	}
	var picked []*poolRegion
	var want int64
	for i := len(e.regions) - 1; i >= 0 && want < bytes; i-- {
		pr := e.regions[i]
		picked = append(picked, pr)
		want += pr.r.Len()
	}
	var pickedBytes int64
	for _, pr := range picked {
		e.regions = slices.DeleteFunc(e.regions, func(x *poolRegion) bool { return x == pr })
		e.draining[pr.id] = pr
		e.owned -= pr.r.Len()
		pickedBytes += pr.planned
	}
	e.memMu.Unlock()
	// Growth must not undo the trim: the pool may grow back only to what
	// is left (regions already being grown included), until GrowTo.
	e.growMu.Lock()
	e.committed -= pickedBytes
	e.target = min(e.target, e.committed)
	e.growMu.Unlock()
	cs := e.cache.Stats()
	for _, pr := range picked {
		if _, err := e.cache.RemoveRegion(pr.id); err != nil {
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
		e.memMu.Lock()
		busy := false
		res.FreedBytes, res.PendingBytes = 0, 0
		for _, pr := range picked {
			if e.draining[pr.id] == nil {
				res.FreedBytes += pr.r.Len()
				continue
			}
			res.PendingBytes += pr.r.Len()
			busy = busy || e.inflight[pr.id] > 0
		}
		changed := e.changed
		e.memMu.Unlock()
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

// stagingAlign is the alignment of staging buffers (a GPU cache line).
const stagingAlign = 256

func (e *Engine) staging(name string, bytes int64) (*Staging, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("%w: Staging %q of %d bytes: must be at least 1", ErrInvalidArgument, name, bytes)
	}
	e.memMu.Lock()
	defer e.memMu.Unlock()
	if s, ok := e.staged[name]; ok {
		if s.size != bytes {
			return nil, fmt.Errorf("%w: Staging %q exists with %d bytes, asked for %d", ErrInvalidArgument, name, s.size, bytes)
		}
		return s, nil
	}
	if e.stagingRegion == nil {
		return nil, fmt.Errorf("%w: Staging %q: no staging region (Config.StagingBytes < 0)", ErrInsufficientMemory, name)
	}
	off := (e.stagingUsed + stagingAlign - 1) / stagingAlign * stagingAlign
	total := e.stagingRegion.r.Len()
	if off+bytes > total {
		return nil, fmt.Errorf("%w: Staging %q of %d bytes: %d of %d staging bytes left (raise Config.StagingBytes)", ErrInsufficientMemory, name, bytes, total-off, total)
	}
	buf := e.stagingRegion.r.Bytes()[off : off+bytes : off+bytes]
	addr := e.stagingRegion.r.Addr() + uintptr(off)
	s := &Staging{name: name, addr: addr, dev: e.stagingDev + uint64(off), size: bytes, buf: buf}
	e.staged[name] = s
	e.stagingUsed = off + bytes
	return s, nil
}

func (e *Engine) shutdown() error {
	e.closeMu.Lock()
	defer e.closeMu.Unlock()
	e.ops.Wait()
	return e.teardown()
}

// teardown releases everything New built; used by Close and by a failed New.
func (e *Engine) teardown() error {
	e.growMu.Lock()
	e.stopGrow = true
	e.growCond.Broadcast()
	e.growMu.Unlock()
	if e.stopReap != nil {
		close(e.stopReap)
	}
	e.wg.Wait()
	var errs []error
	if e.sched != nil {
		errs = append(errs, e.sched.Close())
	}
	if e.cache != nil {
		e.cache.Close()
	}
	e.memMu.Lock()
	all := append([]*poolRegion(nil), e.regions...)
	for _, pr := range e.draining {
		all = append(all, pr)
	}
	if e.stagingRegion != nil {
		all = append(all, e.stagingRegion)
	}
	e.regions, e.draining, e.stagingRegion, e.owned = nil, nil, nil, 0
	e.memMu.Unlock()
	for _, pr := range all {
		errs = append(errs, e.unmapRegion(pr))
	}
	errs = append(errs, e.closeCUDADevice(), e.releaseContext())
	if e.denseAlloc != 0 {
		errs = append(errs, e.sim.MemFree(e.denseAlloc))
	}
	if e.ownSim && e.sim != nil {
		errs = append(errs, e.sim.Close())
	}
	return errors.Join(errs...)
}
