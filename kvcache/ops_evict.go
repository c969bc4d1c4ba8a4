package kvcache

// Removal and eviction: Delete, Clear, maintainIdle and syncPolicy, the helpers
// that take a block out of the index (unindex, evict, evictVictim), and
// maintain and shortOf, which keep slots free ahead of demand, with rank
// and setChain, which keep a store's own chain from being its victims.
//
// Locks: Delete, Clear and maintainIdle take the cache lock (Cache.mu) and
// release it with Cache.unlock; the helpers run with it held, and call
// Config.Demote and Config.OnIndex with it held. maintain calls
// Policy.evictions under the cache lock, and tinyLFU's evictions takes the
// policy's own mu: Cache.mu first, then tinyLFU.mu. syncPolicy reads
// Cache.closed under Cache.mu and calls Policy.sync without it, before
// maintainIdle takes it again.

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

// maintainIdle applies the policy's pending advice and restores the
// low-watermark, as every mutating call does (syncPolicy and tests call it).
func (c *Cache) maintainIdle() {
	c.mu.Lock()
	defer c.unlock()
	if !c.closed {
		c.expirePartials()
		c.maintain(0)
		c.check()
	}
}

// syncPolicy waits for the policy's background decisions (ristretto's
// buffered sets) and applies them: after it, advice about every earlier call
// is in effect. For tests and simulations; serving does not need it.
func (c *Cache) syncPolicy() {
	c.mu.Lock()
	closed := c.closed
	c.mu.Unlock()
	if closed {
		return
	}
	c.policy.sync()
	c.maintainIdle()
}

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
		c.policy.removed(entry{Key: s.key, Slot: SlotID(i), Gen: s.gen})
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
		return notAVictim
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
		c.victims = c.policy.evictions(need, c.rank, c.victims[:0])
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
