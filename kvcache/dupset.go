package kvcache

// dupSet finds a value named twice in one call (a key, a block id): an
// open-addressing set of the call's values whose entries carry the call's
// stamp, so that starting a call is one increment, not a clear (a map
// cleared and refilled per call was 40% of BeginLoad for 2048 keys). It is
// at most half full; it grows with the largest call and is reused. Its
// size follows the calls, never the values (a block id's range is the
// caller's NumBlocks).
type dupSet[V comparable] struct {
	t     []dupEntry[V] // len a power of two, or 0
	mask  uint64
	stamp uint32
}

type dupEntry[V comparable] struct {
	v     V
	stamp uint32 // the call that put v here; another value is empty
}

// start begins a call that will add at most n values.
func (d *dupSet[V]) start(n int) {
	if 2*n > len(d.t) {
		size := halfFull(n)
		d.t, d.mask, d.stamp = make([]dupEntry[V], size), uint64(size-1), 0
	}
	if nextStamp(&d.stamp) {
		clear(d.t)
	}
}

// add adds v, whose hash is h, and reports whether it was already added in
// this call.
func (d *dupSet[V]) add(v V, h uint64) (dup bool) {
	for b := h & d.mask; ; b = (b + 1) & d.mask {
		e := &d.t[b]
		if e.stamp != d.stamp {
			e.v, e.stamp = v, d.stamp
			return false
		}
		if e.v == v {
			return true
		}
	}
}

// dupKeySet and dupIDSet are the sets of keys and of block ids.
type (
	dupKeySet struct{ dupSet[Key] }
	dupIDSet  struct{ dupSet[int] }
)

func (d *dupKeySet) add(k Key) bool { return d.dupSet.add(k, keyHash(k)) }

func (d *dupIDSet) add(id int) bool { return d.dupSet.add(id, mix64(uint64(id))) }

// halfFull is the power-of-two table size (at least 16) that n entries
// keep at most half full.
func halfFull(n int) int {
	size := 16
	for size < 2*n {
		size <<= 1
	}
	return size
}

// nextStamp advances a set's stamp for a new call and reports whether it
// wrapped: the caller then clears its entries, so that none keeps an old
// stamp equal to a new one.
func nextStamp(stamp *uint32) (wrapped bool) {
	*stamp++
	if *stamp == 0 {
		*stamp = 1
		return true
	}
	return false
}
