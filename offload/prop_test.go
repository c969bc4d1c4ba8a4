package offload

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/kvoffload/kvoffload/transfer"
)

// TestEngineProperties runs random sequences of stores, loads (with and
// without leases), lookups, lease holds and releases, deletes and Trims on
// the host backend and checks after every step: every op's blocks have
// exactly one final outcome, loads are byte-exact, leased keys are never
// missing, owned bytes equal the slots of the live regions, in-use bytes
// never exceed what is mapped, and the outcome counters equal the
// outcomes the ops reported.
func TestEngineProperties(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		slot := int64(8 << 10)
		e := newTestEngine(t, Config{PoolBytes: 24 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
			Layout: smallLayout(8), Policy: PolicyLRU, StagingBytes: -1})
		defer func() { require.NoError(t, e.Close()) }()
		require.NoError(t, e.WaitGrown(context.Background()))
		ctx := context.Background()
		var ta tally
		var leases []*Lease
		var leasedKeys = map[Key]int{}
		pickKeys := func(label string) []Key {
			idx := rapid.SliceOfNDistinct(rapid.IntRange(0, 11), 1, 4, rapid.ID[int]).Draw(rt, label)
			keys := make([]Key, len(idx))
			for i, k := range idx {
				keys[i] = testKey(k)
			}
			return keys
		}
		finish := func(op *Op) []Outcome {
			require.NoError(rt, op.Wait(ctx))
			out, err := op.Outcomes()
			require.NoError(rt, err)
			for _, oc := range out {
				require.NotEqual(rt, OutcomePending, oc)
			}
			ta.add(op, out)
			require.NoError(rt, op.Release())
			return out
		}
		load := func(keys []Key, lease *Lease) {
			ids := []int{4, 5, 6, 7}[:len(keys)]
			for _, id := range ids {
				writeBlock(rt, e, id, make([]byte, slot))
			}
			op, err := e.Load(ctx, keys, ids, LoadOptions{Lease: lease})
			require.NoError(rt, err)
			out := finish(op)
			for i, oc := range out {
				if leasedKeys[keys[i]] > 0 || (lease != nil && i < len(lease.keys)) {
					require.Equal(rt, OutcomeLoaded, oc, "leased key %v", keys[i])
				}
				if oc == OutcomeLoaded {
					require.Equal(rt, keyContent(keys[i], slot), blockBytes(e, ids[i]))
					ta.loaded++
				}
			}
		}
		rt.Repeat(map[string]func(*rapid.T){
			"store": func(rt *rapid.T) {
				keys := pickKeys("store keys")
				ids := []int{0, 1, 2, 3}[:len(keys)]
				for i, k := range keys {
					writeBlock(rt, e, ids[i], keyContent(k, slot))
				}
				op, err := e.Store(ctx, keys, ids, StoreOptions{})
				require.NoError(rt, err)
				finish(op)
			},
			"load": func(rt *rapid.T) { load(pickKeys("load keys"), nil) },
			"lookup and load with the lease": func(rt *rapid.T) {
				keys := pickKeys("lease-load keys")
				res, err := e.Lookup(keys, LookupOptions{Lease: true})
				require.NoError(rt, err)
				load(keys, res.Lease)
			},
			"hold a lease": func(rt *rapid.T) {
				keys := pickKeys("held keys")
				res, err := e.Lookup(keys, LookupOptions{Lease: true})
				require.NoError(rt, err)
				if res.Lease != nil {
					leases = append(leases, res.Lease)
					for _, k := range res.Lease.keys {
						leasedKeys[k]++
					}
				}
			},
			"release a lease": func(rt *rapid.T) {
				if len(leases) == 0 {
					rt.Skip("no lease")
				}
				i := rapid.IntRange(0, len(leases)-1).Draw(rt, "lease")
				l := leases[i]
				leases = append(leases[:i], leases[i+1:]...)
				for _, k := range l.keys {
					leasedKeys[k]--
				}
				require.NoError(rt, l.Release())
			},
			"delete": func(rt *rapid.T) {
				keys := pickKeys("delete keys")
				_, err := e.Delete(keys)
				require.NoError(rt, err)
				for _, k := range keys {
					if leasedKeys[k] > 0 {
						res, err := e.Lookup([]Key{k}, LookupOptions{})
						require.NoError(rt, err)
						require.Zero(rt, res.Hits, "a deleted key is invisible even while leased")
						delete(leasedKeys, k)
					}
				}
			},
			"trim": func(rt *rapid.T) {
				if e.Stats().Pool.Regions <= 1 {
					rt.Skip("keep one region")
				}
				res, err := e.Trim(ctx, 1)
				require.NoError(rt, err)
				require.Equal(rt, 1, res.Regions)
				require.Equal(rt, 8*slot, res.FreedBytes+res.PendingBytes)
				if len(leases) == 0 {
					require.Equal(rt, 8*slot, res.FreedBytes, "nothing leased, nothing in flight: freed at once")
				}
				// Trimmed blocks are gone even if leased: the lease only keeps
				// the slot alive until it is released.
				for k := range leasedKeys {
					if n, _ := e.Lookup([]Key{k}, LookupOptions{}); n.Hits == 0 {
						delete(leasedKeys, k)
					}
				}
			},
		})
		for _, l := range leases {
			require.NoError(rt, l.Release())
		}
		st := e.Stats()
		require.Equal(rt, st.Pool.OwnedBytes, st.Pool.SlotsTotal*slot)
		require.LessOrEqual(rt, st.Pool.InUseBytes, int64(24)*slot)
		require.Equal(rt, ta.outcomes, st.Outcomes)
		require.Equal(rt, ta.ops[transfer.Store], st.Copies.Store.Ops)
		require.Equal(rt, ta.ops[transfer.Load], st.Copies.Load.Ops)
		require.Equal(rt, ta.outcomes[OutcomeLoaded], ta.loaded)
	})
}
