package kvcache

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"sync"

	"github.com/dgraph-io/ristretto/v2"
)

// TinyLFUConfig configures NewTinyLFU.
type TinyLFUConfig struct {
	// MaxBlocks is the most ready blocks the pool is expected to hold; it
	// sizes the frequency sketch (10 counters per block). Required.
	MaxBlocks int
	// BufferItems is ristretto's Get buffer size; 0 means 64 (its advice).
	BufferItems int64
}

// tinyLFU is a Policy backed by ristretto v2: tinyLFU admission over a
// count-min frequency sketch and sampled-LFU eviction, with cost = one slot
// (IgnoreInternalCost).
//
// Ristretto's contract and how it is handled:
//   - Set is buffered and may be dropped (returns false): dropped inserts are
//     kept and retried on the next call, so no ready block goes untracked.
//   - Admission is decided after the fact on ristretto's goroutine: a block
//     already copied to the host may be rejected (OnReject). It is then
//     evicted and reported as Rejected, its D2H copy wasted.
//   - OnEvict and OnReject run on ristretto's goroutine and must not block:
//     they append to a queue under a small mutex of their own (never the
//     cache lock), which Evictions drains.
//   - Decisions lag: Sync (ristretto's Wait) makes them visible.
//
// Ristretto keys blocks by the first 8 bytes of their Key (keys are hashes,
// so that is a uniform 64-bit hash); the full Key, slot and generation travel
// as the value, and the cache ignores advice about a slot's earlier occupant.
// The low-watermark is kept by giving ristretto a capacity of the usable
// slots less the watermark. Ristretto cannot name victims on demand, and its
// evictions lag behind a burst of stores; so tinyLFU also tracks the ready
// blocks it was told of, with a saturating hit count each, and when the
// cache needs slots that ristretto's advice did not free it picks the least
// hit of lruWindow random samples (sampled LFU, lowest rank first), removes
// it from the dropped inserts and names it. It is not deleted from
// ristretto: Del blocks while ristretto's set buffer is full, which is
// exactly when a burst needs slots, and no call may block under the cache
// lock. Ristretto keeps the stale entry until it evicts it itself (that
// advice is ignored, as any about an earlier occupant), so for a while it
// counts the burst's victims against its capacity and the pool holds fewer
// ready blocks than it could. Ristretto may also reject a block stored into
// the room so made: that is reported as Rejected, as any rejection.
type tinyLFU struct {
	c *ristretto.Cache[uint64, entry]

	// Tracking for on-demand victims; guarded by the cache lock.
	tracked []entry
	hits    []uint8 // parallel to tracked
	pos     []int32 // slot → index in tracked, -1 when untracked
	rng     *rand.Rand

	mu      sync.Mutex // guards advice; taken by ristretto's goroutine
	advice  []victim
	dropped []entry // inserts ristretto dropped; retried (cache lock held)
}

// TinyLFUBytes estimates the bytes NewTinyLFU allocates for MaxBlocks = n:
// ristretto's count-min sketch (4 rows of 4-bit counters over 10 × n
// counters, rounded up to a power of two) and its doorkeeper bloom filter,
// bounded above by 4 bytes per rounded counter. Callers sizing a pool add it
// to what they check.
func TinyLFUBytes(n int) int64 {
	if n <= 0 {
		return 0
	}
	c := int64(1)
	for c < 10*int64(min(n, MaxSlots)) {
		c <<= 1
	}
	return 4 * c
}

// NewTinyLFU returns a TinyLFU policy for Config.Policy. The cache given it
// owns it: Cache.Close stops ristretto's goroutines.
func NewTinyLFU(cfg TinyLFUConfig) (Policy, error) {
	if cfg.MaxBlocks < 1 || cfg.MaxBlocks > MaxSlots {
		return nil, fmt.Errorf("%w: TinyLFU MaxBlocks = %d, must be in [1, %d]", errConfig, cfg.MaxBlocks, MaxSlots)
	}
	if cfg.BufferItems == 0 {
		cfg.BufferItems = 64
	}
	p := &tinyLFU{rng: rand.New(rand.NewPCG(uint64(cfg.MaxBlocks), 0x9e3779b97f4a7c15))}
	c, err := ristretto.NewCache(&ristretto.Config[uint64, entry]{
		NumCounters:        10 * int64(cfg.MaxBlocks),
		MaxCost:            int64(cfg.MaxBlocks),
		BufferItems:        cfg.BufferItems,
		IgnoreInternalCost: true,
		OnEvict: func(it *ristretto.Item[entry]) {
			p.push(victim{entry: it.Value})
		},
		OnReject: func(it *ristretto.Item[entry]) {
			p.push(victim{entry: it.Value, Rejected: true})
		},
	})
	if err != nil {
		return nil, fmt.Errorf("%w: ristretto: %w", errConfig, err)
	}
	p.c = c
	return p, nil
}

func (p *tinyLFU) push(v victim) {
	p.mu.Lock()
	p.advice = append(p.advice, v)
	p.mu.Unlock()
}

func hash64(k Key) uint64 { return binary.LittleEndian.Uint64(k[:8]) }

// setCapacity implements Policy.
func (p *tinyLFU) setCapacity(blocks int) { p.c.UpdateMaxCost(int64(max(blocks, 1))) }

// inserted implements Policy.
func (p *tinyLFU) inserted(e entry) {
	p.track(e)
	p.set(e)
}

func (p *tinyLFU) set(e entry) {
	if !p.c.Set(hash64(e.Key), e, 1) {
		p.dropped = append(p.dropped, e)
	}
}

func (p *tinyLFU) track(e entry) {
	for int(e.Slot) >= len(p.pos) {
		p.pos = append(p.pos, -1)
	}
	if j := p.pos[e.Slot]; j >= 0 {
		p.tracked[j], p.hits[j] = e, 0
		return
	}
	p.pos[e.Slot] = int32(len(p.tracked))
	p.tracked = append(p.tracked, e)
	p.hits = append(p.hits, 0)
}

// untrack stops tracking e; it reports whether e was tracked.
func (p *tinyLFU) untrack(e entry) bool {
	if int(e.Slot) >= len(p.pos) {
		return false
	}
	j := p.pos[e.Slot]
	if j < 0 || p.tracked[j] != e {
		return false
	}
	last := int32(len(p.tracked) - 1)
	if j != last {
		p.tracked[j], p.hits[j] = p.tracked[last], p.hits[last]
		p.pos[p.tracked[j].Slot] = j
	}
	p.tracked, p.hits = p.tracked[:last], p.hits[:last]
	p.pos[e.Slot] = -1
	return true
}

// accessed implements Policy.
func (p *tinyLFU) accessed(e entry) {
	if int(e.Slot) < len(p.pos) {
		if j := p.pos[e.Slot]; j >= 0 && p.tracked[j] == e && p.hits[j] < 255 {
			p.hits[j]++
		}
	}
	p.c.Get(hash64(e.Key))
}

// missed implements Policy: the miss counts in the frequency sketch, which
// is what lets a block that is asked for often be admitted.
func (p *tinyLFU) missed(k Key) { p.c.Get(hash64(k)) }

// removed implements Policy.
func (p *tinyLFU) removed(e entry) {
	p.untrack(e)
	p.forget(e)
}

// forget removes e from ristretto (or from the dropped inserts).
func (p *tinyLFU) forget(e entry) {
	if !p.undrop(e) {
		p.c.Del(hash64(e.Key))
	}
}

// undrop removes e from the dropped inserts; it reports whether it was one.
func (p *tinyLFU) undrop(e entry) bool {
	for i, d := range p.dropped {
		if d == e {
			p.dropped = append(p.dropped[:i], p.dropped[i+1:]...)
			return true
		}
	}
	return false
}

// evictions implements Policy: it retries dropped inserts, returns the
// evictions and rejections ristretto has decided, and, for as much of need
// as that advice does not cover, names victims chosen now (sampled LFU over
// the tracked blocks, lowest Rank first).
func (p *tinyLFU) evictions(need int, rank rankFunc, dst []victim) []victim {
	if len(p.dropped) > 0 {
		d := p.dropped
		p.dropped = nil
		for _, e := range d {
			p.set(e)
		}
	}
	p.mu.Lock()
	n := len(dst)
	dst = append(dst, p.advice...)
	p.advice = p.advice[:0]
	p.mu.Unlock()
	for _, v := range dst[n:] {
		if p.untrack(v.entry) {
			need--
		}
	}
	for ; need > 0 && len(p.tracked) > 0; need-- {
		j := p.sample(rank)
		if j < 0 {
			break
		}
		e := p.tracked[j]
		p.untrack(e)
		p.undrop(e)
		dst = append(dst, victim{entry: e})
	}
	return dst
}

// sample returns the index in tracked of the least hit among the
// lowest-ranked of lruWindow random samples, scanning every entry when no
// sample is a victim; -1 when no tracked block is.
func (p *tinyLFU) sample(rank rankFunc) int {
	best, bestRank, bestHits := -1, notAVictim, uint8(0)
	for n := 0; n < lruWindow; n++ {
		j := p.rng.IntN(len(p.tracked))
		r := rank(p.tracked[j].Slot)
		if r < bestRank || (r == bestRank && r != notAVictim && p.hits[j] < bestHits) {
			best, bestRank, bestHits = j, r, p.hits[j]
		}
	}
	for j := 0; best < 0 && j < len(p.tracked); j++ {
		if rank(p.tracked[j].Slot) < notAVictim {
			best = j
		}
	}
	return best
}

// sync implements Policy (ristretto's Wait).
func (p *tinyLFU) sync() { p.c.Wait() }

// close implements Policy: stops ristretto's goroutines.
func (p *tinyLFU) close() { p.c.Close() }
