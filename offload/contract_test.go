package offload

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudadev"
)

// storeEach stores keys from blockIDs with opts and requires every block to
// end with want.
func storeEach(t *testing.T, e *Engine, keys []Key, ids []int, opts StoreOptions, want Outcome) {
	t.Helper()
	ctx := context.Background()
	for _, id := range ids {
		fillBlock(t, e, id, byte(id+1))
	}
	op, err := e.Store(ctx, keys, ids, opts)
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	for i, oc := range mustOutcomes(op.Outcomes()) {
		require.Equal(t, want, oc, "block %d", i)
	}
	require.NoError(t, op.Release())
}

// A sequence stored over several calls keeps its chain: with
// StoreOptions.Parent, the block before a call's first key is its parent,
// so eviction takes the sequence's tail, never its middle.
func TestStoreParentKeepsChain(t *testing.T) {
	e := newTestEngine(t, Config{PoolBytes: 3 * 8192, FirstRegionBytes: 3 * 8192, Layout: smallLayout(8), Policy: PolicyLRU})
	defer e.Close()
	seq := e.Keys(make([]uint32, 16*3))
	other := testKey(99)
	storeEach(t, e, seq[:2], []int{0, 1}, StoreOptions{}, OutcomeStored)
	storeEach(t, e, seq[2:3], []int{2}, StoreOptions{Parent: seq[1]}, OutcomeStored)
	storeEach(t, e, []Key{other}, []int{3}, StoreOptions{}, OutcomeStored)
	res, err := e.Lookup(seq, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 2, res.Hits, "the tail (block 2) is evicted, not the middle")
	require.Zero(t, e.Stats().Orphans, "no block was left without its parent")
}

// The same with StoreOptions.Parents: one call holding blocks of two
// sequences, each block naming its own parent.
func TestStoreParentsMixedCall(t *testing.T) {
	e := newTestEngine(t, Config{PoolBytes: 4 * 8192, FirstRegionBytes: 4 * 8192, Layout: smallLayout(8), Policy: PolicyLRU})
	defer e.Close()
	seq := e.Keys(make([]uint32, 16*3))
	b := testKey(50)
	storeEach(t, e, seq[:2], []int{0, 1}, StoreOptions{}, OutcomeStored)
	// One call: a new sequence's first block and seq's third (parent seq[1]).
	storeEach(t, e, []Key{b, seq[2]}, []int{3, 2}, StoreOptions{Parents: []Key{{}, seq[1]}}, OutcomeStored)
	// A fifth block in four slots evicts the least recently used chain
	// tail: seq[2] or b, never seq[1] (the middle of seq).
	storeEach(t, e, []Key{testKey(77)}, []int{4}, StoreOptions{}, OutcomeStored)
	res, err := e.Lookup(seq, LookupOptions{})
	require.NoError(t, err)
	require.GreaterOrEqual(t, res.Hits, 2, "the middle of seq is never evicted")
	require.Zero(t, e.Stats().Orphans)
}

// A Parents entry refused in the same call refuses its children: without
// their parent no lookup could reach them.
func TestStoreParentsRefusedParentRefusesChild(t *testing.T) {
	e := newTestEngine(t, Config{PoolBytes: 2 * 8192, FirstRegionBytes: 2 * 8192, Layout: smallLayout(8), Policy: PolicyLRU})
	defer e.Close()
	a, b, c := testKey(1), testKey(2), testKey(3)
	// Three blocks, two slots: a and b fit; c (child of b, given in a
	// separate run of the call) must not orphan anything.
	ctx := context.Background()
	op, err := e.Store(ctx, []Key{a, b, c}, []int{0, 1, 2}, StoreOptions{Parents: []Key{{}, {}, b}})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	out := mustOutcomes(op.Outcomes())
	require.NoError(t, op.Release())
	stored := 0
	for _, oc := range out {
		if oc == OutcomeStored {
			stored++
		}
	}
	require.Equal(t, 2, stored, "two slots: two blocks stored (%v)", out)
	require.Zero(t, e.Stats().Orphans)
}

func TestStoreParentOptionsInvalid(t *testing.T) {
	e := newTestEngine(t, Config{PoolBytes: 3 * 8192, Layout: smallLayout(8)})
	defer e.Close()
	ctx := context.Background()
	_, err := e.Store(ctx, []Key{testKey(1), testKey(2)}, []int{0, 1}, StoreOptions{Parents: []Key{{}}})
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, "1 parents for 2 keys")
	_, err = e.Store(ctx, []Key{testKey(1)}, []int{0}, StoreOptions{Parents: []Key{{}}, Parent: testKey(5)})
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = e.Store(ctx, []Key{testKey(1), testKey(1)}, []int{0, 1}, StoreOptions{Parents: []Key{{}, {}}})
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = e.Store(ctx, []Key{testKey(1)}, []int{0}, StoreOptions{Parents: []Key{testKey(1)}})
	require.ErrorIs(t, err, ErrInvalidArgument, "a key that is its own parent")
}

// Interleaved K/V ([num_blocks, 2, ...] per layer: V right after K in each
// block, stride two segments) stores and loads every block, the last one
// included: the K and V extents overlap and the engine must know their
// union, not refuse V's.
func TestInterleavedKVLastBlock(t *testing.T) {
	sim, err := cudadev.NewSim(cudadev.SimConfig{})
	require.NoError(t, err)
	defer sim.Close()
	const blocks = 8
	l := smallLayout(blocks)
	seg := uint64(l.KVHeads * l.HeadDim * l.DTypeBytes * l.TokensPerBlock)
	for range l.Layers {
		base, err := sim.MemAlloc(2 * seg * blocks)
		require.NoError(t, err)
		l.LayerTensors = append(l.LayerTensors, LayerTensors{K: base, V: base + seg, Stride: 2 * seg})
	}
	e := newEngineOn(t, Config{PoolBytes: 64 << 10, Layout: l}, sim)
	defer e.Close()
	ctx := context.Background()
	keys := []Key{testKey(1), testKey(2)}
	storeEach(t, e, keys, []int{blocks - 1, 0}, StoreOptions{}, OutcomeStored)
	want := [][]byte{blockBytes(e, blocks-1), blockBytes(e, 0)}
	require.NotEqual(t, want[0], want[1])
	for _, id := range []int{blocks - 1, 0} {
		fillBlock(t, e, id, 0xEE)
	}
	op, err := e.Load(ctx, keys, []int{0, blocks - 1}, LoadOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	require.Equal(t, []Outcome{OutcomeLoaded, OutcomeLoaded}, mustOutcomes(op.Outcomes()))
	require.NoError(t, op.Release())
	require.Equal(t, want[0], blockBytes(e, 0))
	require.Equal(t, want[1], blockBytes(e, blocks-1))
}

// Backend "auto" with device addresses in the layout and no usable driver
// is an error from New naming the reason, not a host engine whose first
// Store fails as device-lost.
func TestAutoBackendWithoutDriverRefusesDeviceLayout(t *testing.T) {
	noDriver := func() (cuda.Driver, error) {
		return nil, fmt.Errorf("%w: libcuda.so.1: cannot open shared object file", cuda.ErrNoDriver)
	}
	l := smallLayout(4)
	for range l.Layers {
		l.LayerTensors = append(l.LayerTensors, LayerTensors{K: 0x7f0000000000, V: 0x7f0000100000, Stride: 2048})
	}
	_, err := newEngine(Config{PoolBytes: 64 << 10, Layout: l, SkipMemoryCheck: true}, engineHooks{loadDriver: loader(noDriver)})
	require.ErrorIs(t, err, ErrNoDriver)
	require.ErrorContains(t, err, "libcuda.so.1: cannot open shared object file")
	require.ErrorContains(t, err, "device addresses")

	// Without device addresses, auto picks the host backend, as before.
	e, err := newEngine(Config{PoolBytes: 64 << 10, Layout: smallLayout(4), SkipMemoryCheck: true}, engineHooks{loadDriver: loader(noDriver)})
	require.NoError(t, err)
	name, reason := e.Backend()
	require.Equal(t, BackendHost, name)
	require.Contains(t, reason, "CUDA unavailable")
	require.NoError(t, e.Close())
}
