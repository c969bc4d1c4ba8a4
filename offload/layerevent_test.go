package offload

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// TestLayerEventHostRange: on the host backend LayerEvent is 0 only for a
// layer of a Load with PerLayer; a layer outside the layout, a Store, a
// Load without PerLayer and a cross-layer layout are ErrInvalidArgument
// naming the layer (as on CUDA), including for a 1-layer layout (where
// the transfer op's Layers() is 1 with and without per-layer events) and
// for a per-layer Load that copied nothing (every key missing).
func TestLayerEventHostRange(t *testing.T) {
	defer goleak.VerifyNone(t)
	ctx := context.Background()
	for _, c := range []struct {
		name   string
		layout LayoutSpec
	}{
		{"layer-separate, 2 layers", smallLayout(8)},
		{"layer-separate, 1 layer", LayoutSpec{Kind: LayoutLayerSeparate, Layers: 1, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: 8}},
		{"mla, 2 layers", LayoutSpec{Kind: LayoutMLA, Layers: 2, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: 8}},
		{"cross-layer", LayoutSpec{Kind: LayoutCrossLayer, Layers: 2, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: 8}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newTestEngine(t, Config{PoolBytes: 64 << 10, Layout: c.layout, Policy: PolicyLRU})
			defer func() { require.NoError(t, e.Close()) }()
			keys := []Key{testKey(1), testKey(2)}
			st, err := e.Store(ctx, keys, []int{0, 1}, StoreOptions{})
			require.NoError(t, err)
			require.NoError(t, st.Wait(ctx))
			defer func() { require.NoError(t, st.Release()) }()

			bad := func(op *Op, layer int, msg string) {
				t.Helper()
				ev, err := op.LayerEvent(layer)
				require.ErrorIs(t, err, ErrInvalidArgument, "%s op, layer %d", op.Kind(), layer)
				require.ErrorContains(t, err, msg)
				require.Zero(t, ev)
			}
			bad(st, 0, "store op has no per-layer events")
			bad(st, -1, "store op has no per-layer events")

			plain, err := e.Load(ctx, keys, []int{2, 3}, LoadOptions{})
			require.NoError(t, err)
			require.NoError(t, plain.Wait(ctx))
			defer func() { require.NoError(t, plain.Release()) }()
			bad(plain, 0, "load op has no per-layer events")

			per, err := e.Load(ctx, keys, []int{4, 5}, LoadOptions{PerLayer: true})
			require.NoError(t, err)
			require.NoError(t, per.Wait(ctx))
			defer func() { require.NoError(t, per.Release()) }()
			missing, err := e.Load(ctx, []Key{testKey(9)}, []int{6}, LoadOptions{PerLayer: true})
			require.NoError(t, err)
			require.NoError(t, missing.Wait(ctx))
			defer func() { require.NoError(t, missing.Release()) }()
			for _, op := range []*Op{per, missing} {
				if c.layout.Kind == LayoutCrossLayer {
					bad(op, 0, "load op has no per-layer events")
					continue
				}
				for l := range c.layout.Layers {
					ev, err := op.LayerEvent(l)
					require.NoError(t, err, "layer %d", l)
					require.Zero(t, ev, "no CUDA events on the host backend")
				}
				bad(op, c.layout.Layers, "outside the op's")
				bad(op, 99, "layer 99: outside the op's")
				bad(op, -1, "layer -1: outside the op's")
			}
		})
	}
}
