package offload

// Load: load, loadLeased (the lease taken over, the lookup, the disk
// tier's promotions) and loadRun, a Load's copies over one or more
// transfer ops and the completion over them. Locks: load holds closeMu for
// reading (enter) for the whole call; under it memory.mu (gate, hold,
// unhold) and Op.mu (setOutcome, finishOp) are each taken and released
// inside those helpers, and the cache and the promotions (disk.go) take
// their own. loadRun has no lock: only the Load's thread appends to
// parts, pending is atomic and done a channel; the parts' OnComplete
// (onTransferDone) runs on transfer's goroutines, without closeMu.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/transfer"
)

func (e *Engine) load(ctx context.Context, l *kvcache.Layout, keys []Key, blockIDs []int, opts LoadOptions) (*Op, error) {
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
	op, err := e.loadLeased(ctx, l, keys, blockIDs, opts)
	if err != nil && lease != nil {
		lease.released.Store(false)
	}
	return op, err
}

// loadLeased is Load once the lease (if any) is owned: the leased prefix
// of keys is copied from the lease's slots, which its reader holds keep
// alive (even if the blocks were trimmed or deleted meanwhile) until the
// copy completes; the other keys are looked up now. With a disk tier, the
// keys the pool lacks but the disk holds are promoted (promoteChunks): the
// blocks found in the pool are submitted first, then each chunk of
// promoted blocks as its reads complete (a loadRun of several transfer
// ops), so disk reads and copies overlap. Load returns once the last
// chunk is submitted. An engine of Dial does the same with the node's
// disk tier (promoteNode): its BeginLoad leaves the keys the node's disk
// holds unread (beginLoadTiers, the same round trip), and the node
// promotes them a chunk a request, reading the next chunk while this
// engine copies the one before.
func (e *Engine) loadLeased(ctx context.Context, l *kvcache.Layout, keys []Key, blockIDs []int, opts LoadOptions) (*Op, error) {
	if err := e.deviceLost(); err != nil {
		return nil, err
	}
	e.sched.Prewake() // see store
	defer e.sched.PrewakeDone()
	start := time.Now()
	e.tracePoint("load")
	var leased []kvcache.Slot
	if opts.Lease != nil {
		leased = opts.Lease.slots
	}
	n := len(leased)
	rp, _ := e.loadResults.Get().(*[]kvcache.LoadResult)
	if rp == nil || cap(*rp) < len(keys)-n {
		rp = new(make([]kvcache.LoadResult, 0, len(keys)-n))
	}
	defer func() {
		clear(*rp) // no slot handles kept past the call
		*rp = (*rp)[:0]
		e.loadResults.Put(rp)
	}()
	ni, dialed := e.cache.(*nodeIndex)
	var res []kvcache.LoadResult
	var lower []int // with dialed: the keys[n:] indices the node's disk holds and its pool lacks
	var err error
	if dialed {
		res, lower, err = ni.beginLoadTiers(keys[n:], blockIDs[n:], (*rp)[:0], nil)
	} else {
		res, err = e.cache.BeginLoad(keys[n:], blockIDs[n:], (*rp)[:0])
	}
	*rp = res
	if err != nil {
		if errors.Is(err, ErrUnavailable) {
			return nil, fmt.Errorf("offload: Load: %w", err)
		}
		return nil, fmt.Errorf("%w: Load: %w", ErrInvalidArgument, err)
	}
	e.tracePoint("begun")
	op := newOp(e, transfer.Load, len(keys))
	if opts.PerLayer && l.Kind() != kvcache.CrossLayer {
		op.layers = l.Geometry().Layers // what segments groups the copies by
	}
	idx, ids, slots := make([]int, 0, len(keys)), make([]int, 0, len(keys)), make([]kvcache.Slot, 0, len(keys))
	for i, s := range leased {
		idx, ids, slots = append(idx, i), append(ids, blockIDs[i]), append(slots, s)
	}
	var promote []int // keys[n:] indices the disk holds and the pool lacks
	onDisk := e.disk != nil && ctx.Err() == nil
	if ctx.Err() != nil {
		lower = nil // not promoted: missing
	}
	for j, r := range res {
		switch {
		case r.Found:
			idx, ids, slots = append(idx, n+j), append(ids, r.BlockID), append(slots, r.Slot)
		case len(lower) > 0 && lower[0] == j: // on the node's disk
			lower = lower[1:]
			fallthrough
		case onDisk && e.disk.Has(keys[n+j]):
			promote = append(promote, j)
			op.setOutcome(n+j, OutcomeMissing, nil) // until a chunk copies it
		default:
			op.setOutcome(n+j, OutcomeMissing, nil)
		}
	}
	// looked: the slots BeginLoad took reader holds on (after the lease's).
	looked := slots[n:]
	// end drops every reader hold the host part has: BeginLoad's and the
	// lease's.
	end := func() {
		_ = e.cache.EndLoad(looked)
		if n > 0 {
			e.unlease(leased)
		}
	}
	if len(slots) == 0 && len(promote) == 0 {
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
	run := e.newLoadRun(op, l, opts, start)
	if len(slots) > 0 {
		if err := run.submit(idx, ids, slots, end); err != nil {
			_ = e.cache.EndLoad(looked) // the lease goes back to the caller (load)
			return nil, err
		}
	}
	if len(promote) > 0 {
		ready := func(chunk []int, lres []kvcache.LoadResult) {
			var cidx, cids []int
			var cslots []kvcache.Slot
			for i, r := range lres {
				if r.Found {
					cidx, cids, cslots = append(cidx, n+chunk[i]), append(cids, r.BlockID), append(cslots, r.Slot)
				}
			}
			if len(cslots) == 0 {
				return
			}
			end := func() { _ = e.cache.EndLoad(cslots) }
			if ctx.Err() != nil {
				end()
				for _, i := range cidx {
					op.setOutcome(i, OutcomeCancelled, nil)
				}
				return
			}
			if err := run.submit(cidx, cids, cslots, end); err != nil {
				end()
				for _, i := range cidx {
					op.setOutcome(i, OutcomeFailed, err)
				}
			}
		}
		if dialed {
			for _, j := range e.promoteNode(ctx, ni, keys[n:], blockIDs[n:], promote, ready) {
				op.setOutcome(n+j, OutcomeCancelled, nil) // not asked for: ctx ended
			}
		} else {
			e.promoteChunks(keys[n:], blockIDs[n:], promote, ready)
		}
	}
	run.submitted()
	if opts.Signal != 0 && len(run.parts) > 0 {
		// The caller may launch work that waits on its Signal (a graph's
		// event-wait node) as soon as Load returns: the Signal must be
		// recorded by then, so this Load returns once its copies are
		// enqueued. A failure there is the op's, reported by its outcomes.
		_, _ = run.tail().op.Event()
	}
	return op, nil
}

// loadRun is one Load's copies over one or more transfer ops (parts): the
// blocks found in the pool, then a part per chunk of blocks promoted from
// disk. The op is finished once every part has completed and the Load has
// submitted its last (pending counts the parts in flight, plus one until
// then).
//
// Ordering: every part waits on the caller's After, and the parts go to
// the engine's load stream in the order submitted, where an event recorded
// follows every copy enqueued before it (cudadev.CUDA's tail). So with
// CUDA events (or a Signal, recorded after every part's copies) the last
// part's events follow every copy of the Load: the op's Event,
// LayerEvent(i) (after layer i of the last part and of every part before
// it), StreamWait and Signal (recorded by every part, the last record
// wins) are the last part's. On the host backend without a Signal
// StreamWait waits on the CPU for every part.
type loadRun struct {
	e     *Engine
	op    *Op
	l     *kvcache.Layout
	opts  LoadOptions
	start time.Time
	chain bool // the parts have events (CUDA) or a Signal

	parts   []*copyCompletion // submitted, in order (the Load's thread only)
	pending atomic.Int32
	done    chan struct{} // closed when every part has completed
}

func (e *Engine) newLoadRun(op *Op, l *kvcache.Layout, opts LoadOptions, start time.Time) *loadRun {
	r := &loadRun{e: e, op: op, l: l, opts: opts, start: start, chain: e.events || opts.Signal != 0,
		done: make(chan struct{})}
	r.pending.Store(1)
	return r
}

// submit submits one part: the blocks at idx of the op, copied from slots
// into ids; end drops the reader holds on slots once the copies are done.
// On error nothing of the part is in flight and end has not run: the
// caller drops the holds and gives the blocks their outcome.
func (r *loadRun) submit(idx, ids []int, slots []kvcache.Slot, end func()) error {
	e := r.e
	e.tracePoint("plan")
	req, err := e.copyPlan(r.l, ids, slots, r.opts.PerLayer)
	if err != nil {
		return err
	}
	e.tracePoint("planned")
	bytes := int64(len(slots)) * e.rankBytes(r.l)
	e.ops.Add(1)
	e.hold(slots)
	e.stats.inFlightBytes.Add(bytes)
	r.pending.Add(1)
	tdone := make(chan struct{})
	req.Dir, req.After, req.Events, req.Signal = transfer.Load, transfer.Event(r.opts.After), r.chain, transfer.Event(r.opts.Signal)
	req.OnComplete = e.onTransferDone(r.op, idx, slots, bytes, r.partDone, tdone, OutcomeLoaded, &e.stats.load,
		func(error) error { end(); return nil })
	e.tracePoint("held")
	top, err := e.sched.Submit(req)
	if err != nil {
		e.ops.Done()
		e.unhold(slots)
		e.stats.inFlightBytes.Add(-bytes)
		r.pending.Add(-1)
		e.noteLost(err)
		switch {
		case errors.Is(err, transfer.ErrBusy):
			return fmt.Errorf("%w: %w", ErrBusy, err)
		case errors.Is(err, transfer.ErrDeviceLost):
			return fmt.Errorf("%w: Load refused: %w", ErrDeviceLost, err)
		}
		return err
	}
	r.parts = append(r.parts, e.newCompletion(top, tdone))
	return nil
}

// partDone is a part's finish (onTransferDone): the last one finishes the
// op.
func (r *loadRun) partDone() {
	if r.pending.Add(-1) == 0 {
		close(r.done)
		r.e.finishOp(r.op, r.start)
	}
}

// submitted ends the submitting: the op gets its completion (the one part's
// own, or the run's over several), then the Load's count is dropped.
func (r *loadRun) submitted() {
	switch len(r.parts) {
	case 0:
	case 1:
		r.op.completion = r.parts[0]
	default:
		r.op.completion = r
	}
	r.partDone()
}

// The completion over several parts: the last part's events (see loadRun).

func (r *loadRun) tail() *copyCompletion { return r.parts[len(r.parts)-1] }

func (r *loadRun) event() (uintptr, error) { return r.tail().event() }

func (r *loadRun) layerEvent(i int) (uintptr, bool, error) { return r.tail().layerEvent(i) }

func (r *loadRun) streamWait(stream uintptr) error {
	if !r.e.events {
		<-r.done
		return nil
	}
	return r.tail().streamWait(stream)
}

func (r *loadRun) release() error {
	var first error
	for _, p := range r.parts {
		if err := p.release(); err != nil && first == nil {
			first = err
		}
	}
	return first
}
