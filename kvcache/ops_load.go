package kvcache

// Loads and the end of reads: LoadResult, BeginLoad with checkLoad (its
// validation and lookup of the keys), and EndLoad and Unlease, which give
// back loads and leases through endRead and unleaseOne.
//
// Locks: BeginLoad and endRead take the cache lock (Cache.mu) and release
// it with Cache.unlock; checkLoad and unleaseOne run with it held. endRead
// calls maintain (ops_evict.go), which nests a TinyLFU policy's own mu
// inside the cache lock: Cache.mu first, then tinyLFU.mu.

import "fmt"

// LoadResult is BeginLoad's answer for one key.
type LoadResult struct {
	Found   bool // false: missing (evicted since the lookup, or never stored)
	BlockID int
	Slot    Slot // valid when Found; holds a reader lease until EndLoad
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

// Unlease gives back leases taken by LookupLease. Errors (nothing changes):
// a handle without that many leases (stale).
func (c *Cache) Unlease(slots []Slot) error { return c.endRead(slots, false) }

// BeginLoad takes, for each key, a reader lease on its ready block and
// counts a transfer (the H2D copy) on it; the result says where to copy from.
// Missing keys are reported, not errors. Call EndLoad with the found slots
// once the copies' events have retired (or the copies were never submitted).
//
// Errors (nothing changes): keys and block ids of different lengths, a
// key or a block id twice, a block id out of range, the cache closed.
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
		if i >= 0 && (!c.slots[i].visible() || c.slots[i].readers >= maxReaders) {
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
		return errClosed
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
				errStaleSlot, h.ID, h.Gen, n, s.readers, s.pending-s.storeWrites())
		}
	}
	for _, h := range slots {
		c.unleaseOne(int32(h.ID), load)
	}
	c.maintain(0)
	c.check()
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
		return errClosed
	}
	if len(keys) != len(ids) {
		return fmt.Errorf("%w: %d keys, %d block ids", errLengthMismatch, len(keys), len(ids))
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
				idAt, idErr = j, fmt.Errorf("%w: block id %d at index %d", errDuplicate, ids[j], j)
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
			return fmt.Errorf("%w: key %v at index %d", errDuplicate, keys[j], j)
		}
	}
	return idErr
}
