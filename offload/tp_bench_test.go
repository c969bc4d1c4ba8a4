package offload

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
)

// BenchmarkHeadSlicedFake is BenchmarkGPUHeadSliced's store and load of a
// TP=4 rank's heads (1024 blocks, 32 layers, two 2-D segments per layer,
// K/V and block) on the fake driver with 8-element heads: the same number
// of strided segments, few bytes, so what it times is the host side of a
// head-sliced op (building, validating and encoding 131072 descriptors).
func BenchmarkHeadSlicedFake(b *testing.B) {
	drv := cudafake.New(cudafake.Options{DeviceMemory: 1 << 30})
	defer drv.Close()
	const tp, heads, layers, blocks, headDim = 4, 8, 32, 1024, 8
	g := newGPUMem(b, drv, 8)
	defer g.close()
	n := heads / tp
	seg := uint64(16 * n * headDim * 2)
	mk := func(r int) LayoutSpec {
		l := LayoutSpec{Kind: LayoutLayerSeparate, Layers: layers, KVHeads: n, ModelKVHeads: heads, HeadFirst: r * n,
			HeadDim: headDim, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: blocks, Order: OrderTokenMajor}
		for range layers {
			l.LayerTensors = append(l.LayerTensors, LayerTensors{K: g.alloc(seg * blocks), V: g.alloc(seg * blocks), Stride: seg})
		}
		return l
	}
	rankBytes := uint64(blocks) * uint64(layers) * 2 * seg
	e, err := newCUDAEngine(b, drv, Config{PoolBytes: int64(rankBytes) * tp * 5 / 4, Layout: mk(1), Policy: PolicyLRU}, engineHooks{calibrate: true})
	require.NoError(b, err)
	defer func() { require.NoError(b, e.Close()) }()
	require.NoError(b, e.WaitGrown(context.Background()))
	var others []*RankView
	for _, r := range []int{0, 2, 3} {
		v, err := e.Rank(mk(r))
		require.NoError(b, err)
		others = append(others, v)
	}
	ctx := context.Background()
	keys := make([]Key, blocks)
	ids := make([]int, blocks)
	for i := range ids {
		ids[i] = (i * 7) % blocks
	}
	var store, load time.Duration
	b.ResetTimer()
	for it := range b.N {
		for i := range keys {
			keys[i] = testKey(1_000_000 + it*blocks + i)
		}
		b.StopTimer()
		for _, v := range others {
			op, err := v.Store(ctx, keys, ids, StoreOptions{})
			require.NoError(b, err)
			require.NoError(b, op.Wait(ctx))
			require.NoError(b, op.Release())
		}
		b.StartTimer()
		t0 := time.Now()
		op, err := e.Store(ctx, keys, ids, StoreOptions{})
		require.NoError(b, err)
		require.NoError(b, op.Wait(ctx))
		store += time.Since(t0)
		require.Equal(b, blocks, op.Count(OutcomeStored))
		require.NoError(b, op.Release())
		t0 = time.Now()
		op, err = e.Load(ctx, keys, ids, LoadOptions{})
		require.NoError(b, err)
		require.NoError(b, op.Wait(ctx))
		load += time.Since(t0)
		require.Equal(b, blocks, op.Count(OutcomeLoaded))
		require.NoError(b, op.Release())
		e.Delete(keys)
	}
	b.ReportMetric(float64(store.Microseconds())/float64(b.N), "store-µs")
	b.ReportMetric(float64(load.Microseconds())/float64(b.N), "load-µs")
	b.ReportMetric(float64(store.Nanoseconds())/float64(b.N)/float64(blocks*layers*2*n), "store-ns/seg")
}
