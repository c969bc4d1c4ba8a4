package kvcache

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDupSets: the stamped sets agree with a map, call after call, across
// growth (a larger call than any before) and across the wrap of the stamp.
func TestDupSets(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var ks dupKeySet
	var ids dupIDSet
	for call := range 400 {
		if call == 200 {
			ks.stamp, ids.stamp = ^uint32(0)-2, ^uint32(0)-2 // wrap within the next calls
		}
		n := 1 + rng.IntN(64)
		if call%50 == 49 {
			n = 1000 + rng.IntN(2000) // grows the tables
		}
		ks.start(n)
		ids.start(n)
		seenK, seenID := map[Key]bool{}, map[int]bool{}
		for range n {
			// Few distinct values, so that duplicates are common; ids
			// reach far above n (the set's size follows the call only).
			var k Key
			k[rng.IntN(16)] = byte(rng.IntN(n))
			id := rng.IntN(2*n) << rng.IntN(20)
			require.Equal(t, seenK[k], ks.add(k), "call %d key %v", call, k)
			require.Equal(t, seenID[id], ids.add(id), "call %d id %d", call, id)
			seenK[k], seenID[id] = true, true
		}
		require.NotZero(t, ks.stamp)
		require.NotZero(t, ids.stamp)
	}
}
