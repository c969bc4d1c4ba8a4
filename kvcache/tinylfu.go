package kvcache

import (
	"encoding/binary"
	"fmt"
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

// TinyLFU is a Policy backed by ristretto v2: TinyLFU admission over a
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
// TinyLFU cannot name victims on demand: the low-watermark is kept by giving
// ristretto a capacity of the usable slots less the watermark.
type TinyLFU struct {
	c *ristretto.Cache[uint64, Entry]

	mu      sync.Mutex // guards advice; taken by ristretto's goroutine
	advice  []Victim
	dropped []Entry // inserts ristretto dropped; retried (cache lock held)
}

// NewTinyLFU returns a TinyLFU policy. Close it to stop ristretto's goroutines.
func NewTinyLFU(cfg TinyLFUConfig) (*TinyLFU, error) {
	if cfg.MaxBlocks < 1 {
		return nil, fmt.Errorf("%w: TinyLFU MaxBlocks = %d, must be at least 1", ErrConfig, cfg.MaxBlocks)
	}
	if cfg.BufferItems == 0 {
		cfg.BufferItems = 64
	}
	p := &TinyLFU{}
	c, err := ristretto.NewCache(&ristretto.Config[uint64, Entry]{
		NumCounters:        10 * int64(cfg.MaxBlocks),
		MaxCost:            int64(cfg.MaxBlocks),
		BufferItems:        cfg.BufferItems,
		IgnoreInternalCost: true,
		OnEvict: func(it *ristretto.Item[Entry]) {
			p.push(Victim{Entry: it.Value})
		},
		OnReject: func(it *ristretto.Item[Entry]) {
			p.push(Victim{Entry: it.Value, Rejected: true})
		},
	})
	if err != nil {
		return nil, fmt.Errorf("%w: ristretto: %w", ErrConfig, err)
	}
	p.c = c
	return p, nil
}

func (p *TinyLFU) push(v Victim) {
	p.mu.Lock()
	p.advice = append(p.advice, v)
	p.mu.Unlock()
}

func hash64(k Key) uint64 { return binary.LittleEndian.Uint64(k[:8]) }

// SetCapacity implements Policy.
func (p *TinyLFU) SetCapacity(blocks int) { p.c.UpdateMaxCost(int64(max(blocks, 1))) }

// Inserted implements Policy.
func (p *TinyLFU) Inserted(e Entry) {
	if !p.c.Set(hash64(e.Key), e, 1) {
		p.dropped = append(p.dropped, e)
	}
}

// Accessed implements Policy.
func (p *TinyLFU) Accessed(e Entry) { p.c.Get(hash64(e.Key)) }

// Missed implements Policy: the miss counts in the frequency sketch, which
// is what lets a block that is asked for often be admitted.
func (p *TinyLFU) Missed(k Key) { p.c.Get(hash64(k)) }

// Removed implements Policy.
func (p *TinyLFU) Removed(e Entry) {
	for i, d := range p.dropped {
		if d == e {
			p.dropped = append(p.dropped[:i], p.dropped[i+1:]...)
			return
		}
	}
	p.c.Del(hash64(e.Key))
}

// Evictions implements Policy: it retries dropped inserts and returns the
// evictions and rejections ristretto has decided; need and rank are not
// used (ristretto samples its own victims).
func (p *TinyLFU) Evictions(_ int, _ Rank, dst []Victim) []Victim {
	if len(p.dropped) > 0 {
		d := p.dropped
		p.dropped = nil
		for _, e := range d {
			p.Inserted(e)
		}
	}
	p.mu.Lock()
	dst = append(dst, p.advice...)
	p.advice = p.advice[:0]
	p.mu.Unlock()
	return dst
}

// Sync implements Policy (ristretto's Wait).
func (p *TinyLFU) Sync() { p.c.Wait() }

// Close implements Policy: stops ristretto's goroutines.
func (p *TinyLFU) Close() { p.c.Close() }
