package offload

import (
	"bytes"
	"context"
	"math/rand/v2"
	"testing"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func newTestEngine(t *testing.T, cfg Config) *Engine {
	t.Helper()
	cfg.Backend = BackendHost
	cfg.SkipMemoryCheck = true
	e, err := newEngine(cfg, engineHooks{})
	require.NoError(t, err)
	return e
}

func blockBytes(e *Engine, id int) []byte {
	b := make([]byte, e.slot)
	segs, _ := e.layout.Segments(id, nil)
	for _, s := range segs {
		_ = e.sim.Read(s.Dev, b[s.Off:s.Off+s.Len])
	}
	return b
}

func fillBlock(t *testing.T, e *Engine, id int, seed byte) []byte {
	segs, err := e.layout.Segments(id, nil)
	require.NoError(t, err)
	out := make([]byte, e.slot)
	for _, s := range segs {
		p := bytes.Repeat([]byte{seed + byte(s.Off/2048)}, int(s.Len))
		require.NoError(t, e.sim.Write(s.Dev, p))
		copy(out[s.Off:], p)
	}
	return out
}

func TestStoreLoadRoundTrip(t *testing.T) {
	defer goleak.VerifyNone(t)
	e := newTestEngine(t, Config{PoolBytes: 64 << 10, Layout: smallLayout(8), Policy: PolicyLRU})
	ctx := context.Background()
	keys := e.Keys(make([]uint32, 16*2))
	want0 := fillBlock(t, e, 0, 1)
	want1 := fillBlock(t, e, 1, 7)
	op, err := e.Store(ctx, keys, []int{0, 1}, StoreOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	out, err := op.Outcomes()
	require.NoError(t, err)
	require.Equal(t, []Outcome{OutcomeStored, OutcomeStored}, out)
	require.NoError(t, op.Release())
	require.ErrorIs(t, op.Release(), ErrReleased)

	res, err := e.Lookup(keys, LookupOptions{Lease: true})
	require.NoError(t, err)
	require.Equal(t, 2, res.Hits)
	op, err = e.Load(ctx, keys, []int{5, 6}, LoadOptions{Lease: res.Lease})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	require.Equal(t, 2, op.count(OutcomeLoaded))
	require.Equal(t, want0, blockBytes(e, 5))
	require.Equal(t, want1, blockBytes(e, 6))
	require.NoError(t, op.Release())

	st := e.Stats()
	require.Equal(t, int64(2), st.Outcome(OutcomeStored))
	require.Equal(t, int64(2), st.Outcome(OutcomeLoaded))

	_, err = e.Store(ctx, keys, []int{0}, StoreOptions{})
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = e.Store(ctx, keys[:1], []int{8}, StoreOptions{})
	require.ErrorIs(t, err, ErrInvalidArgument)

	require.NoError(t, e.Close())
	_, err = e.Lookup(keys, LookupOptions{})
	require.ErrorIs(t, err, ErrClosed)
	require.ErrorIs(t, e.Close(), ErrClosed)
}

// newEngineOn is newTestEngine over the simulated device sim (which the
// test owns and closes), as hostsim.NewEngine builds it.
func newEngineOn(t *testing.T, cfg Config, sim *cudadev.Sim) *Engine {
	t.Helper()
	cfg.Backend = BackendHost
	cfg.SkipMemoryCheck = true
	e, err := newEngine(cfg, engineHooks{sim: sim})
	require.NoError(t, err)
	return e
}

// TestCheckBlocksReusesItsSet: duplicate and out-of-range block ids are
// refused naming the index, and a refused call leaves nothing marked: the
// same ids are accepted by the next call (the pooled bit set is cleared).
func TestCheckBlocksReusesItsSet(t *testing.T) {
	e := newTestEngine(t, Config{PoolBytes: 1 << 20, Layout: LayoutSpec{Kind: LayoutLayerSeparate, Layers: 1, KVHeads: 1,
		HeadDim: 8, DTypeBytes: 2, TokensPerBlock: 4, NumBlocks: 200}})
	defer func() { require.NoError(t, e.Close()) }()
	keys := make([]Key, 4)
	for range 3 {
		err := e.checkBlocks("Load", keys, []int{5, 70, 199, 70})
		require.ErrorIs(t, err, ErrInvalidArgument)
		require.ErrorContains(t, err, "block id 70 appears twice (index 3)")
		err = e.checkBlocks("Load", keys, []int{5, 70, 199, 200})
		require.ErrorContains(t, err, "block id 200 (index 3) outside the layout's 200 blocks")
		require.NoError(t, e.checkBlocks("Load", keys, []int{70, 199, 5, 64}))
		require.NoError(t, e.checkBlocks("Load", keys, []int{63, 64, 0, 127}))
	}
}

func BenchmarkCheckBlocks2048(b *testing.B) {
	e, err := newEngine(Config{Backend: BackendHost, SkipMemoryCheck: true, PoolBytes: 1 << 20, Layout: LayoutSpec{
		Kind: LayoutLayerSeparate, Layers: 1, KVHeads: 1, HeadDim: 8, DTypeBytes: 2, TokensPerBlock: 4, NumBlocks: 4096}}, engineHooks{})
	require.NoError(b, err)
	defer func() { require.NoError(b, e.Close()) }()
	keys := make([]Key, 2048)
	ids := rand.Perm(4096)[:2048]
	b.ResetTimer()
	for range b.N {
		if err := e.checkBlocks("Load", keys, ids); err != nil {
			b.Fatal(err)
		}
	}
}
