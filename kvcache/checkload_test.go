package kvcache

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// loadErrRef is BeginLoad's checks as one loop over the keys made them
// before checkLoad (28107a5's parent): at each index a bad block id, then
// a key seen before, then a block id seen before; the first failing index
// gives the error.
func loadErrRef(c *Cache, keys []Key, ids []int) error {
	keySeen, idSeen := map[Key]bool{}, map[int]bool{}
	for j, k := range keys {
		if err := c.layout.CheckBlock(ids[j]); err != nil {
			return fmt.Errorf("key %d (%v): %w", j, k, err)
		}
		if keySeen[k] {
			return fmt.Errorf("%w: key %v at index %d", errDuplicate, k, j)
		}
		keySeen[k] = true
		if idSeen[ids[j]] {
			return fmt.Errorf("%w: block id %d at index %d", errDuplicate, ids[j], j)
		}
		idSeen[ids[j]] = true
	}
	return nil
}

// TestCheckLoadMatchesOneLoop: BeginLoad's checkLoad (repeated keys found
// by the slot they map to) gives exactly the error of the one-loop checks
// (loadErrRef), and its lookups are the index's, on random calls mixing
// stored and unknown keys, repeated keys, repeated and out-of-range block
// ids.
func TestCheckLoadMatchesOneLoop(t *testing.T) {
	c := newCache(t, 64, Config{Layout: tinyLayout(t, 64)})
	stored, ids := keysN(0, 40)
	store(t, c, stored, ids)
	rng := rand.New(rand.NewPCG(7, 9))
	errs := 0
	for range 20000 {
		n := 1 + rng.IntN(12)
		keys, bids := make([]Key, n), make([]int, n)
		for j := range n {
			keys[j] = key(rng.IntN(60)) // 40 stored, 20 not
			bids[j] = rng.IntN(80) - 4  // some out of range, some repeated
		}
		c.mu.Lock()
		want := loadErrRef(c, keys, bids)
		got := c.checkLoad(keys, bids)
		found := append([]int32(nil), c.found...)
		c.mu.Unlock()
		if want == nil {
			require.NoError(t, got, "keys %v ids %v", keys, bids)
			for j, k := range keys {
				i, ok := c.index.get(k)
				if !ok {
					i = -1
				}
				require.Equal(t, i, found[j], "lookup %d", j)
			}
			continue
		}
		errs++
		require.Error(t, got, "keys %v ids %v: want %v", keys, bids, want)
		require.Equal(t, want.Error(), got.Error(), "keys %v ids %v", keys, bids)
	}
	require.Greater(t, errs, 5000, "the calls exercise the errors")
}
