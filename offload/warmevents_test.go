package offload

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
)

// TestCUDAFakeWarmStartEvents: once New has returned and the pool has
// grown, an engine's first store (gathered through staging), first load
// (scattered) and first per-layer load of 8B-class blocks create no CUDA
// event and allocate no memory: the scheduler's op and batch events
// (transfer.Config.PrewarmOpEvents) and the copier's staging events
// (cudacopy.Copier.PrewarmEvents) are made ahead, as the descriptor tables
// and staging chunks already were. Before, the first store created 36
// events on the submitting thread.
func TestCUDAFakeWarmStartEvents(t *testing.T) {
	{
		t.Run("events", func(t *testing.T) {
			drv := fakeDriver(t, cudafake.Options{DeviceMemory: 4 << 30})
			const layers, heads, hd, blocks = 32, 8, 128, 128
			seg := uint64(16 * heads * hd * 2)
			g := newGPUMem(t, drv, 2*layers*int(seg))
			defer g.close()
			l := LayoutSpec{Kind: LayoutLayerSeparate, Layers: layers, KVHeads: heads, HeadDim: hd, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: 2 * blocks}
			for range l.Layers {
				l.LayerTensors = append(l.LayerTensors, LayerTensors{K: g.alloc(seg * 2 * blocks), V: g.alloc(seg * 2 * blocks), Stride: seg})
			}
			slot := int64(seg) * 2 * layers
			e, err := newCUDAEngine(t, drv, Config{PoolBytes: slot * blocks * 2, Layout: l, Policy: PolicyLRU}, engineHooks{})
			require.NoError(t, err)
			defer func() { require.NoError(t, e.Close()) }()
			require.NoError(t, e.WaitGrown(context.Background()))
			keys, src, dst := make([]Key, blocks), make([]int, blocks), make([]int, blocks)
			for i := range keys {
				keys[i], src[i], dst[i] = testKey(i), i, blocks+i
			}
			created := func() [3]int {
				return [3]int{drv.Calls(cuda.OpEventCreate), drv.Calls(cuda.OpMemAlloc), drv.Calls(cuda.OpMemHostAlloc)}
			}
			run := func(name string, call func() (*Op, error)) {
				before := created()
				op, err := call()
				require.NoError(t, err)
				require.NoError(t, op.Wait(context.Background()))
				require.NoError(t, op.Release())
				require.Equal(t, before, created(), "%s: events, device and pinned allocations made by the first op", name)
			}
			ctx := context.Background()
			run("store", func() (*Op, error) { return e.Store(ctx, keys, src, StoreOptions{}) })
			require.Positive(t, e.Stats().Copies.Bounced, "the store was gathered through staging")
			run("load", func() (*Op, error) { return e.Load(ctx, keys, dst, LoadOptions{}) })
			run("per-layer load", func() (*Op, error) { return e.Load(ctx, keys, dst, LoadOptions{PerLayer: true}) })
		})
	}
}
