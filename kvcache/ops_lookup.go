package kvcache

// Lookups and leases: Lookup, LookupLease, LookupLeaseDeferred, Accessed
// (the deferred hits' news to the policy), LeaseHandles and LeaseAll, and
// their helpers lookup, accessed and lease.
//
// Locks: Accessed, lookup, LeaseHandles and LeaseAll take the cache lock
// (Cache.mu) and release it with Cache.unlock; accessed and lease run with
// it held. Nothing here takes a second lock.

import "slices"

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
		if !ok || !c.slots[i].visible() || (lease && c.slots[i].readers >= maxReaders) {
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
		c.policy.missed(k)
	}
	if c.threshold > 1 {
		for _, k := range keys {
			c.seen.Add(k)
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
	c.policy.accessed(entry{Key: k, Slot: SlotID(i), Gen: gen})
}

func (c *Cache) lease(i int32) {
	s := &c.slots[i]
	s.readers++
	c.setState(s, stateLeased)
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
			if s, err := c.lookupHandle(h); err == nil && s.visible() && s.readers < maxReaders {
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
