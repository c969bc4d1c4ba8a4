package kvcache

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCheckLoadMatchesCheckKeys: BeginLoad's checkLoad (repeated keys found
// by the slot they map to) gives exactly the error checkKeys gives for a
// load, and its lookups are the index's, on random calls mixing stored
// and unknown keys, repeated keys, repeated and out-of-range block ids.
func TestCheckLoadMatchesCheckKeys(t *testing.T) {
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
		want := c.checkKeys(keys, bids, true)
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
