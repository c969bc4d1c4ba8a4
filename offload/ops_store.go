package offload

// Store: store, beginStore (a Store's slots reserved, one kvcache chain
// per run) and storeRuns. Locks: store holds closeMu for reading (enter)
// for the whole call; under it names.mu (namespace), memory.mu (gate,
// hold, unhold), hub.mu (noteStore, forget) and Op.mu (setOutcome,
// finishOp) are each taken and released inside those helpers, and the
// cache and the disk tier take their own. Its OnComplete (onTransferDone)
// runs on transfer's goroutines, without closeMu.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/transfer"
)

func (e *Engine) store(ctx context.Context, l *kvcache.Layout, keys []Key, blockIDs []int, opts StoreOptions) (*Op, error) {
	if !e.enter() {
		return nil, fmt.Errorf("%w: Store after Close", ErrClosed)
	}
	defer e.leave()
	if err := e.deviceLost(); err != nil {
		return nil, err
	}
	// The engine's threads wake while the store is prepared (see
	// transfer.Scheduler.Prewake).
	e.sched.Prewake()
	defer e.sched.PrewakeDone()
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
	if err := checkTokens(len(keys), opts.Tokens, e.cfg.Layout.TokensPerBlock); err != nil {
		return nil, err
	}
	if e.disk != nil {
		e.disk.Saw(keys)
	}
	res, err := e.beginStore(e.namespace(ns), l.Heads(), keys, blockIDs, opts)
	if err != nil {
		return nil, err
	}
	op := newOp(e, transfer.Store, len(keys))
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
		case storeRefusedBusy:
			op.setOutcome(i, OutcomeRefusedBusy, nil)
		default:
			op.setOutcome(i, OutcomeRefusedAdmission, nil)
		}
	}
	if len(slots) == 0 {
		e.finishOp(op, start)
		return op, nil
	}
	e.hub.noteStore(keys, idx, slots, opts, e.cfg.Layout.TokensPerBlock)
	wt, wtCluster := e.writeThroughKeys(ns, keys, idx)
	fail := func(oc Outcome, cause error) (*Op, error) {
		_ = e.cache.CompleteStore(slots, cause)
		e.hub.forget(slots)
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
	req, err := e.copyPlan(l, ids, slots, false)
	if err != nil {
		return fail(OutcomeFailed, err)
	}
	bytes := int64(len(slots)) * e.rankBytes(l)
	e.ops.Add(1)
	e.hold(slots)
	e.stats.inFlightBytes.Add(bytes)
	tdone := make(chan struct{})
	req.Dir, req.After, req.Events = transfer.Store, transfer.Event(opts.After), e.events
	req.OnComplete = e.onTransferDone(op, idx, slots, bytes, func() { e.finishOp(op, start) }, tdone, OutcomeStored, &e.stats.store,
		func(cerr error) error {
			// Only the blocks this completion made ready (every head
			// stored) are written through; the KV events of those alone
			// went out from the cache's OnIndex.
			ready, err := e.cache.CompleteStoreReady(slots, cerr, nil)
			e.hub.forget(endedStores(slots, ready, cerr))
			if cerr == nil && err == nil {
				e.writeThrough(readyKeys(wt, slots, ready), ready, wtCluster) // the cluster tier leases what it copies later
			}
			return e.commitFailed(err)
		})
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
			e.hub.forget(slots)
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
func (e *Engine) beginStore(ns kvcache.Namespace, heads kvcache.HeadRange, keys []Key, blockIDs []int, opts StoreOptions) ([]kvcache.StoreResult, error) {
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
		res, err = e.cache.BeginStore(kvcache.StoreRequest{Namespace: ns, Parent: r.parent, Keys: keys[r.from:r.to], BlockIDs: blockIDs[r.from:r.to], Heads: heads}, res)
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
