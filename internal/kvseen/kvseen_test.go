package kvseen

import (
	"sync"
	"testing"
)

type key [16]byte

// TestCounter: counts per key, saturating at Max, halved after a sketch's
// worth of additions; safe from several goroutines.
func TestCounter(t *testing.T) {
	c := NewCounter[key]()
	a, b := key{0, 0, 0, 0, 0, 0, 0, 1}, key{0, 0, 0, 0, 0, 0, 0, 2}
	if c.Count(a) != 0 {
		t.Fatalf("fresh count %d", c.Count(a))
	}
	c.Add([]key{a, a, b})
	if c.Count(a) != 2 || c.Count(b) != 1 {
		t.Fatalf("counts %d, %d; want 2, 1", c.Count(a), c.Count(b))
	}
	for range 2 * Max {
		c.Add([]key{a})
	}
	if c.Count(a) != Max {
		t.Fatalf("saturated count %d, want %d", c.Count(a), Max)
	}
	var wg sync.WaitGroup
	for g := range 2 {
		wg.Go(func() {
			keys := make([]key, 1024)
			for i := range keys {
				keys[i] = key{byte(g), byte(i), byte(i >> 8), 0xff, 0, 0, 0, 0x80}
			}
			for range (1 << bits) / len(keys) / 2 {
				c.Add(keys)
			}
		})
	}
	wg.Wait()
	if c.Count(a) != Max>>1 {
		t.Fatalf("after a sketch's worth of additions: %d, want %d (halved)", c.Count(a), Max>>1)
	}
}
