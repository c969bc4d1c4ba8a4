package kvcache

import (
	"sync"
	"testing"
)

// TestSeenCounter: counts per key, saturating at MaxSeenCount, halved
// after a sketch's worth of additions; safe from several goroutines.
func TestSeenCounter(t *testing.T) {
	c := NewSeenCounter()
	a, b := Key{0, 0, 0, 0, 0, 0, 0, 1}, Key{0, 0, 0, 0, 0, 0, 0, 2}
	if c.Count(a) != 0 {
		t.Fatalf("fresh count %d", c.Count(a))
	}
	c.Add([]Key{a, a, b})
	if c.Count(a) != 2 || c.Count(b) != 1 {
		t.Fatalf("counts %d, %d; want 2, 1", c.Count(a), c.Count(b))
	}
	for range 2 * MaxSeenCount {
		c.Add([]Key{a})
	}
	if c.Count(a) != MaxSeenCount {
		t.Fatalf("saturated count %d, want %d", c.Count(a), MaxSeenCount)
	}
	var wg sync.WaitGroup
	for g := range 2 {
		wg.Go(func() {
			keys := make([]Key, 1024)
			for i := range keys {
				keys[i] = Key{byte(g), byte(i), byte(i >> 8), 0xff, 0, 0, 0, 0x80}
			}
			for range (1 << seenBits) / len(keys) / 2 {
				c.Add(keys)
			}
		})
	}
	wg.Wait()
	if c.Count(a) != MaxSeenCount>>1 {
		t.Fatalf("after a sketch's worth of additions: %d, want %d (halved)", c.Count(a), MaxSeenCount>>1)
	}
}
