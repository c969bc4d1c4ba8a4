// Package kvseen counts uses of 128-bit block keys approximately: the
// sketch behind kvcache's Config.StoreThreshold (Sketch, guarded by the
// cache's lock), and Counter, the same sketch behind a mutex of its own for
// an admission filter outside the cache (the node pool's disk tier writes
// only blocks used at least N times).
//
// One saturating counter (at most Max) per hash bucket of the key's first
// eight bytes (keys are hashes), 1 Mi buckets of one byte, all halved every
// 1 Mi additions so that old uses fade (the "reset" of TinyLFU). Keys
// sharing a bucket share a count: a key may be reported seen more often
// than it was, never less (before a halving).
package kvseen

import (
	"encoding/binary"
	"sync"
)

const (
	bits = 20 // 1 Mi counters of 1 byte
	// Max is the most a key counts: its counter saturates there.
	Max = 15
)

// Sketch is the counters, not safe for concurrent use. Its zero value
// holds no counters: make one with NewSketch before Add or Count.
type Sketch struct {
	counts []uint8
	adds   int
}

// NewSketch returns a sketch with every count 0 (it allocates its 1 MiB
// of counters).
func NewSketch() Sketch { return Sketch{counts: make([]uint8, 1<<bits)} }

func (s *Sketch) bucket(k [16]byte) uint32 {
	return uint32(binary.LittleEndian.Uint64(k[:8]) >> (64 - bits))
}

// Add counts one use of k.
func (s *Sketch) Add(k [16]byte) {
	b := s.bucket(k)
	if s.counts[b] < Max {
		s.counts[b]++
	}
	if s.adds++; s.adds >= len(s.counts) {
		s.adds = 0
		for i := range s.counts {
			s.counts[i] >>= 1
		}
	}
}

// Count returns k's count: 0 to Max.
func (s *Sketch) Count(k [16]byte) int { return int(s.counts[s.bucket(k)]) }

// Counter is a Sketch safe for concurrent use (one mutex, never held while
// calling out), counting keys of type K (kvcache.Key).
type Counter[K ~[16]byte] struct {
	mu sync.Mutex
	s  Sketch
}

// NewCounter returns a counter with every count 0 (it allocates its 1 MiB
// of counters).
func NewCounter[K ~[16]byte]() *Counter[K] { return &Counter[K]{s: NewSketch()} }

// Add counts one use of each key.
func (c *Counter[K]) Add(keys []K) {
	if len(keys) == 0 {
		return
	}
	c.mu.Lock()
	for _, k := range keys {
		c.s.Add([16]byte(k))
	}
	c.mu.Unlock()
}

// Count returns k's count: 0 to Max.
func (c *Counter[K]) Count(k K) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.s.Count([16]byte(k))
}
