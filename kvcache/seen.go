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
