package offload

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// The layouts below are gpuMem.layout's geometry: 2 layers, segments of
// 2048 bytes, 16 blocks.
const (
	dtSeg    = uint64(2048)
	dtBlocks = 16
)

func dtLayout(tensors ...LayerTensors) LayoutSpec {
	l := LayoutSpec{Kind: LayoutLayerSeparate, Layers: 2, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16,
		NumBlocks: dtBlocks, LayerTensors: tensors}
	if len(tensors) == 1 {
		l.Kind, l.Layers = LayoutMLA, 1
	}
	return l
}

// TestCUDADeviceTensors: New on the CUDA backend accepts a layout only when
// each tensor lies inside one device allocation, and otherwise fails with
// ErrInvalidConfig naming the tensor, leaving nothing allocated, registered
// or created (fakeDriver's cleanup checks).
func TestCUDADeviceTensors(t *testing.T) {
	full := dtSeg * dtBlocks
	cases := []struct {
		name   string
		layout func(g *gpuMem) LayoutSpec
		want   []string // error substrings; none: New succeeds
	}{
		{"layer-separate, one allocation per tensor", func(g *gpuMem) LayoutSpec { return g.layout(LayoutLayerSeparate, dtBlocks) }, nil},
		{"cross-layer", func(g *gpuMem) LayoutSpec { return g.layout(LayoutCrossLayer, dtBlocks) }, nil},
		{"all tensors in one caching-allocator segment", func(g *gpuMem) LayoutSpec {
			a := g.alloc(4*full + 4096)
			return dtLayout(LayerTensors{K: a, V: a + full, Stride: dtSeg}, LayerTensors{K: a + 2*full + 4096, V: a + 3*full + 4096, Stride: dtSeg})
		}, nil},
		{"MLA", func(g *gpuMem) LayoutSpec { return dtLayout(LayerTensors{K: g.alloc(full), Stride: dtSeg}) }, nil},
		{"V outside any allocation", func(g *gpuMem) LayoutSpec {
			return dtLayout(LayerTensors{K: g.alloc(full), V: g.alloc(full), Stride: dtSeg}, LayerTensors{K: g.alloc(full), V: 1 << 44, Stride: dtSeg})
		}, []string{"layer 1 V tensor", "[0x100000000000, 0x100000008000)", "not device memory of device 0", "CUDA_ERROR_NOT_FOUND"}},
		{"K in pinned host memory", func(g *gpuMem) LayoutSpec {
			return dtLayout(LayerTensors{K: uint64(uintptr(g.bounce)), V: g.alloc(full), Stride: dtSeg}, LayerTensors{K: g.alloc(full), V: g.alloc(full), Stride: dtSeg})
		}, []string{"layer 0 K tensor", "not device memory", "CUDA_ERROR_NOT_FOUND"}},
		{"last block past the allocation's end", func(g *gpuMem) LayoutSpec {
			return dtLayout(LayerTensors{K: g.alloc(full), V: g.alloc(full), Stride: dtSeg}, LayerTensors{K: g.alloc(full - dtSeg), V: g.alloc(full), Stride: dtSeg})
		}, []string{"layer 1 K tensor", "runs 2048 bytes past the end of its device allocation"}},
		{"stride twice the allocation's", func(g *gpuMem) LayoutSpec {
			// K sits in the upper half of a 4×full allocation, so that V's
			// span (2×full from its base) cannot reach it wherever the
			// allocator puts V: the layout's overlap check must not fire
			// before the extent check.
			k := g.alloc(4*full) + 2*full
			return dtLayout(LayerTensors{K: k, V: g.alloc(full), Stride: 2 * dtSeg}, LayerTensors{K: g.alloc(2 * full), V: g.alloc(2 * full), Stride: 2 * dtSeg})
		}, []string{"layer 0 V tensor", "runs 30720 bytes past the end"}},
		{"cross-layer base one byte in", func(g *gpuMem) LayoutSpec {
			l := g.layout(LayoutCrossLayer, dtBlocks)
			l.Base++
			return l
		}, []string{"cross-layer tensor", "runs 1 bytes past the end"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := fakeDriver(t, cudafake.Options{})
			g := newGPUMem(t, d, 8<<10)
			defer g.close()
			e, err := newCUDAEngine(t, d, Config{PoolBytes: 1 << 20, Layout: c.layout(g), Policy: PolicyLRU}, engineHooks{})
			if c.want == nil {
				require.NoError(t, err)
				require.NoError(t, e.Close())
				return
			}
			require.Nil(t, e)
			require.ErrorIs(t, err, ErrInvalidConfig)
			for _, s := range c.want {
				require.ErrorContains(t, err, s)
			}
		})
	}
}

// TestCUDADeviceTensorsDriverError: a cuMemGetAddressRange failing with
// CUDA_ERROR_INVALID_VALUE (the driver's answer for some addresses that are
// no allocation) fails New naming the tensor, with the driver's error.
func TestCUDADeviceTensorsDriverError(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	l := g.layout(LayoutLayerSeparate, dtBlocks)
	d.FailAt(cuda.OpMemGetAddressRange, d.Calls(cuda.OpMemGetAddressRange)+3, cuda.ErrorInvalidValue)
	_, err := newCUDAEngine(t, d, Config{PoolBytes: 1 << 20, Layout: l}, engineHooks{})
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, "layer 1 K tensor")
	var ce *cuda.Error
	require.ErrorAs(t, err, &ce)
	require.Equal(t, cuda.OpMemGetAddressRange, ce.Op)
}

// FuzzDeviceTensors places a one-layer tensor pair anywhere around a 64 KiB
// device allocation: checkDeviceTensors accepts it exactly when both
// extents lie inside the allocation.
func FuzzDeviceTensors(f *testing.F) {
	f.Add(uint64(0), uint64(0), uint64(4096), uint16(4))
	f.Add(uint64(0), uint64(1<<15), uint64(2048), uint16(16))
	f.Add(uint64(1<<16-2048), uint64(0), uint64(2048), uint16(1))
	f.Add(uint64(1<<16-2047), uint64(0), uint64(2048), uint16(1))
	f.Add(^uint64(0)-100, uint64(0), uint64(2048), uint16(2))
	d := cudafake.New(cudafake.Options{CheckContext: true})
	f.Cleanup(func() { require.NoError(f, d.Close()) })
	gpu, err := driverOf(d).Open(0)
	require.NoError(f, err)
	const size, seg = 1 << 16, 2048
	var base cuda.DevicePtr
	require.NoError(f, gpu.Do(func() (err error) {
		base, err = d.MemAlloc(size)
		return err
	}))
	f.Fuzz(func(t *testing.T, kOff, vOff, stride uint64, blocks uint16) {
		l := LayoutSpec{Kind: LayoutMLA, Layers: 1, KVHeads: 1, HeadDim: 512, DTypeBytes: 2, TokensPerBlock: 2,
			NumBlocks: int(blocks), LayerTensors: []LayerTensors{{K: uint64(base) + kOff, Stride: stride}}}
		cfg, _, slot, err := withDefaults(Config{PoolBytes: 1 << 30, Layout: l, Backend: BackendCUDA})
		if err != nil {
			return
		}
		e := &Engine{cfg: cfg, gpu: gpu, slot: slot}
		k := uint64(base) + kOff
		end := k + uint64(blocks-1)*stride + seg
		inside := k >= uint64(base) && end <= uint64(base)+size
		err = gpu.Do(e.checkDeviceTensors)
		if inside != (err == nil) {
			t.Fatalf("K at base+%#x, stride %d, %d blocks: inside %v, check says %v", kOff, stride, blocks, inside, err)
		}
		if err != nil && !errors.Is(err, ErrInvalidConfig) {
			t.Fatalf("%v wraps no ErrInvalidConfig", err)
		}
	})
}

// TestGPUDeviceTensors: on a real GPU, New refuses a layout at addresses
// that are no device allocation (it would otherwise crash the context at
// the first copy) and accepts one in MemAlloc'd memory.
func TestGPUDeviceTensors(t *testing.T) {
	gpu := cudatest.Open(t)
	g := newGPUMem(t, gpu.Drv, 8<<10)
	defer g.close()
	bogus := dtLayout(LayerTensors{K: 0x7f0000000000, V: 0x7f0000100000, Stride: dtSeg},
		LayerTensors{K: 0x7f0000200000, V: 0x7f0000300000, Stride: dtSeg})
	e, err := newCUDAEngine(t, gpu.Drv, Config{PoolBytes: 1 << 20, Layout: bogus}, engineHooks{})
	require.Nil(t, e)
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, "layer 0 K tensor")
	require.ErrorContains(t, err, "not device memory")
	t.Logf("bogus layout refused: %v", err)

	// V's last block ends one segment past the 2 MiB allocation (a size
	// the driver does not round).
	a := g.alloc(2 << 20)
	short := dtLayout(LayerTensors{K: g.alloc(dtSeg * dtBlocks), V: g.alloc(dtSeg * dtBlocks), Stride: dtSeg},
		LayerTensors{K: a, V: a + 2<<20 - dtSeg*(dtBlocks-1), Stride: dtSeg})
	_, err = newCUDAEngine(t, gpu.Drv, Config{PoolBytes: 1 << 20, Layout: short}, engineHooks{})
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, "layer 1 V tensor")
	t.Logf("layout past an allocation's end refused: %v", err)

	e, err = newCUDAEngine(t, gpu.Drv, Config{PoolBytes: 1 << 20, Layout: g.layout(LayoutLayerSeparate, dtBlocks)}, engineHooks{})
	require.NoError(t, err)
	storeOverwriteLoad(t, e, g, 4, 7)
	require.NoError(t, e.Close())
}
