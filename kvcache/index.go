package kvcache

import "encoding/binary"

// keyIndex maps keys to slots: an open-addressing hash table with linear
// probing and backward-shift deletion (no tombstones), at most half full.
// Keys are hashes already, so the bucket comes from mixing the key's own
// bits, not from hashing it again; an entry holds the whole key, so a probe
// touches one cache line in the common case. It replaces a map[Key]int32,
// whose generic (non-fast-path) lookups dominated BeginStore, Lookup and
// evictions at a million slots.
type keyIndex struct {
	t    []indexEntry // len a power of two, or 0
	mask uint64
	n    int
}

type indexEntry struct {
	key  Key
	slot int32 // slot + 1; 0 marks an empty bucket
}

func (x *keyIndex) bucket(k Key) uint64 { return keyHash(k) & x.mask }

// keyHash mixes a key's own bits (keys are hashes already) into a bucket
// hash for the index and the duplicate sets.
func keyHash(k Key) uint64 {
	lo, hi := binary.LittleEndian.Uint64(k[:8]), binary.LittleEndian.Uint64(k[8:])
	return mix64(lo ^ hi*0xc2b2ae3d27d4eb4f)
}

// mix64 spreads x's bits over the low ones that pick a bucket.
func mix64(x uint64) uint64 {
	h := x * 0x9e3779b97f4a7c15
	return h ^ h>>29
}

func (x *keyIndex) len() int { return x.n }

// reserve grows the table so that n keys keep it at most half full.
func (x *keyIndex) reserve(n int) {
	size := halfFull(n)
	if size <= len(x.t) {
		return
	}
	old := x.t
	x.t, x.mask, x.n = make([]indexEntry, size), uint64(size-1), 0
	for _, e := range old {
		if e.slot != 0 {
			x.put(e.key, e.slot-1)
		}
	}
}

func (x *keyIndex) get(k Key) (int32, bool) {
	if len(x.t) == 0 {
		return -1, false
	}
	for b := x.bucket(k); ; b = (b + 1) & x.mask {
		e := &x.t[b]
		if e.slot == 0 {
			return -1, false
		}
		if e.key == k {
			return e.slot - 1, true
		}
	}
}

// put maps k to slot, replacing an earlier mapping of k.
func (x *keyIndex) put(k Key, slot int32) {
	if 2*(x.n+1) > len(x.t) {
		x.reserve(x.n + 1)
	}
	for b := x.bucket(k); ; b = (b + 1) & x.mask {
		e := &x.t[b]
		if e.slot == 0 {
			e.key, e.slot = k, slot+1
			x.n++
			return
		}
		if e.key == k {
			e.slot = slot + 1
			return
		}
	}
}

// del removes k (absent keys are ignored), shifting later entries of its
// probe run back so that lookups never stop early.
func (x *keyIndex) del(k Key) {
	if len(x.t) == 0 {
		return
	}
	b := x.bucket(k)
	for {
		e := &x.t[b]
		if e.slot == 0 {
			return
		}
		if e.key == k {
			break
		}
		b = (b + 1) & x.mask
	}
	x.n--
	hole := b
	for j := (b + 1) & x.mask; x.t[j].slot != 0; j = (j + 1) & x.mask {
		// An entry moves into the hole unless its home bucket lies
		// cyclically in (hole, j].
		if home := x.bucket(x.t[j].key); (j-home)&x.mask >= (j-hole)&x.mask {
			x.t[hole] = x.t[j]
			hole = j
		}
	}
	x.t[hole] = indexEntry{}
}
