package kvcache

import (
	"fmt"
	"slices"
)

// StoreOutcome is what BeginStore decided for one key.
type StoreOutcome uint8

// Store outcomes.
const (
	// StoreWrite: a slot was allocated (writing); copy the block into it and
	// call CompleteStore.
	StoreWrite StoreOutcome = iota + 1
	// StorePresent: the key is already stored (writing, ready or leased);
	// for a head-range store: a head of the range is stored or being
	// stored (by another rank, or a replica of the heads), or the block is
	// a whole-block one.
	StorePresent
	// StoreRefusedFull: no free slot, and no block the store may evict
	// (every one leased, being written, releasing, or part of its chain).
	StoreRefusedFull
	// StoreRefusedAdmission: not stored because the key was not seen often
	// enough (Config.StoreThreshold).
	StoreRefusedAdmission
)

var storeOutcomeNames = [...]string{"", "write", "already present", "refused: pool full", "refused: admission"}

func (o StoreOutcome) String() string {
	if int(o) < len(storeOutcomeNames) && o != 0 {
		return storeOutcomeNames[o]
	}
	return fmt.Sprintf("StoreOutcome(%d)", uint8(o))
}

// StoreRequest is one BeginStore call: a chain of blocks to store.
type StoreRequest struct {
	Namespace Namespace
	// Parent is the key of Keys[0]'s parent block, the zero Key when Keys[0]
	// starts a sequence. Keys[i-1] is the parent of Keys[i]. The cache uses
	// the links to prefer evicting chain tails and to count orphans.
	Parent Key
	Keys   []Key
	// BlockIDs are the GPU blocks holding Keys, one per key; each is checked
	// against the layout and echoed in the results.
	BlockIDs []int
	// Heads is the range of the model's KV heads this store writes (a
	// rank's share, LayoutSpec.Heads); zero, or every head, stores whole
	// blocks. A block stored by ranges becomes visible once every head is
	// committed (see BeginStore).
	Heads HeadRange
}

// StoreResult is BeginStore's answer for one key.
type StoreResult struct {
	Outcome StoreOutcome
	BlockID int
	Slot    Slot // valid when Outcome is StoreWrite
	// Heads is the head range to copy when Outcome is StoreWrite: the
	// request's (every head for a whole-block store). Copy
	// Layout.SegmentsRange(BlockID, Heads) to Slot.Addr + Off.
	Heads HeadRange
}

// LoadResult is BeginLoad's answer for one key.
type LoadResult struct {
	Found   bool // false: missing (evicted since the lookup, or never stored)
	BlockID int
	Slot    Slot // valid when Found; holds a reader lease until EndLoad
}

// BeginStore decides, for each key of a chain, whether to store it, and
// allocates a slot in writing for each key to store. The caller then copies
// each such block into its slot and reports the copy with CompleteStore.
// Results are appended to dst in key order.
//
// A chain is stored as a prefix: once a key is refused (pool full or
// admission), the keys after it are refused the same way, since without their
// parent no lookup could reach them. Keys already present are reported as
// such wherever they are.
//
// Head ranges (req.Heads; the ranks of a tensor-parallel group storing
// their shares of the same blocks into one slot each): the first range of
// an absent key allocates the slot as a whole-block store would, and the
// block is partial: indexed (its key is "present" to whole-block stores)
// but invisible to Lookup and BeginLoad. A later range that shares no head
// with the ranges committed or in flight is a write into the same slot
// (StoreWrite, Stats.StoreJoined), not StorePresent; a range sharing a head
// is StorePresent (replicated heads are stored once). The block becomes
// ready when CompleteStore has committed every head [0, KVHeads). A block
// still missing heads Config.PartialTimeout after its first range was
// granted is reclaimed, never loaded. A whole-block store of a partial
// block's key is StorePresent.
//
// Errors (the index and pool are untouched): ErrLengthMismatch, ErrDuplicate
// (a key twice), ErrBlockID, ErrHeadRange, ErrClosed.
func (c *Cache) BeginStore(req StoreRequest, dst []StoreResult) ([]StoreResult, error) {
	c.mu.Lock()
	defer c.unlock()
	if err := c.checkKeys(req.Keys, req.BlockIDs); err != nil {
		return dst, err
	}
	heads, whole := req.Heads, true
	if heads != (HeadRange{}) {
		if err := heads.within(c.heads, "the model's"); err != nil {
			return dst, fmt.Errorf("StoreRequest.Heads: %w", err)
		}
		whole = heads.Count == c.heads
	}
	if whole {
		heads = HeadRange{First: 0, Count: c.heads}
	}
	c.expirePartials()
	// need: the keys this call will allocate, i.e. the absent keys before
	// the first admission refusal (a chain is stored as a prefix).
	need := 0
	admitting := true
	c.found = c.found[:0]
	for _, k := range req.Keys {
		i, ok := c.index.get(k)
		if !ok {
			i = -1
			if admitting && c.threshold > 1 && c.seen.count(k) < c.threshold {
				admitting = false
			}
			if admitting {
				need++
			}
		}
		c.found = append(c.found, i)
	}
	parent, parentGen := int32(-1), uint32(0)
	if i, ok := c.index.get(req.Parent); ok && req.Parent != (Key{}) {
		parent, parentGen = i, c.slots[i].gen
	}
	// The chain's own present blocks (and the parent's ancestors) are not
	// victims for its store: evicting one would orphan the blocks stored
	// after it.
	c.setChain(parent, true)
	c.maintain(need)
	c.setChain(parent, false)
	var refused StoreOutcome
	for j, k := range req.Keys {
		c.st.StoreKeys++
		r := StoreResult{BlockID: req.BlockIDs[j], Heads: heads}
		if i := c.found[j]; i >= 0 && c.slots[i].key == k && c.slots[i].indexed() {
			s := &c.slots[i]
			if !whole && s.part != nil && s.state == stateWriting && !s.part.taken(heads) {
				s.part.writes = append(s.part.writes, heads)
				s.pending++
				s.storing = true
				c.st.StoreAllocated++
				c.st.StoreJoined++
				r.Outcome, r.Slot = StoreWrite, c.handle(i)
				r.Slot.Heads = heads
			} else {
				r.Outcome = StorePresent
				c.st.StorePresent++
			}
			parent, parentGen = i, s.gen
			dst = append(dst, r)
			continue
		}
		if refused == 0 && c.threshold > 1 && c.seen.count(k) < c.threshold {
			refused = StoreRefusedAdmission
		}
		var i int32 = -1
		if refused == 0 {
			if i = c.alloc(k, req.Namespace); i < 0 {
				refused = StoreRefusedFull
			}
		}
		if refused != 0 {
			r.Outcome = refused
			if refused == StoreRefusedFull {
				c.st.StoreRefusedFull++
			} else {
				c.st.StoreRefusedAdmission++
			}
			parent = -1
			dst = append(dst, r)
			continue
		}
		c.st.StoreAllocated++
		c.index.put(k, i)
		s := &c.slots[i]
		s.parent, s.parentGen = parent, parentGen
		parent, parentGen = i, s.gen
		r.Outcome, r.Slot = StoreWrite, c.handle(i)
		if !whole {
			c.setPart(s, &partial{writes: []HeadRange{heads}})
			c.expiries = append(c.expiries, expiry{slot: i, gen: s.gen, deadline: c.clock() + int64(c.partialTimeout)})
			r.Slot.Heads = heads
		}
		dst = append(dst, r)
	}
	c.check()
	return dst, nil
}

// CompleteStore reports that the D2H copies into slots (from BeginStore)
// finished: err == nil means they succeeded and the blocks become ready;
// otherwise the blocks are dropped and their slots freed. Call it only once
// every event of the copies has retired (or the copies were never
// submitted): the cache frees a failed block's slot at once.
//
// A head-range handle (Slot.Heads set) completes that range: on success its
// heads are committed and the block becomes ready when they complete it;
// on failure the range is open again for a retry, and the block is dropped
// only when it has no committed head and no other write in flight.
//
// Errors (nothing changes): ErrStaleSlot for a handle that is not a store in
// progress, ErrDuplicate for a handle given twice.
func (c *Cache) CompleteStore(slots []Slot, err error) error {
	_, e := c.completeStore(slots, err, nil, false)
	return e
}

// CompleteStoreReady is CompleteStore that also appends to dst, in the
// order given, the handles of slots whose block this call made visible
// (every head committed, not evicted meanwhile), and returns it: the blocks
// an owner may now copy out (a lower tier's write-through). A head-range
// write that leaves its block partial is not among them. dst is unchanged
// on error.
func (c *Cache) CompleteStoreReady(slots []Slot, err error, dst []Slot) ([]Slot, error) {
	return c.completeStore(slots, err, dst, true)
}

func (c *Cache) completeStore(slots []Slot, err error, dst []Slot, ready bool) ([]Slot, error) {
	c.mu.Lock()
	defer c.unlock()
	if c.closed {
		return dst, ErrClosed
	}
	clear(c.dupStore)
	for _, h := range slots {
		s, e := c.lookupHandle(h)
		if e != nil {
			return dst, e
		}
		if !s.storing {
			return dst, fmt.Errorf("%w: slot %d gen %d is %v with no store in progress", ErrStaleSlot, h.ID, h.Gen, s.state)
		}
		if (h.Heads == HeadRange{}) != (s.part == nil) || (s.part != nil && s.part.writeIndex(h.Heads) < 0) {
			return dst, fmt.Errorf("%w: slot %d gen %d: no store of heads %v in progress", ErrStaleSlot, h.ID, h.Gen, h.Heads)
		}
		d := storeHandle{h.ID, h.Heads.First}
		if _, dup := c.dupStore[d]; dup {
			return dst, fmt.Errorf("%w: slot %d (heads %v) given twice to CompleteStore", ErrDuplicate, h.ID, h.Heads)
		}
		c.dupStore[d] = struct{}{}
	}
	for _, h := range slots {
		i := int32(h.ID)
		s := &c.slots[i]
		s.pending--
		if err == nil {
			c.st.Stored++
		} else {
			c.st.StoreFailed++
		}
		if p := s.part; p != nil {
			p.writes = slices.Delete(p.writes, p.writeIndex(h.Heads), p.writeIndex(h.Heads)+1)
			s.storing = len(p.writes) > 0
			switch {
			case s.state == stateReleasing:
				c.release(i)
				continue
			case err != nil:
				if len(p.done) > 0 || len(p.writes) > 0 {
					continue // the range may be stored again
				}
				c.unindex(i)
				c.setState(s, stateReleasing)
				c.release(i)
				continue
			}
			p.commit(h.Heads)
			if !p.covers(c.heads) {
				continue
			}
			c.setPart(s, nil)
		} else {
			s.storing = false
		}
		switch {
		case s.state == stateReleasing: // evicted while writing
			c.release(i)
		case err != nil:
			c.unindex(i)
			c.setState(s, stateReleasing)
			c.release(i)
		default:
			c.setState(s, stateReady)
			if p := s.parent; p >= 0 {
				if ps := &c.slots[p]; ps.gen == s.parentGen && ps.indexed() {
					ps.children++
				} else {
					s.parent = -1
				}
			}
			c.policy.Inserted(Entry{Key: s.key, Slot: SlotID(i), Gen: s.gen})
			if c.onIndex != nil {
				c.onIndex(IndexEvent{Ready: true, Key: s.key, Slot: c.handle(i), Namespace: s.ns})
			}
			if ready {
				dst = append(dst, h)
			}
		}
	}
	c.maintain(0)
	c.check()
	return dst, nil
}

func (s *slotRec) indexed() bool {
	return s.state == stateWriting || s.state == stateReady || s.state == stateLeased
}

func (s *slotRec) visible() bool { return s.state == stateReady || s.state == stateLeased }

func (c *Cache) lookupHandle(h Slot) (*slotRec, error) {
	if int(h.ID) >= len(c.slots) {
		return nil, fmt.Errorf("%w: slot %d, the pool has %d", ErrStaleSlot, h.ID, len(c.slots))
	}
	s := &c.slots[h.ID]
	if s.gen != h.Gen || s.state == stateFree || s.state == stateZeroing || s.state == stateDemoting || s.state == stateRetired {
		return nil, fmt.Errorf("%w: slot %d gen %d (now gen %d, %v)", ErrStaleSlot, h.ID, h.Gen, s.gen, s.state)
	}
	return s, nil
}

// Lookup returns how many leading keys are ready (the longest stored
// prefix). It counts every key as demand for the policy.
func (c *Cache) Lookup(keys []Key) int {
	n, _ := c.lookup(keys, false, true, nil)
	return n
}

// LookupLease is Lookup that also takes a reader lease on each of the n
// ready blocks, appending their handles to dst, so they are not evicted
// before the load; give them back with Unlease.
func (c *Cache) LookupLease(keys []Key, dst []Slot) (int, []Slot) {
	return c.lookup(keys, true, true, dst)
}

// LookupLeaseDeferred is LookupLease that leaves the hits' news to the
// policy for later: the caller passes the handles it returned to Accessed
// once it has answered its own caller (the node pool, after its reply is
// sent). Misses are counted as demand at once. Until Accessed, the hits
// only keep their old recency, and they are leased, so no eviction
// decision can pick them.
func (c *Cache) LookupLeaseDeferred(keys []Key, dst []Slot) (int, []Slot) {
	return c.lookup(keys, true, false, dst)
}

// Accessed tells the policy of hits LookupLeaseDeferred returned (handles
// in the order it returned them; children are told before parents, as
// LookupLease does). A handle whose block is no longer visible under that
// generation is skipped.
func (c *Cache) Accessed(slots []Slot) {
	c.mu.Lock()
	defer c.unlock()
	if c.closed {
		return
	}
	for j := len(slots) - 1; j >= 0; j-- {
		h := slots[j]
		if int(h.ID) >= len(c.slots) {
			continue
		}
		if s := &c.slots[h.ID]; s.gen == h.Gen && s.visible() {
			c.accessed(s.key, int32(h.ID), h.Gen)
		}
	}
}

func (c *Cache) lookup(keys []Key, lease, touch bool, dst []Slot) (int, []Slot) {
	c.mu.Lock()
	defer c.unlock()
	if c.closed {
		return 0, dst
	}
	n := 0
	c.found = c.found[:0]
	for _, k := range keys {
		i, ok := c.index.get(k)
		if !ok || !c.slots[i].visible() || (lease && c.slots[i].readers >= MaxReaders) {
			break
		}
		c.found = append(c.found, i)
		n++
	}
	c.st.LookupKeys += uint64(len(keys))
	c.st.LookupHits += uint64(n)
	c.st.LookupMisses += uint64(len(keys) - n)
	// Children before parents, so that under LRU a parent is always more
	// recent than the children reached through it. Handles are written in
	// place, in key order.
	base := len(dst)
	if lease {
		dst = slices.Grow(dst, n)[:base+n]
	}
	for j := n - 1; j >= 0; j-- {
		i := c.found[j]
		if touch {
			c.accessed(keys[j], i, c.slots[i].gen)
		}
		if lease {
			c.lease(i)
			c.fillHandle(&dst[base+j], i)
		}
	}
	for _, k := range keys[n:] {
		c.policy.Missed(k)
	}
	if c.threshold > 1 {
		for _, k := range keys {
			c.seen.add(k)
		}
	}
	if lease {
		c.check()
	}
	return n, dst
}

// accessed tells the policy that slot i (key k, ready) was hit. The LRU
// is called directly: an Entry passed by value through the interface is
// stored and reloaded across overlapping words, a store-forwarding stall
// that was a third of a 1024-key LookupLease.
func (c *Cache) accessed(k Key, i int32, gen uint32) {
	if c.lru != nil {
		c.lru.touch(i, gen)
		return
	}
	c.policy.Accessed(Entry{Key: k, Slot: SlotID(i), Gen: gen})
}

func (c *Cache) lease(i int32) {
	s := &c.slots[i]
	s.readers++
	c.setState(s, stateLeased)
}

// unleaseOne drops one reader lease (and a transfer when load is set).
func (c *Cache) unleaseOne(i int32, load bool) {
	s := &c.slots[i]
	s.readers--
	if load {
		s.pending--
	}
	switch {
	case s.state == stateReleasing:
		c.release(i)
	case s.readers == 0:
		c.setState(s, stateReady)
	}
}

// LeaseHandles takes a reader lease on each block of slots whose handle is
// still current and visible (ready or leased), as LookupLease does for a
// hit but without telling the policy or counting a lookup, and appends to
// ok whether it did (a handle gone stale, its block evicted or deleted
// meanwhile, gets false). A leased block is not evicted or reused until
// its lease is given back with Unlease: a reader of the slot's memory (the
// cluster tier's write-through, copying on its own goroutine) keeps it.
// After Close, nothing is leased.
func (c *Cache) LeaseHandles(slots []Slot, ok []bool) []bool {
	c.mu.Lock()
	defer c.unlock()
	for _, h := range slots {
		leased := false
		if !c.closed {
			if s, err := c.lookupHandle(h); err == nil && s.visible() && s.readers < MaxReaders {
				c.lease(int32(h.ID))
				leased = true
			}
		}
		ok = append(ok, leased)
	}
	if !c.closed {
		c.check()
	}
	return ok
}

// Unlease gives back leases taken by LookupLease. Errors (nothing changes):
// ErrStaleSlot for a handle without that many leases.
func (c *Cache) Unlease(slots []Slot) error { return c.endRead(slots, false) }

// BeginLoad takes, for each key, a reader lease on its ready block and
// counts a transfer (the H2D copy) on it; the result says where to copy from.
// Missing keys are reported, not errors. Call EndLoad with the found slots
// once the copies' events have retired (or the copies were never submitted).
//
// Errors (nothing changes): ErrLengthMismatch, ErrDuplicate (a key or a
// block id twice), ErrBlockID, ErrClosed.
func (c *Cache) BeginLoad(keys []Key, blockIDs []int, dst []LoadResult) ([]LoadResult, error) {
	c.mu.Lock()
	defer c.unlock()
	// Three passes over the keys, each with few dependent loads, so that
	// their cache misses (index buckets, slot records, the policy's nodes)
	// overlap instead of following one another: a Load of thousands of
	// keys nothing has touched lately is all misses (BenchmarkBeginLoad
	// 2048Cold). checkLoad's passes look the keys up (c.found).
	if err := c.checkLoad(keys, blockIDs); err != nil {
		return dst, err
	}
	for j, i := range c.found {
		if i >= 0 && (!c.slots[i].visible() || c.slots[i].readers >= MaxReaders) {
			c.found[j] = -1
		}
	}
	for j, k := range keys {
		c.st.LoadKeys++
		// Filled in place (see accessed).
		dst = append(dst, LoadResult{})
		r := &dst[len(dst)-1]
		r.BlockID = blockIDs[j]
		if i := c.found[j]; i >= 0 {
			c.lease(i)
			c.slots[i].pending++
			c.accessed(k, i, c.slots[i].gen)
			r.Found = true
			c.fillHandle(&r.Slot, i)
			c.st.Loaded++
		} else {
			c.st.LoadMissing++
		}
	}
	c.check()
	return dst, nil
}

// EndLoad reports that the H2D copies from slots (from BeginLoad) have
// retired, and drops their leases. Errors as Unlease.
func (c *Cache) EndLoad(slots []Slot) error { return c.endRead(slots, true) }

func (c *Cache) endRead(slots []Slot, load bool) error {
	c.mu.Lock()
	defer c.unlock()
	if c.closed {
		return ErrClosed
	}
	c.nextDupEpoch()
	for _, h := range slots {
		s, err := c.lookupHandle(h)
		if err != nil {
			return err
		}
		if s.dupMark != c.dupEpoch {
			s.dupMark, s.dupN = c.dupEpoch, 0
		}
		s.dupN++
		n := s.dupN
		if s.readers < n || (load && s.pending-s.storeWrites() < n) {
			return fmt.Errorf("%w: slot %d gen %d released %d times, it holds %d leases and %d loads",
				ErrStaleSlot, h.ID, h.Gen, n, s.readers, s.pending-s.storeWrites())
		}
	}
	for _, h := range slots {
		c.unleaseOne(int32(h.ID), load)
	}
	c.maintain(0)
	c.check()
	return nil
}

// nextDupEpoch starts a call's count of handles per slot (slotRec.dupN):
// marks of earlier calls no longer match. When the stamp wraps, every
// mark is cleared so that no slot carries an old mark equal to a new one.
func (c *Cache) nextDupEpoch() {
	if nextStamp(&c.dupEpoch) {
		for i := range c.slots {
			c.slots[i].dupMark = 0
		}
	}
}

func b2i(b bool) int32 {
	if b {
		return 1
	}
	return 0
}

// Delete removes keys from the index (a model reload, an invalidation);
// blocks being read or written are released when their transfers and leases
// end. Absent keys are ignored. It returns how many keys were removed.
func (c *Cache) Delete(keys []Key) int {
	c.mu.Lock()
	defer c.unlock()
	n := 0
	for _, k := range keys {
		if i, ok := c.index.get(k); ok {
			c.evict(i, &c.st.Deleted, true)
			n++
		}
	}
	c.check()
	return n
}

// Clear removes every block of namespace ns, as Delete does. It walks the
// slot table (O(slots)). It returns how many blocks were removed.
func (c *Cache) Clear(ns Namespace) int {
	c.mu.Lock()
	defer c.unlock()
	n := 0
	for i := range c.slots {
		if s := &c.slots[i]; s.ns == ns && s.indexed() {
			c.evict(int32(i), &c.st.Deleted, true)
			n++
		}
	}
	c.check()
	return n
}

// Maintain applies the policy's pending advice and restores the
// low-watermark. Every mutating call does this already; an engine may also
// call it when idle.
func (c *Cache) Maintain() {
	c.mu.Lock()
	defer c.unlock()
	if !c.closed {
		c.expirePartials()
		c.maintain(0)
		c.check()
	}
}

// Sync waits for the policy's background decisions (ristretto's buffered
// sets) and applies them: after Sync, advice about every earlier call is in
// effect. For tests and simulations; serving does not need it.
func (c *Cache) Sync() {
	c.mu.Lock()
	closed := c.closed
	c.mu.Unlock()
	if closed {
		return
	}
	c.policy.Sync()
	c.Maintain()
}

// checkKeys validates a store's keys and block ids: each block id in the
// layout's range, no key twice (BeginLoad's checkLoad also rejects a block
// id given twice).
func (c *Cache) checkKeys(keys []Key, ids []int) error {
	if c.closed {
		return ErrClosed
	}
	if len(keys) != len(ids) {
		return fmt.Errorf("%w: %d keys, %d block ids", ErrLengthMismatch, len(keys), len(ids))
	}
	c.dupKeys.start(len(keys))
	for j, k := range keys {
		if err := c.layout.CheckBlock(ids[j]); err != nil {
			return fmt.Errorf("key %d (%v): %w", j, k, err)
		}
		if c.dupKeys.add(k) {
			return fmt.Errorf("%w: key %v at index %d", ErrDuplicate, k, j)
		}
	}
	return nil
}

// checkLoad is checkKeys for BeginLoad, with a block id given twice
// rejected too, and looks the keys up (c.found, visible or not). The error
// is the first failing index's; at one index a bad block id before a
// repeated key before a repeated block id. A repeated key is found by the
// slot it maps to
// (two keys in the index map to one slot only if equal), so that only the
// keys the index lacks go through the set of keys: a hash and a probe
// less per key.
func (c *Cache) checkLoad(keys []Key, ids []int) error {
	if c.closed {
		return ErrClosed
	}
	if len(keys) != len(ids) {
		return fmt.Errorf("%w: %d keys, %d block ids", ErrLengthMismatch, len(keys), len(ids))
	}
	// Block ids (range, repeats) up to the first failing one, and the
	// lookups.
	c.dupIDs.start(len(keys))
	idAt, badBlock := len(keys), false
	var idErr error
	c.found = c.found[:0]
	for j, k := range keys {
		if idAt == len(keys) {
			if err := c.layout.CheckBlock(ids[j]); err != nil {
				idAt, badBlock, idErr = j, true, fmt.Errorf("key %d (%v): %w", j, k, err)
			} else if c.dupIDs.add(ids[j]) {
				idAt, idErr = j, fmt.Errorf("%w: block id %d at index %d", ErrDuplicate, ids[j], j)
			}
		}
		i, ok := c.index.get(k)
		if !ok {
			i = -1
		}
		c.found = append(c.found, i)
	}
	// Repeated keys, up to idAt (past it idErr is the answer): by slot
	// mark where indexed, else through the set of keys.
	c.nextDupEpoch()
	started := false
	for j, i := range c.found[:min(idAt+1, len(keys))] {
		dup := false
		if i >= 0 {
			s := &c.slots[i]
			dup = s.dupMark == c.dupEpoch
			s.dupMark, s.dupN = c.dupEpoch, 0
		} else {
			if !started {
				c.dupKeys.start(len(keys))
				started = true
			}
			dup = c.dupKeys.add(keys[j])
		}
		if dup {
			if j == idAt && badBlock {
				break // the bad block id comes first at one index
			}
			return fmt.Errorf("%w: key %v at index %d", ErrDuplicate, keys[j], j)
		}
	}
	return idErr
}

// ---- eviction ------------------------------------------------------------------

// unindex removes slot i's key from the index and unlinks it from its parent.
func (c *Cache) unindex(i int32) {
	s := &c.slots[i]
	c.index.del(s.key)
	if s.state != stateWriting {
		if p := s.parent; p >= 0 {
			if ps := &c.slots[p]; ps.gen == s.parentGen && ps.indexed() {
				ps.children--
			}
		}
	}
	s.parent = -1
	if s.children > 0 {
		c.st.Orphaned += uint64(s.children)
		s.children = 0
	}
}

// evict removes indexed slot i from the index and releases it as soon as no
// reader and no transfer is left. tell says whether the policy must be told
// (false when the eviction is the policy's own advice).
func (c *Cache) evict(i int32, counter *uint64, tell bool) {
	s := &c.slots[i]
	if tell && s.visible() {
		c.policy.Removed(Entry{Key: s.key, Slot: SlotID(i), Gen: s.gen})
	}
	if c.onIndex != nil && s.visible() {
		c.onIndex(IndexEvent{Key: s.key, Slot: c.handle(i), Namespace: s.ns, Evicted: counter == &c.st.Evicted})
	}
	c.unindex(i)
	*counter++
	c.setState(s, stateReleasing)
	c.release(i)
}

// evictVictim evicts the policy's victim i (counted Evicted, or Rejected
// for TinyLFU's after-the-fact admission) for maintain(want): an eviction
// is offered to Config.Demote, which may send the slot into demoting
// unless the store evicting needs it at once (fewer slots free or zeroing
// than want).
func (c *Cache) evictVictim(i int32, rejected bool, want int) {
	if rejected {
		c.st.WastedD2HBytes += c.slotSize
		c.evict(i, &c.st.Rejected, false)
		return
	}
	if c.demote != nil {
		s := &c.slots[i]
		needed := c.nFree+c.counts[stateZeroing] < want
		if c.demote(c.handle(i), s.key, needed) && !needed {
			s.demote = true
		}
	}
	c.evict(i, &c.st.Evicted, false)
}

// rank implements Rank for the policy.
func (c *Cache) rank(id SlotID) int {
	s := &c.slots[id]
	switch {
	case s.state == stateLeased, s.chain:
		return NotAVictim
	case s.children > 0:
		return 1
	}
	return 0
}

// setChain marks (or unmarks) the slots of a BeginStore's present keys
// (c.found), its parent and the parent's ancestors, which rank then
// excludes. The walk up the parent links is O(chain length).
func (c *Cache) setChain(parent int32, on bool) {
	for i := parent; i >= 0 && c.slots[i].indexed() && c.slots[i].chain != on; {
		s := &c.slots[i]
		s.chain = on
		if p := s.parent; p >= 0 && c.slots[p].gen == s.parentGen {
			i = p
		} else {
			i = -1
		}
	}
	for _, i := range c.found {
		if i >= 0 {
			c.slots[i].chain = on
		}
	}
}

// maintain applies the policy's advice and evicts ahead of demand so that
// want slots plus the low-watermark are free. While slots are short it asks
// the policy again (its advice may have named blocks already gone or leased);
// it stops when the policy names no more victims. Every victim leaves the
// policy's tracking, so the work is bounded by the blocks it tracks.
func (c *Cache) maintain(want int) {
	for {
		need := c.shortOf(want)
		c.victims = c.policy.Evictions(need, c.rank, c.victims[:0])
		if len(c.victims) == 0 {
			return
		}
		for _, v := range c.victims {
			i := int32(v.Slot)
			if int(i) >= len(c.slots) {
				continue
			}
			s := &c.slots[i]
			if s.gen != v.Gen || !s.visible() || s.key != v.Key {
				continue // advice about an earlier occupant, or already gone
			}
			c.evictVictim(i, v.Rejected, want)
		}
		if need == 0 || c.shortOf(want) == 0 {
			return
		}
	}
}

// shortOf returns how many slots maintain(want) still lacks: want slots
// free, and the low-watermark on top of them. Zeroing slots are coming
// free: counting them keeps a release with Config.OnFree from evicting
// more blocks in their place. Demoting slots count towards the watermark
// (they come free once their write completes) but not towards want: a
// store cannot take a slot whose write may last milliseconds.
func (c *Cache) shortOf(want int) int {
	avail := c.nFree + c.counts[stateZeroing]
	return max(want-avail, want+c.watermark-avail-c.counts[stateDemoting], 0)
}

// ---- store threshold sketch ----------------------------------------------------

const (
	seenBits = 20 // 1 Mi counters of 1 byte
	maxSeen  = 15
)

// seenSketch counts lookups per key approximately: one saturating counter
// per hash bucket, all halved every seenSize additions so that old demand
// fades (the "reset" of TinyLFU).
type seenSketch struct {
	counts []uint8
	adds   int
}

func newSeenSketch() seenSketch { return seenSketch{counts: make([]uint8, 1<<seenBits)} }

func (s *seenSketch) bucket(k Key) uint32 { return uint32(hash64(k) >> (64 - seenBits)) }

func (s *seenSketch) add(k Key) {
	b := s.bucket(k)
	if s.counts[b] < maxSeen {
		s.counts[b]++
	}
	if s.adds++; s.adds >= len(s.counts) {
		s.adds = 0
		for i := range s.counts {
			s.counts[i] >>= 1
		}
	}
}

func (s *seenSketch) count(k Key) int { return int(s.counts[s.bucket(k)]) }

// LeaseAll leases every visible block, as LookupLease leases a hit but
// without telling the policy or counting a lookup, and appends its handle
// and key to dst and keys, most recently used first where the policy is
// the LRU (then any block the LRU does not list, in slot order), else in
// slot order: a snapshot of the pool's blocks for a caller that copies
// them out (the write-back to disk at Close, which a time bound may cut
// short: the hottest blocks go first). Each handle is released with
// Unlease. Nothing after Close.
func (c *Cache) LeaseAll(dst []Slot, keys []Key) ([]Slot, []Key) {
	c.mu.Lock()
	defer c.unlock()
	if c.closed {
		return dst, keys
	}
	var listed []bool
	add := func(i int32) {
		s := &c.slots[i]
		if !s.visible() || (listed != nil && listed[i]) {
			return
		}
		if listed != nil {
			listed[i] = true
		}
		c.lease(i)
		dst = append(dst, Slot{})
		c.fillHandle(&dst[len(dst)-1], i)
		keys = append(keys, s.key)
	}
	if c.lru != nil {
		listed = make([]bool, len(c.slots))
		for i := c.lru.head; i >= 0; {
			next := c.lru.nodes[i].next
			if int(i) < len(c.slots) {
				add(i)
			}
			i = next
		}
	}
	for i := range c.slots {
		add(int32(i))
	}
	c.check()
	return dst, keys
}
