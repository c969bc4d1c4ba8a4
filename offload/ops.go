package offload

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

func (c *copyCompletion) event() (uintptr, error) {
	if !c.events {
		return 0, nil
	}
	ev, err := c.op.Event()
	if err != nil {
		return 0, fmt.Errorf("offload: the op's event: %w", err)
	}
	return uintptr(ev), nil
}

// layerEvent is layer i's event: on the host backend 0, and ok only for
// a load submitted with per-layer events (LayerEnds) and i among its
// layers; Op.LayerEvent has checked both (Op.layers) before asking. err:
// the op failed before the event was recorded.
func (c *copyCompletion) layerEvent(i int) (ev uintptr, ok bool, err error) {
	if i < 0 || i >= c.op.Layers() || c.op.Dir() != transfer.Load {
		return 0, false, nil
	}
	if !c.events {
		return 0, true, nil
	}
	tev, err := c.op.LayerEvent(i)
	if err != nil {
		return 0, true, fmt.Errorf("offload: layer %d's event: %w", i, err)
	}
	return uintptr(tev), true, nil
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
		e.disk.saw(keys)
		res.DiskHits = e.disk.prefix(keys[res.Hits:])
		e.stats.diskLookupHits.Add(int64(res.DiskHits))
	}
	return res, nil
}

func (e *Engine) unlease(slots []kvcache.Slot) {
	_ = e.cache.Unlease(slots)
	e.kickReaper()
}

// partSegments is about how many segments one part of a copy that is not
// split by layer holds: the engine builds and enqueues a part at a time
// (transfer's builders build the next ones while it is enqueued), so the first
// part's copies run while the next are built.
const partSegments = 4096

// partStarts cuts n blocks into parts of per blocks, the first growth
// ones smaller (with growth 5: a 32nd, a 16th, an eighth, a quarter, a half
// of per, at least one block each), so that the first copies start after a
// small part is built (building and enqueueing a part of 4096 segments took
// about 0.2 ms on the H200 machine, the DMA of the first 2 MiB blocks 40 µs
// each); it returns the parts' first blocks and n.
func partStarts(n, per, growth int) []int {
	starts := []int{0}
	for i, k := 0, 0; i < n; k++ {
		size := per
		if k < growth {
			size = per >> (growth - k)
		}
		i = min(n, i+max(1, size))
		starts = append(starts, i)
	}
	return starts
}

// copyPlan checks the device block ids of a Store or Load and returns the
// request's Build (the segments of blocks and their host slots, built by
// the engine's scheduler when it issues the op), its number of parts,
// whether the parts are layers (perLayer and a layout with layers), and
// the bytes the parts copy.
// blockIDs and slots must not change until the op completes.
//
// The segments are layout l's: the rank's heads (Layout.Segments, which
// is SegmentsRange of the rank's head range, the range a head-range store
// was granted), 2-D where the device is token-major; a load reads just
// those heads of the slot. transfer never coalesces 2-D segments.
func (e *Engine) copyPlan(l *kvcache.Layout, blockIDs []int, slots []kvcache.Slot, perLayer bool) (transfer.Request, error) {
	for _, id := range blockIDs {
		if err := l.CheckBlock(id); err != nil {
			return transfer.Request{}, fmt.Errorf("%w: %w", ErrInvalidArgument, err)
		}
	}
	ks, err := l.Segments(blockIDs[0], nil)
	if err != nil {
		return transfer.Request{}, fmt.Errorf("%w: %w", ErrInvalidArgument, err)
	}
	var perBlock uint64
	for _, s := range ks {
		perBlock += s.Len
	}
	if err := e.gate(slots); err != nil {
		return transfer.Request{}, err // a node's region gone (Dial)
	}
	// Build may run for several parts at once (transfer's builders): each
	// call has its own scratch for a block's segments.
	perSegs := len(ks)
	add := func(dst []transfer.Segment, bs []kvcache.Segment, i int) []transfer.Segment {
		host := uint64(slots[i].Addr)
		// Field by field into dst: a Segment built by value and appended
		// stalled on store forwarding (most of this function's time).
		n := len(dst)
		dst = slices.Grow(dst, len(bs))[:n+len(bs)]
		for j := range bs {
			s, d := &bs[j], &dst[n+j]
			d.Dev, d.Host, d.Len = s.Dev, host+s.Off, s.Len
			d.Rows, d.RowLen, d.DevPitch, d.HostPitch = s.Rows, s.RowLen, s.DevPitch, s.HostPitch
		}
		return dst
	}
	req := transfer.Request{Bytes: perBlock * uint64(len(blockIDs))}
	if tp := e.templatePlan(l, ks, blockIDs, slots, perLayer); tp != nil {
		return tp(req), nil
	}
	ps := partSegments
	if e.hooks.partSegments > 0 {
		ps = e.hooks.partSegments
	}
	if perLayer && l.Kind() != kvcache.CrossLayer {
		// One part a layer, but for the first layer, whose event the
		// caller waits for first: its parts grow from a small one
		// (partStarts), so its copies start once a few blocks are built
		// rather than all of them.
		layers := l.Geometry().Layers
		first := []int{0, len(blockIDs)}
		if !e.hooks.wholeFirstLayer {
			first = partStarts(len(blockIDs), max(1, ps/max(1, perSegs/layers)), e.hooks.partGrowth)
		}
		req.Layered = true
		req.Parts = layers + len(first) - 2
		if len(first) > 2 {
			req.LayerParts = make([]int, layers)
			req.LayerParts[0] = len(first) - 1
			for i := 1; i < layers; i++ {
				req.LayerParts[i] = 1
			}
		}
		req.Build = func(p int, dst []transfer.Segment) ([]transfer.Segment, error) {
			layer, from, to := 0, 0, len(blockIDs)
			if p < len(first)-1 {
				from, to = first[p], first[p+1]
			} else {
				layer = p - (len(first) - 2)
			}
			bs := make([]kvcache.Segment, 0, perSegs)
			var err error
			for i := from; i < to; i++ {
				if bs, err = l.LayerSegments(blockIDs[i], layer, bs[:0]); err != nil {
					return dst, err
				}
				dst = add(dst, bs, i)
			}
			return dst, nil
		}
		return req, nil
	}
	starts := partStarts(len(blockIDs), max(1, ps/perSegs), e.hooks.partGrowth)
	req.Parts = len(starts) - 1
	req.Build = func(p int, dst []transfer.Segment) ([]transfer.Segment, error) {
		bs := make([]kvcache.Segment, 0, perSegs)
		var err error
		for i := starts[p]; i < starts[p+1]; i++ {
			if bs, err = l.Segments(blockIDs[i], bs[:0]); err != nil {
				return dst, err
			}
			dst = add(dst, bs, i)
		}
		return dst, nil
	}
	return req, nil
}

// templatePlan returns, for a layout whose segments are strided (a TP
// rank's heads of token-major tensors) on a scheduler that copies
// templates, the function that completes req as a template request: one
// part (every block), or with perLayer one part a layer, each copied as
// one template launch (transfer.Template: the block's pieces once, then a
// slot address and block id a block), Build the same parts' segments.
// Otherwise nil: the parts are cut for Build alone. ks is a block's
// segments, as copyPlan got them.
func (e *Engine) templatePlan(l *kvcache.Layout, ks []kvcache.Segment, blockIDs []int, slots []kvcache.Slot, perLayer bool) func(transfer.Request) transfer.Request {
	if e.hooks.noTemplates || !slices.ContainsFunc(ks, kvcache.Segment.Strided) || l.Kind() == kvcache.CrossLayer ||
		!e.sched.Templates(transfer.Store) || !e.sched.Templates(transfer.Load) {
		return nil
	}
	base, err := l.Segments(0, nil)
	if err != nil || len(base) != len(ks) {
		return nil
	}
	layers := l.Geometry().Layers
	pieces := make([]transfer.Piece, len(base))
	var ends []int
	for i, s := range base {
		pieces[i] = transfer.Piece{Segment: transfer.Segment{
			Dev: s.Dev, Host: s.Off, Len: s.Len, Rows: s.Rows, RowLen: s.RowLen, DevPitch: s.DevPitch, HostPitch: s.HostPitch,
		}, DevStride: l.DevStride(s.Layer)}
		if perLayer && (i == len(base)-1 || base[i+1].Layer != s.Layer) {
			ends = append(ends, i+1)
		}
	}
	if perLayer && len(ends) != layers {
		return nil
	}
	return func(req transfer.Request) transfer.Request {
		blocks := func(_ int, dst []transfer.Block) ([]transfer.Block, error) {
			for i, id := range blockIDs {
				dst = append(dst, transfer.Block{Host: uint64(slots[i].Addr), ID: uint64(id)})
			}
			return dst, nil
		}
		req.Template = &transfer.Template{Pieces: pieces, LayerEnds: ends, Blocks: blocks}
		req.Parts = 1
		if perLayer {
			req.Layered, req.Parts = true, layers
		}
		req.Build = func(p int, dst []transfer.Segment) ([]transfer.Segment, error) {
			var bs []kvcache.Segment
			var err error
			for i, id := range blockIDs {
				if perLayer {
					bs, err = l.LayerSegments(id, p, bs[:0])
				} else {
					bs, err = l.Segments(id, bs[:0])
				}
				if err != nil {
					return dst, err
				}
				host := uint64(slots[i].Addr)
				for j := range bs {
					s := &bs[j]
					dst = append(dst, transfer.Segment{Dev: s.Dev, Host: host + s.Off, Len: s.Len, Rows: s.Rows, RowLen: s.RowLen, DevPitch: s.DevPitch, HostPitch: s.HostPitch})
				}
			}
			return dst, nil
		}
		return req
	}
}

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
		e.disk.saw(keys)
	}
	res, err := e.beginStore(e.namespace(ns), l.Heads(), keys, blockIDs, opts)
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
	op := newOp(e, OpLoad, len(keys))
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
		case onDisk && e.disk.has(keys[n+j]):
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
// follows every copy enqueued before it (transfer.CUDA's tail). So with
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
	if e.disk != nil {
		e.disk.delete(keys)
	}
	e.stats.deletes.Add(int64(n))
	e.kickReaper()
	return n
}

func (e *Engine) clear(ns string) int {
	if e.disk != nil {
		// Records carry no namespace: the whole disk tier goes (also
		// when this engine stored nothing in ns, as after a restart).
		e.disk.clearAll()
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
		e.disk.clearAll()
	}
	e.stats.deletes.Add(int64(n))
	e.kickReaper()
	return n
}

// tracePoint calls engineHooks.trace (the scheduler's Config.Trace too:
// a test's, or TraceCallsEnv's tracer) at a point of a call on the
// caller's goroutine; a nil check where neither is set.
func (e *Engine) tracePoint(name string) {
	if e.hooks.trace != nil {
		e.hooks.trace(name, -1)
	}
}
