package kvcache

import "math/rand/v2"

// SlotID is the index of a slot in the cache's slot table.
type SlotID uint32

// entry names one indexed block to a Policy: its key, its slot and the slot's
// generation (which changes every time the slot is allocated, so advice about
// an earlier occupant is recognised and ignored).
type entry struct {
	Key  Key
	Slot SlotID
	Gen  uint32
}

// victim is one block a Policy advises evicting. Rejected marks a block the
// policy refused to admit after it was stored (ristretto decides admission
// only after the fact): its D2H copy was wasted.
type victim struct {
	entry
	Rejected bool
}

// rankFunc tells a policy how good a victim a block is, lower is better: 0 a
// ready block with no indexed child (a chain tail), 1 a ready block with an
// indexed child (evicting it orphans the child), notAVictim a leased block
// (evicting it would free nothing now: a policy must not name it on demand).
type rankFunc func(SlotID) int

// notAVictim is the rank of a leased block, and of a present block of the
// chain a BeginStore is making room for.
const notAVictim = 2

// lruScan bounds how many blocks the search for a better-ranked victim than
// the least recent one looks at.
const lruScan = 64

// Policy advises the cache which ready blocks to keep: the exact
// least-recently-used policy (Config.Policy nil, the default) or TinyLFU
// (NewTinyLFU). The package implements every Policy (its methods are
// unexported). The slot pool is the authority: a policy never frees or
// allocates anything, it only names victims, and advice about blocks that
// are no longer indexed is ignored.
//
// The cache calls every method with its lock held, from one goroutine at a
// time, so methods must not block for long and must not call back into the
// cache. A policy that decides on its own goroutine (TinyLFU) queues its
// decisions and hands them over in evictions.
type Policy interface {
	// setCapacity tells the policy how many ready blocks it may keep: the
	// usable slots less the low-watermark. Called when regions come and go.
	setCapacity(blocks int)
	// inserted: a block became ready (its D2H copy completed).
	inserted(e entry)
	// accessed: a ready block was hit by a lookup or a load.
	accessed(e entry)
	// missed: a key was looked up and is not ready (demand for an absent
	// block; frequency-based policies learn from it).
	missed(k Key)
	// removed: a block left the index for a reason other than this policy's
	// advice (Delete, Clear, Trim, a deferred eviction).
	removed(e entry)
	// evictions appends to dst the blocks the policy has decided to evict on
	// its own, plus up to need more chosen now (preferring low rank, never
	// notAVictim), and returns it. Every returned entry is removed from the
	// policy's tracking. A policy names fewer than need blocks only when it
	// tracks no more victims: the cache refuses a store as pool full only
	// then, and calls again while slots are short (advice about blocks that
	// are gone frees nothing).
	evictions(need int, rank rankFunc, dst []victim) []victim
	// sync waits until decisions the policy is still making in the
	// background are queued for evictions. Called without the cache lock.
	sync()
	// close releases the policy's goroutines and resources.
	close()
}

// lruWindow is how many least-recently-used blocks LRU and Random look at to
// find one of the lowest rank.
const lruWindow = 8

// lru is an exact least-recently-used policy. It admits every block and, when
// asked for victims, takes the least recently used one of the lowest rank
// among the lruWindow least recent that are not leased. It is deterministic: given the same calls
// it gives the same advice.
type lru struct {
	// Doubly linked list through per-slot nodes; head is the most recent.
	// One node per slot (links, generation, membership together: a move
	// to the front touches one entry per node it relinks).
	nodes      []lruNode
	keys       []Key
	head, tail int32
}

type lruNode struct {
	prev, next int32
	gen        uint32
	in         bool
}

// newLRU returns an empty LRU policy.
func newLRU() *lru { return &lru{head: -1, tail: -1} }

func (p *lru) grow(s SlotID) {
	for int(s) >= len(p.nodes) {
		p.nodes = append(p.nodes, lruNode{prev: -1, next: -1})
		p.keys = append(p.keys, Key{})
	}
}

// holds reports whether slot i is in the list with generation gen.
func (p *lru) holds(i int32, gen uint32) bool {
	return int(i) < len(p.nodes) && p.nodes[i].in && p.nodes[i].gen == gen
}

func (p *lru) unlink(i int32) {
	n := &p.nodes[i]
	if n.prev >= 0 {
		p.nodes[n.prev].next = n.next
	} else {
		p.head = n.next
	}
	if n.next >= 0 {
		p.nodes[n.next].prev = n.prev
	} else {
		p.tail = n.prev
	}
	n.prev, n.next, n.in = -1, -1, false
}

func (p *lru) pushFront(i int32) {
	n := &p.nodes[i]
	n.prev, n.next, n.in = -1, p.head, true
	if p.head >= 0 {
		p.nodes[p.head].prev = i
	} else {
		p.tail = i
	}
	p.head = i
}

// setCapacity implements Policy; LRU keeps whatever the pool holds.
func (p *lru) setCapacity(int) {}

// inserted implements Policy.
func (p *lru) inserted(e entry) {
	p.grow(e.Slot)
	i := int32(e.Slot)
	if p.nodes[i].in {
		p.unlink(i)
	}
	p.keys[i], p.nodes[i].gen = e.Key, e.Gen
	p.pushFront(i)
}

// accessed implements Policy.
func (p *lru) accessed(e entry) { p.touch(int32(e.Slot), e.Gen) }

// touch moves slot i to the front when it holds generation gen.
func (p *lru) touch(i int32, gen uint32) {
	if p.holds(i, gen) {
		if p.head == i {
			return
		}
		p.unlink(i)
		p.pushFront(i)
	}
}

// missed implements Policy; LRU does not learn from misses.
func (p *lru) missed(Key) {}

// removed implements Policy.
func (p *lru) removed(e entry) {
	if i := int32(e.Slot); p.holds(i, e.Gen) {
		p.unlink(i)
	}
}

// evictions implements Policy. Each victim is the lowest-ranked of the
// lruWindow least recent blocks that are victims at all; leased blocks at
// the tail are stepped over once per call, so a call costs O(blocks + need).
func (p *lru) evictions(need int, rank rankFunc, dst []victim) []victim {
	from := p.tail // every block behind from is not a victim
	for ; need > 0; need-- {
		for from >= 0 && rank(SlotID(from)) == notAVictim {
			from = p.nodes[from].prev
		}
		if from < 0 {
			break
		}
		best, bestRank := from, rank(SlotID(from))
		for i, n, seen := p.nodes[from].prev, 1, 0; bestRank > 0 && i >= 0 && n < lruWindow && seen < lruScan; i, seen = p.nodes[i].prev, seen+1 {
			r := rank(SlotID(i))
			if r == notAVictim {
				continue
			}
			n++
			if r < bestRank {
				best, bestRank = i, r
			}
		}
		if best == from {
			from = p.nodes[from].prev
		}
		dst = append(dst, victim{entry: entry{Key: p.keys[best], Slot: SlotID(best), Gen: p.nodes[best].gen}})
		p.unlink(best)
	}
	return dst
}

// sync implements Policy; LRU decides synchronously.
func (p *lru) sync() {}

// close implements Policy.
func (p *lru) close() {}

// random evicts a block chosen at random among lruWindow samples, preferring
// low rank. Deterministic given its seed and its calls: property tests use it
// to evict parents, leased blocks and fresh blocks that LRU would spare.
type random struct {
	rng     *rand.Rand
	entries []entry
	pos     map[SlotID]int
}

// newRandom returns a Random policy seeded with seed.
func newRandom(seed uint64) *random {
	return &random{rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), pos: map[SlotID]int{}}
}

// setCapacity implements Policy.
func (p *random) setCapacity(int) {}

// inserted implements Policy.
func (p *random) inserted(e entry) {
	if i, ok := p.pos[e.Slot]; ok {
		p.entries[i] = e
		return
	}
	p.pos[e.Slot] = len(p.entries)
	p.entries = append(p.entries, e)
}

// accessed implements Policy.
func (p *random) accessed(entry) {}

// missed implements Policy.
func (p *random) missed(Key) {}

// removed implements Policy.
func (p *random) removed(e entry) {
	if i, ok := p.pos[e.Slot]; ok && p.entries[i].Gen == e.Gen {
		p.remove(i)
	}
}

func (p *random) remove(i int) {
	last := len(p.entries) - 1
	delete(p.pos, p.entries[i].Slot)
	if i != last {
		p.entries[i] = p.entries[last]
		p.pos[p.entries[i].Slot] = i
	}
	p.entries = p.entries[:last]
}

// evictions implements Policy: lruWindow random samples, lowest rank
// first; when no sample is a victim it scans every entry, so it names a
// victim whenever one exists.
func (p *random) evictions(need int, rank rankFunc, dst []victim) []victim {
	for ; need > 0 && len(p.entries) > 0; need-- {
		best := sampleVictim(p.rng, p.entries, rank)
		if best < 0 {
			break
		}
		dst = append(dst, victim{entry: p.entries[best]})
		p.remove(best)
	}
	return dst
}

// sampleVictim returns the index in entries of the lowest-ranked of
// lruWindow random samples, scanning all entries when none of the samples is
// a victim; -1 when no entry is.
func sampleVictim(rng *rand.Rand, entries []entry, rank rankFunc) int {
	best, bestRank := -1, notAVictim
	for n := 0; n < lruWindow; n++ {
		i := rng.IntN(len(entries))
		if r := rank(entries[i].Slot); r < bestRank {
			best, bestRank = i, r
		}
	}
	for i := 0; best < 0 && i < len(entries); i++ {
		if rank(entries[i].Slot) < notAVictim {
			best = i
		}
	}
	return best
}

// sync implements Policy.
func (p *random) sync() {}

// close implements Policy.
func (p *random) close() {}
