package kvcache

// Slot helpers the operations share: the slot-state predicates indexed and
// visible, lookupHandle (a handle checked against its slot), nextDupEpoch
// (which starts a call's count of handles per slot) and b2i.
//
// Locks: none taken; the Cache methods here run with the cache lock
// (Cache.mu) held.

import "fmt"

func (s *slotRec) indexed() bool {
	return s.state == stateWriting || s.state == stateReady || s.state == stateLeased
}

func (s *slotRec) visible() bool { return s.state == stateReady || s.state == stateLeased }

func (c *Cache) lookupHandle(h Slot) (*slotRec, error) {
	if int(h.ID) >= len(c.slots) {
		return nil, fmt.Errorf("%w: slot %d, the pool has %d", errStaleSlot, h.ID, len(c.slots))
	}
	s := &c.slots[h.ID]
	if s.gen != h.Gen || s.state == stateFree || s.state == stateZeroing || s.state == stateDemoting || s.state == stateRetired {
		return nil, fmt.Errorf("%w: slot %d gen %d (now gen %d, %v)", errStaleSlot, h.ID, h.Gen, s.gen, s.state)
	}
	return s, nil
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
