package offload

// Lookup, namespaces, Delete and Clear, and what Store and Load share:
// onTransferDone (their copies' OnComplete), finishOp, the sticky device
// error (noteLost, deviceLost) and tracePoint. Locks: lookup holds closeMu
// for reading (enter) for the call; namespace and clear take names.mu for
// the map alone, finishOp Op.mu; onTransferDone runs on transfer's
// goroutines, without closeMu, and takes memory.mu (unhold) and Op.mu
// (setOutcome) inside those helpers.

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/transfer"
)

func (e *Engine) namespace(ns string) kvcache.Namespace {
	e.names.mu.Lock()
	defer e.names.mu.Unlock()
	id, ok := e.names.ids[ns]
	if !ok {
		id = kvcache.Namespace(len(e.names.ids) + 1)
		e.names.ids[ns] = id
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
	var slots []kvcache.Slot
	switch ni, dialed := e.cache.(*nodeIndex); {
	case dialed:
		// The node's disk tier answers in the same round trip.
		res.Hits, res.DiskHits, slots = ni.lookupTiers(keys, opts.Lease, nil)
		e.stats.diskLookupHits.Add(int64(res.DiskHits))
	case opts.Lease:
		res.Hits, slots = e.cache.LookupLease(keys, nil)
	default:
		res.Hits = e.cache.Lookup(keys)
	}
	if opts.Lease && res.Hits > 0 {
		res.Lease = &Lease{eng: e, keys: append([]Key(nil), keys[:res.Hits]...), slots: slots}
	}
	e.stats.hits.Add(int64(res.Hits))
	if e.disk != nil {
		e.disk.Saw(keys)
		res.DiskHits = e.disk.Prefix(keys[res.Hits:])
		e.stats.diskLookupHits.Add(int64(res.DiskHits))
	}
	return res, nil
}

func (e *Engine) unlease(slots []kvcache.Slot) {
	_ = e.cache.Unlease(slots)
	e.kickReaper()
}

// onTransferDone is the OnComplete of a Store's or Load's copies (bytes
// over slots, for the blocks at idx of op; tdone closes when it returns):
// release drops what the direction holds on the slots (CompleteStore; the
// reader holds and the lease), then the slots are unheld, every block gets
// ok or OutcomeFailed, dir counts a success and finish runs (it finishes
// the op, or counts a part of a Load's run).
func (e *Engine) onTransferDone(op *Op, idx []int, slots []kvcache.Slot, bytes int64, finish func(), tdone chan struct{},
	ok Outcome, dir *direction, release func(cerr error) error) func(*transfer.Op, error) {
	return func(_ *transfer.Op, cerr error) {
		defer e.ops.Done()
		defer close(tdone)
		e.noteLost(cerr)
		e.stats.inFlightBytes.Add(-bytes)
		if rerr := release(cerr); cerr == nil {
			cerr = rerr // a commit the node refused: not stored
		}
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
		finish()
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
	if op.kind == transfer.Load {
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
	if e.disk != nil {
		e.disk.Delete(keys)
	}
	e.stats.deletes.Add(int64(n))
	e.kickReaper()
	return n
}

func (e *Engine) clear(ns string) int {
	if e.disk != nil {
		// Records carry no namespace: the whole disk tier goes (also
		// when this engine stored nothing in ns, as after a restart).
		e.disk.Clear()
		if e.hooks.afterDiskClear != nil {
			e.hooks.afterDiskClear()
		}
	}
	e.clearCluster(ns)
	e.names.mu.Lock()
	id, ok := e.names.ids[ns]
	e.names.mu.Unlock()
	if !ok {
		return 0
	}
	n := e.cache.Clear(id)
	if e.disk != nil {
		// Again: a block of ns evicted between the first clearAll and the
		// cache's Clear was handed to the disk after it (its write then
		// outlives the first clear); this one deletes it, written or
		// in flight.
		e.disk.Clear()
	}
	e.stats.deletes.Add(int64(n))
	e.kickReaper()
	return n
}

// tracePoint calls engineHooks.trace (the scheduler's Config.Trace too:
// a test's, or traceCallsEnv's tracer) at a point of a call on the
// caller's goroutine; a nil check where neither is set.
func (e *Engine) tracePoint(name string) {
	if e.hooks.trace != nil {
		e.hooks.trace(name, -1)
	}
}
