package offload

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/kvoffload/kvoffload/internal/tiered"
	"github.com/kvoffload/kvoffload/kvcache"
)

// Prefetch promotes keys the pool lacks from disk, then the cluster tier.
func (e *Engine) Prefetch(ctx context.Context, keys []Key, opts PrefetchOptions) (PrefetchResult, error) {
	if err := e.checkOpen("Prefetch"); err != nil {
		return PrefetchResult{}, err
	}
	if opts.Timeout < 0 {
		return PrefetchResult{}, fmt.Errorf("%w: Prefetch: Timeout %v is negative", ErrInvalidArgument, opts.Timeout)
	}
	if opts.Policy > PrefetchBestEffort {
		return PrefetchResult{}, fmt.Errorf("%w: Prefetch: Policy %d, want PrefetchWait (0) or PrefetchBestEffort (1)", ErrInvalidArgument, opts.Policy)
	}
	if !e.enter() {
		return PrefetchResult{}, fmt.Errorf("%w: Prefetch after Close", ErrClosed)
	}
	if len(keys) == 0 || (e.disk == nil && e.cluster == nil) {
		e.leave()
		return PrefetchResult{}, nil
	}
	if opts.Policy == PrefetchBestEffort {
		return e.prefetchBackground(keys, opts), nil
	}
	defer e.leave()
	return e.prefetch(ctx, keys, opts), nil
}

// prefetchBackground runs a PrefetchBestEffort call's promotion on a
// goroutine that holds the engine open (enter, taken by the caller) until
// it ends; Close cancels its context.
func (e *Engine) prefetchBackground(keys []Key, opts PrefetchOptions) PrefetchResult {
	bg := &e.background
	bg.mu.Lock()
	bg.start()
	if bg.running >= MaxBackgroundPrefetches {
		bg.mu.Unlock()
		e.leave()
		e.stats.prefetchRefused.Add(1)
		return PrefetchResult{}
	}
	bg.running++
	ctx := bg.ctx
	bg.mu.Unlock()
	keys = slices.Clone(keys)
	e.stats.prefetchBackground.Add(1)
	go func() {
		defer func() {
			bg.mu.Lock()
			bg.running--
			bg.mu.Unlock()
			e.leave()
		}()
		r := e.prefetch(ctx, keys, opts)
		e.stats.prefetchBackgroundPromoted.Add(int64(r.Promoted))
	}()
	return PrefetchResult{Background: true}
}

// cancelBackground ends the background prefetches' waits (Close).
func (e *Engine) cancelBackground() {
	bg := &e.background
	bg.mu.Lock()
	defer bg.mu.Unlock()
	bg.start()
	bg.cancel()
}

// backgroundPrefetches are the PrefetchBestEffort calls running.
type backgroundPrefetches struct {
	mu      sync.Mutex
	ctx     context.Context // canceled by Close
	cancel  context.CancelFunc
	running int
}

// start makes the context (mu held), once.
func (b *backgroundPrefetches) start() {
	if b.ctx == nil {
		b.ctx, b.cancel = context.WithCancel(context.Background())
	}
}

// prefetch is Prefetch's promotion (the engine entered), bounded by ctx
// and opts.Timeout.
func (e *Engine) prefetch(ctx context.Context, keys []Key, opts PrefetchOptions) PrefetchResult {
	if opts.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, opts.Timeout)
		defer cancel()
	}
	var res PrefetchResult
	if e.disk != nil && ctx.Err() == nil {
		res.FromDisk = e.promoteKeys(keys, func(pkeys []Key, mems [][]byte) []bool {
			return e.readDisk(ctx, pkeys, mems)
		}, e.disk.Promoted, true)
	}
	if e.cluster != nil && ctx.Err() == nil && !e.cluster.Available() {
		// Not connected (yet): no slot is reserved for what cannot come.
		e.stats.clusterUnavailable.Add(int64(len(keys)))
	} else if e.cluster != nil && ctx.Err() == nil {
		timeout := opts.Timeout
		if timeout == 0 {
			timeout = e.cfg.Cluster.Timeout
		}
		gctx, cancel := context.WithTimeout(ctx, timeout)
		res.FromCluster = e.promoteKeys(keys, func(pkeys []Key, mems [][]byte) []bool {
			ks := make([][16]byte, len(pkeys))
			for i, k := range pkeys {
				ks[i] = k
			}
			// Straight into the reserved slots: a slot whose record
			// fails a check is released below, never made ready.
			return e.cluster.GetDirect(gctx, ks, mems)
		}, nil, false)
		cancel()
	}
	res.Promoted = res.FromDisk + res.FromCluster
	return res
}

// promoteKeys reserves host slots, as a Store would, for the keys of the
// chain keys that the pool lacks (onDisk: only those with a disk record),
// has read fill the slots' bytes (ok[i]: mems[i] holds keys[i]'s verified
// block), makes the filled slots ready and releases the others. count, when
// set, gets the good and bad counts. It returns the blocks made ready.
func (e *Engine) promoteKeys(keys []Key, read func(keys []Key, mems [][]byte) []bool, count func(good, bad int), onDisk bool) int {
	var pkeys, parents []Key
	for j, k := range keys {
		if onDisk && !e.disk.Has(k) {
			continue
		}
		var p Key
		if j > 0 {
			p = keys[j-1]
		}
		pkeys, parents = append(pkeys, k), append(parents, p)
	}
	if len(pkeys) == 0 {
		return 0
	}
	// Block ids name GPU blocks; a promotion copies none, so any valid one
	// does (0: a layout has at least one block).
	sres, err := e.beginStore(e.namespace(e.cfg.Namespace), kvcache.HeadRange{}, pkeys, make([]int, len(pkeys)), StoreOptions{Parents: parents})
	if err != nil {
		return 0
	}
	var slots []kvcache.Slot
	var rkeys []Key
	var mems [][]byte
	var lost []kvcache.Slot // reserved slots whose memory is gone
	for i, r := range sres {
		if r.Outcome != kvcache.StoreWrite {
			continue
		}
		mem := e.slotBytes(r.Slot)
		if mem == nil {
			lost = append(lost, r.Slot)
			continue
		}
		slots, rkeys, mems = append(slots, r.Slot), append(rkeys, pkeys[i]), append(mems, mem)
	}
	if len(lost) > 0 {
		_ = e.cache.CompleteStore(lost, errClusterMiss)
	}
	if len(slots) == 0 {
		return 0
	}
	e.hold(slots)
	ok := read(rkeys, mems)
	e.unhold(slots)
	cause := errClusterMiss
	if onDisk {
		cause = errDiskMiss
	}
	good, err := tiered.Settle(e.cache, slots, ok, cause, count)
	if good == 0 || err != nil {
		return 0
	}
	e.kickReaper()
	return good
}

// readDisk reads the disk records of keys into mems, tiered.Readers at a
// time (Tier.Read); once ctx is done no more reads start (those keys are
// misses).
func (e *Engine) readDisk(ctx context.Context, keys []Key, mems [][]byte) []bool {
	ok := make([]bool, len(keys))
	e.disk.Read(ctx, keys, mems, func(i int, good bool) { ok[i] = good })
	return ok
}
