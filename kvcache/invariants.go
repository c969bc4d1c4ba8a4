package kvcache

import (
	"errors"
	"fmt"
)

// Verify checks every invariant of the index and the pool and returns the
// first violation (nil when all hold). It walks every slot: O(slots). Tests
// call it after every step; built with the kvoinvariants tag, every mutating
// call runs it and panics on a violation (as pebble's invariants do).
//
// The invariants: each slot is in exactly one state; free slots are exactly
// those on the free list, with no reader, no transfer and no index entry;
// every index entry names a writing, ready or leased slot holding its key,
// and every such slot is indexed once; ready slots have no reader and no
// transfer, leased ones at least one reader, writing ones exactly their
// store's transfer; releasing slots wait for a reader or a transfer;
// zeroing slots (Config.OnFree) have neither, and the ones this call released
// are queued once each for OnFree; demoting slots (Config.OnDemote) have
// neither, only releasing and demoting slots are marked for demotion, every
// demoting one is, and the ones this call put there are queued once each
// for OnDemote; no count is negative; draining regions have no free-list slot; per-region
// busy counts and per-state gauges match; child counts match the parent
// links; the outcome counters add up. Blocks stored by head ranges: only
// writing or releasing slots hold a partial record; its committed heads are
// sorted, merged, inside the model's heads and not all of them, its writes
// are disjoint from them and from each other, its writes are the slot's
// transfers, a writing one holds at least one head or write, and each
// writing one is in the expiry queue.
func (c *Cache) Verify() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.verify()
}

func (c *Cache) verify() error {
	var errs []error
	bad := func(format string, args ...any) {
		if len(errs) < 8 {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	onFree := make(map[int32]bool, c.nFree)
	n := 0
	for i, prev := c.freeHead, int32(-1); i >= 0; prev, i = i, c.slots[i].next {
		if onFree[i] {
			bad("free list loops at slot %d", i)
			break
		}
		onFree[i] = true
		if c.slots[i].prev != prev {
			bad("free list: slot %d prev %d, want %d", i, c.slots[i].prev, prev)
		}
		n++
	}
	if n != c.nFree {
		bad("free list holds %d slots, nFree = %d", n, c.nFree)
	}
	var counts [stateRetired]int
	busy := make([]int, len(c.regions))
	children := make(map[int32]int32)
	indexed := 0
	inFlight := 0
	partials := 0
	inQueue := make(map[[2]uint32]bool, len(c.expiries)-c.expHead)
	for _, e := range c.expiries[c.expHead:] {
		inQueue[[2]uint32{uint32(e.slot), e.gen}] = true
	}
	for i := range c.slots {
		id := int32(i)
		s := &c.slots[i]
		if s.chain {
			bad("slot %d still marked as part of a store's chain", i)
		}
		if s.readers < 0 || s.pending < 0 || s.children < 0 {
			bad("slot %d: negative count (readers %d, pending %d, children %d)", i, s.readers, s.pending, s.children)
		}
		if s.state == stateRetired {
			if onFree[id] {
				bad("retired slot %d is on the free list", i)
			}
			continue
		}
		counts[s.state]++
		if int(s.region) >= len(c.regions) {
			bad("slot %d (%v) in region index %d of %d", i, s.state, s.region, len(c.regions))
			continue
		}
		rr := c.regions[s.region]
		if id < rr.first || id >= rr.first+rr.n {
			bad("slot %d outside its region's ids [%d, %d)", i, rr.first, rr.first+rr.n)
		}
		if s.state != stateFree {
			busy[s.region]++
		}
		inFlight += int(s.storeWrites())
		if s.part != nil {
			partials++
			if err := c.verifyPartial(s); err != nil {
				bad("slot %d (%v): %v", i, s.state, err)
			}
			if s.state == stateWriting && !inQueue[[2]uint32{uint32(i), s.gen}] {
				bad("partial slot %d gen %d is not in the expiry queue", i, s.gen)
			}
		}
		j, inIndex := c.index.get(s.key)
		isIndexed := inIndex && j == id
		switch s.state {
		case stateFree:
			if !onFree[id] || s.readers != 0 || s.pending != 0 || s.storing {
				bad("free slot %d: on free list %v, readers %d, pending %d, storing %v", i, onFree[id], s.readers, s.pending, s.storing)
			}
			if rr.draining {
				bad("free slot %d belongs to draining region %d", i, rr.r.ID)
			}
		case stateWriting:
			if s.part != nil {
				if s.storing != (len(s.part.writes) > 0) || s.pending != int32(len(s.part.writes)) || s.readers != 0 {
					bad("partial writing slot %d: storing %v, pending %d, %d writes, readers %d", i, s.storing, s.pending, len(s.part.writes), s.readers)
				}
				if len(s.part.done) == 0 && len(s.part.writes) == 0 {
					bad("partial writing slot %d holds no head and no write", i)
				}
			} else if !s.storing || s.pending != 1 || s.readers != 0 {
				bad("writing slot %d: storing %v, pending %d, readers %d", i, s.storing, s.pending, s.readers)
			}
		case stateReady:
			if s.pending != 0 || s.readers != 0 || s.storing {
				bad("ready slot %d: pending %d, readers %d", i, s.pending, s.readers)
			}
		case stateLeased:
			if s.readers <= 0 || s.storing || s.pending > s.readers {
				bad("leased slot %d: readers %d, pending %d", i, s.readers, s.pending)
			}
		case stateZeroing:
			if s.readers != 0 || s.pending != 0 || s.storing {
				bad("zeroing slot %d: readers %d, pending %d, storing %v", i, s.readers, s.pending, s.storing)
			}
		case stateDemoting:
			if s.readers != 0 || s.pending != 0 || s.storing || !s.demote || s.part != nil {
				bad("demoting slot %d: readers %d, pending %d, storing %v, marked %v, partial %v", i, s.readers, s.pending, s.storing, s.demote, s.part != nil)
			}
		case stateReleasing:
			if s.readers == 0 && s.pending == 0 {
				bad("releasing slot %d has no reader and no transfer left", i)
			}
			if s.pending-s.storeWrites() > s.readers {
				bad("releasing slot %d: %d loads pending, %d readers", i, s.pending-s.storeWrites(), s.readers)
			}
		}
		if s.demote && s.state != stateReleasing && s.state != stateDemoting {
			bad("%v slot %d is marked for demotion", s.state, i)
		}
		if s.part != nil && s.state != stateWriting && s.state != stateReleasing {
			bad("%v slot %d holds a partial record", s.state, i)
		}
		if s.state != stateFree && onFree[id] {
			bad("%v slot %d is on the free list", s.state, i)
		}
		if s.indexed() {
			indexed++
			if !isIndexed {
				bad("%v slot %d (key %v) is not indexed", s.state, i, s.key)
			}
		} else if isIndexed {
			bad("%v slot %d is indexed", s.state, i)
		}
		if s.visible() && s.parent >= 0 {
			if p := &c.slots[s.parent]; p.gen == s.parentGen && p.indexed() {
				children[s.parent]++
			}
		}
	}
	if indexed != c.index.len() {
		bad("index holds %d keys, %d slots are indexed", c.index.len(), indexed)
	}
	for i := range c.slots {
		if s := &c.slots[i]; s.indexed() && s.children != children[int32(i)] {
			bad("slot %d counts %d children, %d link to it", i, s.children, children[int32(i)])
		}
	}
	queued := make(map[SlotID]bool, len(c.toZero))
	for _, h := range c.toZero {
		if queued[h.ID] || int(h.ID) >= len(c.slots) || c.slots[h.ID].state != stateZeroing || c.slots[h.ID].gen != h.Gen {
			bad("slot %d gen %d queued for zeroing twice or not zeroing", h.ID, h.Gen)
			break
		}
		queued[h.ID] = true
	}
	demoting := make(map[SlotID]bool, len(c.toDemote))
	for _, d := range c.toDemote {
		h := d.slot
		if demoting[h.ID] || int(h.ID) >= len(c.slots) || c.slots[h.ID].state != stateDemoting || c.slots[h.ID].gen != h.Gen || c.slots[h.ID].key != d.key {
			bad("slot %d gen %d queued for demotion twice, not demoting, or with another key", h.ID, h.Gen)
			break
		}
		demoting[h.ID] = true
	}
	if partials != c.nPartial {
		bad("%d slots hold a partial record, gauge %d", partials, c.nPartial)
	}
	if counts != c.counts {
		bad("state gauges %v, counted %v", c.counts, counts)
	}
	if counts[stateFree] != c.nFree {
		bad("%d free slots, free list holds %d", counts[stateFree], c.nFree)
	}
	usable := 0
	for ri, rr := range c.regions {
		if busy[ri] != rr.busy {
			bad("region %d: busy %d, counted %d", rr.r.ID, rr.busy, busy[ri])
		}
		if !rr.draining {
			usable += int(rr.n)
		}
	}
	if usable != c.usable {
		bad("usable slots %d, regions hold %d", c.usable, usable)
	}
	st := &c.st
	if st.StoreJoined > st.StoreAllocated {
		bad("joined %d > allocated %d", st.StoreJoined, st.StoreAllocated)
	}
	if st.StoreKeys != st.StoreAllocated+st.StorePresent+st.StoreRefusedFull+st.StoreRefusedAdmission {
		bad("store outcomes do not add up: %+v", *st)
	}
	if st.StoreAllocated != st.Stored+st.StoreFailed+uint64(inFlight) {
		bad("allocated %d != stored %d + failed %d + in flight %d", st.StoreAllocated, st.Stored, st.StoreFailed, inFlight)
	}
	if st.LookupKeys != st.LookupHits+st.LookupMisses || st.LoadKeys != st.Loaded+st.LoadMissing {
		bad("lookup/load outcomes do not add up: %+v", *st)
	}
	return errors.Join(errs...)
}

// check runs verify after a mutation when built with the kvoinvariants tag.
func (c *Cache) check() {
	if invariantsOn {
		if err := c.verify(); err != nil {
			panic(fmt.Sprintf("kvcache: invariant violated: %v", err))
		}
	}
}

// verifyPartial checks one partial record against the model's heads.
func (c *Cache) verifyPartial(s *slotRec) error {
	p := s.part
	for k, r := range p.done {
		if err := r.within(c.heads, "the model's"); err != nil {
			return fmt.Errorf("committed %w", err)
		}
		if k > 0 && p.done[k-1].end() >= r.First {
			return fmt.Errorf("committed heads %v not sorted and merged", p.done)
		}
	}
	if p.covers(c.heads) {
		return fmt.Errorf("every head committed (%v) but not ready", p.done)
	}
	for k, r := range p.writes {
		if err := r.within(c.heads, "the model's"); err != nil {
			return fmt.Errorf("write %w", err)
		}
		for _, q := range p.done {
			if q.overlaps(r) {
				return fmt.Errorf("write %v overlaps committed %v", r, q)
			}
		}
		for _, q := range p.writes[:k] {
			if q.overlaps(r) {
				return fmt.Errorf("writes %v and %v overlap", q, r)
			}
		}
	}
	if s.state == stateReleasing && (s.readers != 0 || s.pending != int32(len(p.writes)) || s.pending == 0) {
		return fmt.Errorf("releasing: readers %d, pending %d, %d writes", s.readers, s.pending, len(p.writes))
	}
	return nil
}
