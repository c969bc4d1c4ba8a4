package kvcache

import "sync"

// MaxSeenCount is the most a SeenCounter counts for one key: its counters
// saturate there (as Config.StoreThreshold's do).
const MaxSeenCount = maxSeen

// SeenCounter counts uses of keys approximately, for an owner's admission
// filter outside the cache (a lower tier that writes only blocks used at
// least N times): the sketch behind Config.StoreThreshold, one saturating
// counter (at most MaxSeenCount) per hash bucket of the key's first eight
// bytes (keys are hashes), 1 Mi buckets of one byte, all halved every 1 Mi
// additions so that old uses fade. Keys sharing a bucket share a count:
// a key may be reported seen more often than it was, never less (before
// a halving). Safe for concurrent use (one mutex, never held while
// calling out).
type SeenCounter struct {
	mu sync.Mutex
	s  seenSketch
}

// NewSeenCounter returns a counter with every count 0 (it allocates its
// 1 MiB of counters).
func NewSeenCounter() *SeenCounter { return &SeenCounter{s: newSeenSketch()} }

// Add counts one use of each key.
func (c *SeenCounter) Add(keys []Key) {
	if len(keys) == 0 {
		return
	}
	c.mu.Lock()
	for _, k := range keys {
		c.s.add(k)
	}
	c.mu.Unlock()
}

// Count returns key's count: 0 to MaxSeenCount.
func (c *SeenCounter) Count(k Key) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.s.count(k)
}

const (
	seenBits = 20 // 1 Mi counters of 1 byte
	maxSeen  = 15
)

// seenSketch counts lookups per key approximately: one saturating counter
// per hash bucket, all halved every seenSize additions so that old demand
// fades (the "reset" of TinyLFU).
type seenSketch struct {
	counts []uint8
	adds   int
}

func newSeenSketch() seenSketch { return seenSketch{counts: make([]uint8, 1<<seenBits)} }

func (s *seenSketch) bucket(k Key) uint32 { return uint32(hash64(k) >> (64 - seenBits)) }

func (s *seenSketch) add(k Key) {
	b := s.bucket(k)
	if s.counts[b] < maxSeen {
		s.counts[b]++
	}
	if s.adds++; s.adds >= len(s.counts) {
		s.adds = 0
		for i := range s.counts {
			s.counts[i] >>= 1
		}
	}
}

func (s *seenSketch) count(k Key) int { return int(s.counts[s.bucket(k)]) }
