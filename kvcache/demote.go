package kvcache

import "fmt"

// demotion is a slot put into demoting, with its block's key, waiting in
// Cache.toDemote for Config.OnDemote.
type demotion struct {
	slot Slot
	key  Key
}

// Demoted reports that the owner is done with demoting slots (from
// Config.OnDemote: their lower-tier writes completed or failed): each
// goes through zeroing (Config.OnFree) or straight to the free list, or is
// retired when its region is draining, which may make the region
// releasable. It works after Close too. Errors (nothing changes):
// a handle that is not a demoting slot of that generation (stale), a
// handle given twice.
func (c *Cache) Demoted(slots []Slot) error {
	c.mu.Lock()
	defer c.unlock()
	c.nextDupEpoch()
	for _, h := range slots {
		if int(h.ID) >= len(c.slots) {
			return fmt.Errorf("%w: slot %d, the pool has %d", errStaleSlot, h.ID, len(c.slots))
		}
		s := &c.slots[h.ID]
		if s.gen != h.Gen || s.state != stateDemoting {
			return fmt.Errorf("%w: slot %d gen %d is not demoting (now gen %d, %v)", errStaleSlot, h.ID, h.Gen, s.gen, s.state)
		}
		if s.dupMark == c.dupEpoch {
			return fmt.Errorf("%w: slot %d given twice to Demoted", errDuplicate, h.ID)
		}
		s.dupMark = c.dupEpoch
	}
	for _, h := range slots {
		i := int32(h.ID)
		s := &c.slots[i]
		s.demote = false
		c.setState(s, stateReleasing)
		c.release(i)
	}
	c.check()
	return nil
}
