package kvcache

// dupKeySet finds a key named twice in one call: an open-addressing set of
// the call's keys whose entries carry the call's stamp, so that starting a
// call is one increment, not a clear (a map cleared and refilled per call
// was 40% of BeginLoad for 2048 keys). It is at most half full; it grows
// with the largest call and is reused.
type dupKeySet struct {
	t     []dupKeyEntry // len a power of two, or 0
	mask  uint64
	stamp uint32
}

type dupKeyEntry struct {
	key   Key
	stamp uint32 // the call that put key here; another value is empty
}

// start begins a call that will add at most n keys.
func (d *dupKeySet) start(n int) {
	if 2*n > len(d.t) {
		size := halfFull(n)
		d.t, d.mask, d.stamp = make([]dupKeyEntry, size), uint64(size-1), 0
	}
	if nextStamp(&d.stamp) {
		clear(d.t)
	}
}

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

// add adds k and reports whether it was already added in this call.
func (d *dupKeySet) add(k Key) (dup bool) {
	x := keyIndex{mask: d.mask}
	for b := x.bucket(k); ; b = (b + 1) & d.mask {
		e := &d.t[b]
		if e.stamp != d.stamp {
			e.key, e.stamp = k, d.stamp
			return false
		}
		if e.key == k {
			return true
		}
	}
}

// dupIDSet is dupKeySet for block ids: hashed too, so that its size
// follows the call, not the largest id (a block id's range is the
// caller's NumBlocks).
type dupIDSet struct {
	t     []dupIDEntry
	mask  uint64
	stamp uint32
}

type dupIDEntry struct {
	id    int
	stamp uint32
}

func (d *dupIDSet) start(n int) {
	if 2*n > len(d.t) {
		size := halfFull(n)
		d.t, d.mask, d.stamp = make([]dupIDEntry, size), uint64(size-1), 0
	}
	if nextStamp(&d.stamp) {
		clear(d.t)
	}
}

func (d *dupIDSet) add(id int) (dup bool) {
	h := uint64(id) * 0x9e3779b97f4a7c15
	for b := (h ^ h>>29) & d.mask; ; b = (b + 1) & d.mask {
		e := &d.t[b]
		if e.stamp != d.stamp {
			e.id, e.stamp = id, d.stamp
			return false
		}
		if e.id == id {
			return true
		}
	}
}
