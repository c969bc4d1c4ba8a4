package kvcache

// Stores: BeginStore's request, outcomes and results, BeginStore,
// CompleteStore and CompleteStoreReady (whole blocks and head ranges), and
// checkKeys, which validates a store's keys and block ids.
//
// Locks: BeginStore and completeStore take the cache lock (Cache.mu) and
// release it with Cache.unlock; checkKeys runs with it held. Both call
// maintain (ops_evict.go), which nests a TinyLFU policy's own mu inside
// the cache lock: Cache.mu first, then tinyLFU.mu.

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
	// request's (every head for a whole-block store). Copy the Segments
	// of BlockID of the layout holding those heads (the rank's, whose
	// LayoutSpec.Heads they are) to Slot.Addr + Off.
	Heads HeadRange
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
// Errors (the index and pool are untouched): keys and block ids of
// different lengths, a key twice, a block id out of range, a bad head
// range, the cache closed.
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
			if admitting && c.threshold > 1 && c.seen.Count(k) < c.threshold {
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
		if refused == 0 && c.threshold > 1 && c.seen.Count(k) < c.threshold {
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
// Errors (nothing changes): a handle that is not a store in progress
// (stale), a handle given twice.
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
		return dst, errClosed
	}
	clear(c.dupStore)
	for _, h := range slots {
		s, e := c.lookupHandle(h)
		if e != nil {
			return dst, e
		}
		if !s.storing {
			return dst, fmt.Errorf("%w: slot %d gen %d is %v with no store in progress", errStaleSlot, h.ID, h.Gen, s.state)
		}
		if (h.Heads == HeadRange{}) != (s.part == nil) || (s.part != nil && s.part.writeIndex(h.Heads) < 0) {
			return dst, fmt.Errorf("%w: slot %d gen %d: no store of heads %v in progress", errStaleSlot, h.ID, h.Gen, h.Heads)
		}
		d := storeHandle{h.ID, h.Heads.First}
		if _, dup := c.dupStore[d]; dup {
			return dst, fmt.Errorf("%w: slot %d (heads %v) given twice to CompleteStore", errDuplicate, h.ID, h.Heads)
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
			c.policy.inserted(entry{Key: s.key, Slot: SlotID(i), Gen: s.gen})
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

// checkKeys validates a store's keys and block ids: each block id in the
// layout's range, no key twice (BeginLoad's checkLoad also rejects a block
// id given twice).
func (c *Cache) checkKeys(keys []Key, ids []int) error {
	if c.closed {
		return errClosed
	}
	if len(keys) != len(ids) {
		return fmt.Errorf("%w: %d keys, %d block ids", errLengthMismatch, len(keys), len(ids))
	}
	c.dupKeys.start(len(keys))
	for j, k := range keys {
		if err := c.layout.CheckBlock(ids[j]); err != nil {
			return fmt.Errorf("key %d (%v): %w", j, k, err)
		}
		if c.dupKeys.add(k) {
			return fmt.Errorf("%w: key %v at index %d", errDuplicate, k, j)
		}
	}
	return nil
}
