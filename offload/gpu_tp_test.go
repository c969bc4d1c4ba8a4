package offload

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
)

// cudaTPLayout allocates, in g's device memory, the token-major KV cache of
// rank r of TP size tp of a Llama-like model (2 layers, 8 KV heads of 128
// bf16, 16 tokens per block: 256-byte rows, 4 KiB heads): per layer a K
// and a V tensor of blocks blocks of the rank's heads.
func cudaTPLayout(g *gpuMem, tp, r, blocks int) LayoutSpec {
	const heads = 8
	n := heads / tp
	l := LayoutSpec{Kind: LayoutLayerSeparate, Layers: 2, KVHeads: n, ModelKVHeads: heads, HeadFirst: r * n,
		HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: blocks, Order: OrderTokenMajor}
	seg := uint64(l.TokensPerBlock * n * l.HeadDim * l.DTypeBytes)
	for range l.Layers {
		l.LayerTensors = append(l.LayerTensors, LayerTensors{K: g.alloc(seg * uint64(blocks)), V: g.alloc(seg * uint64(blocks)), Stride: seg})
	}
	return l
}

// devWrite and devRead copy between device memory and the host through
// g's bounce buffer.
func (g *gpuMem) devWrite(addr uint64, b []byte) {
	copy(g.buf, b)
	require.NoError(g.t, g.drv.Memcpy(cuda.DevicePtr(addr), cuda.DevicePtr(uintptr(g.bounce)), uint64(len(b))))
}

func (g *gpuMem) devRead(addr uint64, n int) []byte {
	require.NoError(g.t, g.drv.Memcpy(cuda.DevicePtr(uintptr(g.bounce)), cuda.DevicePtr(addr), uint64(n)))
	return append([]byte(nil), g.buf[:n]...)
}

// cudaTPSizeSharing runs a head-sliced store and load on a CUDA driver:
// the two ranks of TP=2 (an engine and a Rank view, each with its own
// token-major tensors) store their heads of the same blocks; TP=1, TP=2
// (per layer) and TP=4 views load them into poisoned tensors, checked
// byte-exact against the same KV laid out for each TP size, the blocks not
// loaded still poisoned.
func cudaTPSizeSharing(t *testing.T, drv cuda.Driver, h engineHooks) {
	const blocks, n = 16, 5
	g := newGPUMem(t, drv, 1<<20)
	defer g.close()
	l0 := cudaTPLayout(g, 2, 0, blocks)
	e, err := newCUDAEngine(t, drv, Config{PoolBytes: 64 << 16, FirstRegionBytes: 64 << 16, Layout: l0, Policy: PolicyLRU}, h)
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	r1, err := e.Rank(cudaTPLayout(g, 2, 1, blocks))
	require.NoError(t, err)
	write := func(l LayoutSpec, id, j int) {
		for i, b := range tpDevice(l, j) {
			g.devWrite(tpAddr(l, id, i/2, i%2), b)
		}
	}
	keys := make([]Key, n)
	for j := range keys {
		keys[j] = testKey(300 + j)
	}
	ids := [][]int{{3, 5, 0, 9, 15}, {1, 2, 7, 12, 4}}
	for r, l := range []LayoutSpec{l0, r1.layoutSpec()} {
		for j := range n {
			write(l, ids[r][j], j)
		}
	}
	oc := tpRun(t)(e.Store(context.Background(), keys, ids[0], StoreOptions{}))
	require.Equal(t, repeatOutcome(OutcomeStored, n), oc)
	oc = tpRun(t)(r1.Load(context.Background(), keys, ids[1], LoadOptions{}))
	require.Equal(t, repeatOutcome(OutcomeMissing, n), oc, "half-stored blocks are not loaded")
	oc = tpRun(t)(r1.Store(context.Background(), keys, ids[1], StoreOptions{}))
	require.Equal(t, repeatOutcome(OutcomeStored, n), oc)
	require.Equal(t, int64(n), e.Stats().StoreJoined)

	dst := []int{14, 6, 8, 10, 11}
	for _, tp := range []int{1, 2, 4} {
		for r := range tp {
			name := fmt.Sprintf("TP=%d rank %d", tp, r)
			l := cudaTPLayout(g, tp, r, blocks)
			v, err := e.Rank(l)
			require.NoError(t, err, name)
			seg := l.TokensPerBlock * l.KVHeads * l.HeadDim * l.DTypeBytes
			for _, lt := range l.LayerTensors {
				require.NoError(t, drv.MemsetD8(cuda.DevicePtr(lt.K), 0xEE, uint64(seg*blocks)))
				require.NoError(t, drv.MemsetD8(cuda.DevicePtr(lt.V), 0xEE, uint64(seg*blocks)))
			}
			oc := tpRun(t)(v.Load(context.Background(), keys, dst, LoadOptions{PerLayer: tp == 2}))
			require.Equal(t, repeatOutcome(OutcomeLoaded, n), oc, name)
			loaded := map[int]int{}
			for j, id := range dst {
				loaded[id] = j
			}
			for id := range blocks {
				j, ok := loaded[id]
				for i, want := range tpDevice(l, j) {
					got := g.devRead(tpAddr(l, id, i/2, i%2), seg)
					if !ok {
						want = bytes.Repeat([]byte{0xEE}, seg)
					}
					require.True(t, bytes.Equal(want, got), "%s: block %d layer %d kv %d (loaded %v)", name, id, i/2, i%2, ok)
				}
			}
		}
	}
}

// TestCUDAFakeTPSizeSharing is cudaTPSizeSharing on the fake driver, with
// each copy method (the kernel's 2-D descriptors included), and with three
// builders (the engine's Build called for several parts at once, the
// copies prepared on the builders).
func TestCUDAFakeTPSizeSharing(t *testing.T) {
	for _, c := range []struct {
		m        cudacopy.Method
		builders int
	}{{cudacopy.MethodKernel, 1}, {cudacopy.MethodAuto, 1}, {cudacopy.MethodKernel, 3}} {
		t.Run(fmt.Sprintf("%v-%d", c.m, c.builders), func(t *testing.T) {
			d := fakeDriver(t, cudafake.Options{Seed: 5, MaxDelay: 20 * time.Microsecond})
			cudaTPSizeSharing(t, d, engineHooks{copyOptions: cudacopy.Options{Method: c.m}, builders: c.builders})
		})
	}
}

// TestGPUTPSizeSharing is cudaTPSizeSharing on the GPU (the copy method
// the engine picks: token-major heads move as 2-D descriptors of the copy
// kernels). It skips without a GPU unless KVO_REQUIRE_GPU=1.
func TestGPUTPSizeSharing(t *testing.T) {
	gpu := cudatest.Open(t)
	cudaTPSizeSharing(t, gpu.Drv, engineHooks{})
}
