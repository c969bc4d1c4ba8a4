package kvcache

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestStoreBurstEvictsInline: a pool of N slots full of ready, unleased
// blocks takes a burst of N new keys in one store: each is stored, N blocks
// are evicted inline, and the counters add up, whatever the policy.
func TestStoreBurstEvictsInline(t *testing.T) {
	const n = 32
	for _, tc := range []struct {
		name   string
		policy func(t *testing.T) Policy
	}{
		{"lru", func(*testing.T) Policy { return newLRU() }},
		{"random", func(*testing.T) Policy { return newRandom(7) }},
		{"tinylfu", func(t *testing.T) Policy {
			p, err := NewTinyLFU(TinyLFUConfig{MaxBlocks: n})
			require.NoError(t, err)
			return p
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCache(t, n, Config{Policy: tc.policy(t)})
			old, oldIDs := keysN(0, n)
			for i := range old {
				store(t, c, old[i:i+1], oldIDs[i:i+1]) // n separate sequences
			}
			c.syncPolicy()
			st := c.Stats()
			require.Equal(t, 0, st.Free)
			require.Equal(t, n, st.Ready)

			burst, ids := keysN(n, n)
			res := store(t, c, burst, ids)
			for i, r := range res {
				require.Equal(t, StoreWrite, r.Outcome, "key %d", i)
			}
			st = c.Stats()
			require.Equal(t, uint64(2*n), st.StoreKeys)
			require.Equal(t, uint64(2*n), st.StoreAllocated)
			require.Zero(t, st.StoreRefusedFull)
			require.Equal(t, uint64(2*n), st.Stored)
			require.Zero(t, c.Lookup(old[:1]))
			if tc.name == "tinylfu" {
				// Ristretto still counts the inline victims and evicts or
				// rejects on its own goroutine: at least n went.
				require.GreaterOrEqual(t, st.Evicted+st.Rejected, uint64(n))
			} else {
				require.Equal(t, uint64(n), st.Evicted+st.Rejected)
				require.Equal(t, n, c.Lookup(burst))
			}
			require.NoError(t, c.Verify())
		})
	}
}

// TestStoreKeepsOwnChain: making room for a chain never evicts the chain's
// own present blocks (nor its parent); with nothing else to evict the rest
// of the chain is refused. TinyLFU is left out: ristretto's own advice,
// decided on its goroutine, may evict any ready block at any time.
func TestStoreKeepsOwnChain(t *testing.T) {
	for _, tc := range []struct {
		name   string
		policy func(t *testing.T) Policy
	}{
		{"lru", func(*testing.T) Policy { return newLRU() }},
		{"random", func(*testing.T) Policy { return newRandom(3) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCache(t, 4, Config{Policy: tc.policy(t)})
			ks, ids := keysN(0, 6)
			store(t, c, ks[:3], ids[:3])   // the chain's first three blocks
			store(t, c, ks[5:6], ids[5:6]) // one unrelated block
			c.syncPolicy()

			// Storing ks[3:5] under parent ks[2]: one slot can be made (the
			// unrelated block), not two, since ks[0..2] are the chain itself.
			res, err := c.BeginStore(StoreRequest{Parent: ks[2], Keys: ks[3:5], BlockIDs: ids[3:5]}, nil)
			require.NoError(t, err)
			require.Equal(t, StoreWrite, res[0].Outcome)
			require.Equal(t, StoreRefusedFull, res[1].Outcome)
			require.NoError(t, c.CompleteStore([]Slot{res[0].Slot}, nil))
			require.Equal(t, 4, c.Lookup(ks))

			// A store naming the whole chain (present keys included) keeps
			// every present one too.
			res, err = c.BeginStore(StoreRequest{Keys: ks[:5], BlockIDs: ids[:5]}, nil)
			require.NoError(t, err)
			want := []StoreOutcome{StorePresent, StorePresent, StorePresent, StorePresent, StoreRefusedFull}
			for i, r := range res {
				require.Equal(t, want[i], r.Outcome, "key %d", i)
			}
			require.Equal(t, uint64(1), c.Stats().Evicted)
			require.NoError(t, c.Verify())
		})
	}
}
