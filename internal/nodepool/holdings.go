package nodepool

import (
	"github.com/kvoffload/kvoffload/internal/nodepool/wire"
	"github.com/kvoffload/kvoffload/kvcache"
)

// holdings is what one client holds, indexed by slot id: for each slot,
// the generation (occupancy) held, the reader leases, the loads (a lease
// and a copy each), and whether the client reserved it for a store (and
// when). A client holds at most one generation of a slot at a time: a slot
// is not reoccupied while anyone holds it. A dense table rather than maps:
// the hot path (1024 leases a lookup) is an array index per block. Leases
// and loads are counts per slot, so what a client holds costs the node in
// proportion to its slots, however many leases it took, and so does its
// release (drain).
//
// Every change goes through the methods below, which keep the totals and
// the count of slots held (slots), charged to the client process's
// account: a slot becoming held uses one slot of a request's grant (see
// account.grant), or is charged directly when the request had none (an
// undo); a slot no longer held is given back.
type holdings struct {
	t                       []holding
	reserved, leases, loads int // totals
	slots                   int // entries not empty
	acct                    *account
}

type holding struct {
	gen           uint32
	leases, loads int32
	reserved      bool
	// heads is the head range of the reservation (zero: the whole
	// block): one range per block per client.
	heads kvcache.HeadRange
	// since is when the reservation was made (UnixNano), for
	// ReserveTimeout.
	since int64
}

func (h *holding) empty() bool { return h.leases == 0 && h.loads == 0 && !h.reserved }

// take returns the entry of a slot handed to this client, taking it over
// for generation gen; ok is false if the client holds another generation
// of it (which the index never allows: an internal error).
func (hs *holdings) take(id, gen uint32) (*holding, bool) {
	if int(id) >= len(hs.t) {
		n := max(int(id)+1, 2*len(hs.t), 1024)
		t := make([]holding, n)
		copy(t, hs.t)
		hs.t = t
	}
	e := &hs.t[id]
	if e.empty() {
		e.gen = gen
	}
	return e, e.gen == gen
}

// peek returns the entry of slot id (nil: none held).
func (hs *holdings) peek(id uint32) *holding {
	if int(id) >= len(hs.t) || hs.t[id].empty() {
		return nil
	}
	return &hs.t[id]
}

// get returns the entry of handle h if the client holds that generation.
func (hs *holdings) get(h wire.Handle) *holding {
	if int(h.ID) >= len(hs.t) {
		return nil
	}
	e := &hs.t[h.ID]
	if e.gen != h.Gen || e.empty() {
		return nil
	}
	return e
}

// grew counts e becoming held, from *grant when it has some left.
func (hs *holdings) grew(grant *int) {
	hs.slots++
	switch {
	case grant != nil && *grant > 0:
		*grant--
	case hs.acct != nil:
		hs.acct.slots.Add(1)
	}
}

// shrank counts e held no more.
func (hs *holdings) shrank() {
	hs.slots--
	if hs.acct != nil {
		hs.acct.slots.Add(-1)
	}
}

func (hs *holdings) addLease(e *holding, grant *int) {
	if e.empty() {
		hs.grew(grant)
	}
	e.leases++
	hs.leases++
}

func (hs *holdings) addLoad(e *holding, grant *int) {
	if e.empty() {
		hs.grew(grant)
	}
	e.loads++
	hs.loads++
}

func (hs *holdings) reserve(e *holding, heads kvcache.HeadRange, since int64, grant *int) {
	if e.empty() {
		hs.grew(grant)
	}
	e.reserved, e.heads, e.since = true, heads, since
	hs.reserved++
}

func (hs *holdings) dropLease(e *holding) {
	e.leases--
	hs.leases--
	if e.empty() {
		hs.shrank()
	}
}

func (hs *holdings) dropLoad(e *holding) {
	e.loads--
	hs.loads--
	if e.empty() {
		hs.shrank()
	}
}

// unreserve ends e's reservation and returns its head range.
func (hs *holdings) unreserve(e *holding) kvcache.HeadRange {
	heads := e.heads
	e.reserved, e.heads, e.since = false, kvcache.HeadRange{}, 0
	hs.reserved--
	if e.empty() {
		hs.shrank()
	}
	return heads
}

func slotOf(h wire.Handle) kvcache.Slot { return kvcache.Slot{ID: kvcache.SlotID(h.ID), Gen: h.Gen} }

// appendSlotOf is append(s, slotOf(h)) writing the new entry in place: a
// 48-byte kvcache.Slot built on the stack and copied in stalled on store
// forwarding, about 20 ns a handle (20 µs of a 1024-handle Unlease).
func appendSlotOf(s []kvcache.Slot, h wire.Handle) []kvcache.Slot {
	s = append(s, kvcache.Slot{})
	d := &s[len(s)-1]
	d.ID, d.Gen = kvcache.SlotID(h.ID), h.Gen
	return s
}

// expire ends the reservations made before cut (UnixNano), appending their
// handles (with their head ranges) to dst.
func (hs *holdings) expire(cut int64, dst []kvcache.Slot) []kvcache.Slot {
	if hs.reserved == 0 {
		return dst
	}
	for id := range hs.t {
		e := &hs.t[id]
		if !e.reserved || e.since >= cut {
			continue
		}
		s := kvcache.Slot{ID: kvcache.SlotID(id), Gen: e.gen}
		s.Heads = hs.unreserve(e)
		dst = append(dst, s)
	}
	return dst
}

// drain lists every holding, the reservations as kvcache slot handles and
// the leases and loads as one count each per slot (kvcache.EndReads), and
// clears the table: its cost is in proportion to the slots held.
func (hs *holdings) drain() (reserved []kvcache.Slot, reads []kvcache.Reads) {
	for id := range hs.t {
		e := &hs.t[id]
		if e.empty() {
			continue
		}
		s := kvcache.Slot{ID: kvcache.SlotID(id), Gen: e.gen}
		if e.reserved {
			r := s
			r.Heads = e.heads
			reserved = append(reserved, r)
		}
		if e.leases > 0 || e.loads > 0 {
			reads = append(reads, kvcache.Reads{Slot: s, Leases: e.leases, Loads: e.loads})
		}
		*e = holding{}
	}
	if hs.acct != nil {
		hs.acct.slots.Add(-int64(hs.slots))
	}
	hs.reserved, hs.leases, hs.loads, hs.slots = 0, 0, 0, 0
	hs.t = nil // the table's memory goes with the client
	return
}
