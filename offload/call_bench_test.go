package offload

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// callBench is the workload of the call-time benchmarks: blocks blocks of
// 2×layers segments (a layer-separate layout), stored from randomly drawn
// GPU block ids and loaded into others, as an allocator hands them out.
type callBench struct {
	layers, heads, headDim, blocks int
}

// run measures, per iteration, how long Store, Load and a per-layer Load
// take to return (the calls), and how long until each op is done, and
// reports the medians.
func (cb callBench) run(b *testing.B, drv cuda.Driver, real bool) {
	g := newGPUMem(b, drv, 8)
	defer g.close()
	seg := uint64(16 * cb.heads * cb.headDim * 2)
	numBlocks := 2 * cb.blocks
	l := LayoutSpec{Kind: LayoutLayerSeparate, Layers: cb.layers, KVHeads: cb.heads, HeadDim: cb.headDim, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: numBlocks}
	for range l.Layers {
		l.LayerTensors = append(l.LayerTensors, LayerTensors{K: g.alloc(seg * uint64(numBlocks)), V: g.alloc(seg * uint64(numBlocks)), Stride: seg})
	}
	slot := int64(seg) * int64(2*cb.layers)
	cfg := Config{PoolBytes: slot * int64(cb.blocks) * 5 / 4, Layout: l, Policy: PolicyLRU}
	var e *Engine
	var err error
	if real {
		cfg.Backend = BackendCUDA
		e, err = New(cfg)
	} else {
		e, err = newCUDAEngine(b, drv, cfg, engineHooks{})
	}
	require.NoError(b, err)
	defer func() { require.NoError(b, e.Close()) }()
	require.NoError(b, e.WaitGrown(context.Background()))
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))
	keys := make([]Key, cb.blocks)
	var calls [3][]time.Duration
	var dones [3][]time.Duration
	b.ResetTimer()
	for it := range b.N {
		for i := range keys {
			keys[i] = testKey(it*cb.blocks + i)
		}
		ids := rng.Perm(numBlocks)
		src, dst := ids[:cb.blocks], ids[cb.blocks:]
		t0 := time.Now()
		op, err := e.Store(ctx, keys, src, StoreOptions{})
		calls[0] = append(calls[0], time.Since(t0))
		require.NoError(b, err)
		require.NoError(b, op.Wait(ctx))
		dones[0] = append(dones[0], time.Since(t0))
		require.Equal(b, cb.blocks, op.Count(OutcomeStored))
		require.NoError(b, op.Release())
		for k, perLayer := range []bool{false, true} {
			t0 = time.Now()
			op, err = e.Load(ctx, keys, dst, LoadOptions{PerLayer: perLayer})
			calls[1+k] = append(calls[1+k], time.Since(t0))
			require.NoError(b, err)
			require.NoError(b, op.Wait(ctx))
			dones[1+k] = append(dones[1+k], time.Since(t0))
			require.Equal(b, cb.blocks, op.Count(OutcomeLoaded))
			require.NoError(b, op.Release())
		}
		e.Delete(keys)
	}
	b.StopTimer()
	med := func(d []time.Duration) float64 {
		s := slices.Clone(d)
		slices.Sort(s)
		return float64(s[len(s)/2].Microseconds())
	}
	for k, name := range []string{"store", "load", "load-per-layer"} {
		b.ReportMetric(med(calls[k]), name+"-call-µs")
		b.ReportMetric(med(dones[k]), name+"-done-µs")
	}
	b.ReportMetric(float64(cb.blocks*2*cb.layers), "segments/op")
}

// BenchmarkCallTimeFake: the call times on the fake driver (CPU only): 2048
// blocks of 64 segments of 256 bytes, what the calls' own work costs.
func BenchmarkCallTimeFake(b *testing.B) {
	drv := cudafake.New(cudafake.Options{DeviceMemory: 1 << 30})
	defer drv.Close()
	callBench{layers: 32, heads: 1, headDim: 4, blocks: 2048}.run(b, drv, false)
}

// BenchmarkGPUCallTime: Engine.Store and Engine.Load of 2048 blocks of an
// 8B-class model (32 layers, 8 KV heads of 128, 16-token blocks, bf16: 64
// segments of 32 KiB a block) on the GPU, at the default MaxDeviceBytes.
func BenchmarkGPUCallTime(b *testing.B) {
	gpu := cudatest.Open(b)
	callBench{layers: 32, heads: 8, headDim: 128, blocks: 2048}.run(b, gpu.Drv, true)
}
