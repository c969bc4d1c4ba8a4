package kvcache

import (
	"slices"
	"time"
)

// DefaultPartialTimeout is Config.PartialTimeout's default: how long a
// block stored by head ranges waits for its missing heads before it is
// reclaimed. Far longer than a store's copy takes (milliseconds), far
// shorter than a block stays useful.
const DefaultPartialTimeout = 30 * time.Second

// partial is the head-range state of a block being assembled from the
// stores of several ranks (a TP group): the heads committed so far and the
// head ranges whose copies are in flight. A slot has one only while it is
// writing (or releasing with such copies in flight); a block becomes ready,
// and drops it, when done covers every head.
type partial struct {
	done   []HeadRange // committed heads: sorted, disjoint, adjacent ranges merged
	writes []HeadRange // granted head ranges whose copies are in flight
}

// covers reports whether p's committed heads are [0, n).
func (p *partial) covers(n int) bool {
	return len(p.done) == 1 && p.done[0] == HeadRange{First: 0, Count: n}
}

// taken reports whether any head of r is committed or being written.
func (p *partial) taken(r HeadRange) bool {
	for _, q := range p.done {
		if q.overlaps(r) {
			return true
		}
	}
	for _, q := range p.writes {
		if q.overlaps(r) {
			return true
		}
	}
	return false
}

// writeIndex is the index in writes of r, or -1.
func (p *partial) writeIndex(r HeadRange) int { return slices.Index(p.writes, r) }

// commit adds r (not taken) to done, keeping it sorted and merged.
func (p *partial) commit(r HeadRange) {
	i := 0
	for i < len(p.done) && p.done[i].First < r.First {
		i++
	}
	p.done = slices.Insert(p.done, i, r)
	out := p.done[:1]
	for _, q := range p.done[1:] {
		if last := &out[len(out)-1]; last.end() == q.First {
			last.Count += q.Count
		} else {
			out = append(out, q)
		}
	}
	p.done = out
}

// expiry is one entry of the cache's queue of partial blocks, oldest first:
// the slot occupancy (id, gen) and when it is reclaimed if still partial.
type expiry struct {
	slot     int32
	gen      uint32
	deadline int64 // unix nanoseconds
}

// storeWrites is the number of store copies in flight on s: its head-range
// writes, or 1 while a whole-block store's copy is.
func (s *slotRec) storeWrites() int32 {
	if s.part != nil {
		return int32(len(s.part.writes))
	}
	return b2i(s.storing)
}

func (c *Cache) clock() int64 { return c.now().UnixNano() }

// expirePartials reclaims the partial blocks whose deadline passed: they
// leave the index (never visible, never loaded) and their slots are
// released once the copies in flight on them end (Stats.PartialExpired).
func (c *Cache) expirePartials() {
	if c.expHead == len(c.expiries) {
		return
	}
	now := c.clock()
	for c.expHead < len(c.expiries) {
		e := c.expiries[c.expHead]
		if e.deadline > now {
			break
		}
		c.expHead++
		if s := &c.slots[e.slot]; s.gen == e.gen && s.part != nil && s.state == stateWriting {
			c.evict(e.slot, &c.st.PartialExpired, true)
		}
	}
	if c.expHead > 64 && c.expHead*2 > len(c.expiries) {
		n := copy(c.expiries, c.expiries[c.expHead:])
		c.expiries = c.expiries[:n]
		c.expHead = 0
	}
}

// ExpirePartials reclaims the blocks stored by head ranges that are still
// missing heads after Config.PartialTimeout (a rank died, or its store
// failed and was not retried). BeginStore does it too; an engine calls it
// when idle.
func (c *Cache) ExpirePartials() {
	c.mu.Lock()
	defer c.unlock()
	if !c.closed {
		c.expirePartials()
		c.check()
	}
}

// setPart sets s's partial record, keeping the Stats.Partial gauge.
func (c *Cache) setPart(s *slotRec, p *partial) {
	if s.part != nil {
		c.nPartial--
	}
	if p != nil {
		c.nPartial++
	}
	s.part = p
}
