package kvcache

import (
	"fmt"
	"math"
)

// maxReaders bounds a slot's readers (leases and loads, every holder's
// together): a lookup or load finding a block with this many is told the
// block is missing rather than overflowing its 32-bit count.
const maxReaders = math.MaxInt32 / 2

// Reads is one holder's reads of one slot, given back at once by EndReads:
// Leases reader leases (LookupLease, LeaseHandles) and Loads loads
// (BeginLoad).
type Reads struct {
	Slot          Slot
	Leases, Loads int32
}

// EndReads gives back, for each entry, its Leases leases and its Loads
// loads, as Unlease and EndLoad with that many handles of the slot would,
// at a cost of one step per entry however many reads it counts: a holder
// that goes away releases in proportion to the slots it held, not to the
// leases it took. A slot may appear once. Errors (nothing changes):
// a handle without that many leases and loads (stale), or given twice; the
// cache closed.
func (c *Cache) EndReads(reads []Reads) error {
	c.mu.Lock()
	defer c.unlock()
	if c.closed {
		return errClosed
	}
	c.nextDupEpoch()
	for _, r := range reads {
		s, err := c.lookupHandle(r.Slot)
		if err != nil {
			return err
		}
		if s.dupMark == c.dupEpoch {
			return fmt.Errorf("%w: slot %d gen %d given twice", errStaleSlot, r.Slot.ID, r.Slot.Gen)
		}
		s.dupMark, s.dupN = c.dupEpoch, 0
		n := int64(r.Leases) + int64(r.Loads)
		if r.Leases < 0 || r.Loads < 0 || int64(s.readers) < n || int64(s.pending-s.storeWrites()) < int64(r.Loads) {
			return fmt.Errorf("%w: slot %d gen %d released %d leases and %d loads, it holds %d leases and %d loads",
				errStaleSlot, r.Slot.ID, r.Slot.Gen, r.Leases, r.Loads, s.readers, s.pending-s.storeWrites())
		}
	}
	for _, r := range reads {
		if r.Leases == 0 && r.Loads == 0 {
			continue
		}
		i := int32(r.Slot.ID)
		s := &c.slots[i]
		s.readers -= r.Leases + r.Loads
		s.pending -= r.Loads
		switch {
		case s.state == stateReleasing:
			c.release(i)
		case s.readers == 0:
			c.setState(s, stateReady)
		}
	}
	c.maintain(0)
	c.check()
	return nil
}
