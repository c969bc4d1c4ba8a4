package cudacopy

import (
	mrand "math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// GPU tests: they skip without a driver (fail with KVO_REQUIRE_GPU=1).
// Subtests are not used: the context is current on the test's locked thread.

// gpuOpts sets o.PTX from the file KVO_PTX_FILE names, if set: PTX built by
// `make ptx` on the GPU machine in the same call, before it is committed
// and embedded.
func gpuOpts(t *testing.T, o Options) Options {
	t.Helper()
	if p := os.Getenv("KVO_PTX_FILE"); p != "" {
		img, err := os.ReadFile(p)
		require.NoError(t, err, "KVO_PTX_FILE")
		o.PTX = img
	}
	return o
}

func TestGPUPTXLoads(t *testing.T) {
	g := cudatest.Open(t)
	c := newCopier(t, g.Drv, gpuOpts(t, Options{Method: MethodKernel}))
	caps := c.Capabilities()
	require.True(t, caps.Kernel, caps.KernelError)
	t.Logf("capabilities: %+v", caps)
}

// gpuLayouts are both layouts at every segment size from 4 KiB to 2 MiB,
// about 16 MiB each.
func gpuLayouts() []layout {
	var ls []layout
	for _, size := range DefaultSegSizes {
		ls = append(ls, crossLayer(max(4, int((16<<20)/size)), size), layerSeparate(max(2, int((16<<20)/(8*size))), 4, size))
	}
	return ls
}

func TestGPURoundTrip(t *testing.T) {
	g := cudatest.Open(t)
	s := newStream(t, g.Drv)
	methods := []Method{MethodMemcpy, MethodKernel, MethodAuto}
	if g.Drv.HasMemcpyBatch() {
		methods = append(methods, MethodBatch)
	} else {
		t.Log("driver has no cuMemcpyBatchAsync: batch method not tested")
	}
	for _, m := range methods {
		c := newCopier(t, g.Drv, gpuOpts(t, Options{Method: m, Calibrate: CalibrationConfig{TotalBytes: 8 << 20}}))
		if m == MethodAuto {
			cal, err := c.Calibrate(s)
			require.NoError(t, err)
			t.Logf("calibration:\n%s", cal.Markdown())
		}
		for i, l := range gpuLayouts() {
			roundTrip(t, g.Drv, c, s, l, uint64(i))
			if m == MethodAuto {
				h2d, d2h := l.segments(1<<20, 1<<40, 1<<41, mrand.New(mrand.NewPCG(1, 1)))
				t.Logf("auto %v: h2d %v, d2h %v", l, c.Choose(H2D, h2d), c.Choose(D2H, d2h))
			}
		}
	}
}

// The other copy kernels (kvo_copy_cs; kvo_copy_sys, fencing every 4 KiB
// and every 64 KiB) move every layout byte-exact.
func TestGPUOtherKernelsRoundTrip(t *testing.T) {
	g := cudatest.Open(t)
	s := newStream(t, g.Drv)
	for _, o := range []Options{
		{CopyKernel: StreamingCopyKernel},
		{CopyKernel: SysFenceCopyKernel, FenceBytes: FenceUnit},
		{CopyKernel: SysFenceCopyKernel, FenceBytes: 16 * FenceUnit},
		{CopyKernel: ProbeCopyKernel, FenceBytes: FenceUnit},
	} {
		o.Method = MethodKernel
		c, err := New(g.Drv, g.Dev, gpuOpts(t, o))
		require.NoError(t, err, "%s", o.CopyKernel)
		for i, l := range gpuLayouts() {
			roundTrip(t, g.Drv, c, s, l, uint64(i))
		}
		require.NoError(t, c.Close())
	}
}

// Misaligned segments through MethodAuto take a DMA method and arrive intact.
func TestGPUMisalignedAuto(t *testing.T) {
	g := cudatest.Open(t)
	s := newStream(t, g.Drv)
	c := newCopier(t, g.Drv, gpuOpts(t, Options{}))
	roundTrip(t, g.Drv, c, s, crossLayer(64, 4100), 9)
}

func TestGPUFillAndChecksum(t *testing.T) {
	g := cudatest.Open(t)
	s := newStream(t, g.Drv)
	c := newCopier(t, g.Drv, gpuOpts(t, Options{ChunkBytes: 4096, DescCapacity: 3}))
	fillAndChecksum(t, g.Drv, c, s)
}

func TestGPUCalibrate(t *testing.T) {
	g := cudatest.Open(t)
	s := newStream(t, g.Drv)
	c := newCopier(t, g.Drv, gpuOpts(t, Options{}))
	start := time.Now()
	cal, err := c.Calibrate(s)
	took := time.Since(start)
	require.NoError(t, err)
	require.NoError(t, cal.Validate())
	t.Logf("calibration in %v (D2H %v, H2D %v, pipelines of a lead and up to %d Submits of up to %s, in %s buffers):\n%s",
		took.Round(time.Millisecond), cal.D2H, cal.H2D, cal.Pieces, FormatBytes(cal.PieceBytes), FormatBytes(cal.TotalBytes), cal.Markdown())
}

// SubmitGather and SubmitScatter move layer-separate blocks byte-exact on
// the GPU, with 1 MiB chunks (runs split across chunks; one chunk reused
// throughout, and the default ring) and the default 8 MiB.
func TestGPUStagedRoundTrip(t *testing.T) {
	g := cudatest.Open(t)
	s, aux := newStream(t, g.Drv), newStream(t, g.Drv)
	for _, o := range []Options{{GatherChunkBytes: 1 << 20, GatherRing: 1}, {GatherChunkBytes: 1 << 20}, {}} {
		c := newCopier(t, g.Drv, gpuOpts(t, o))
		for i, l := range []layout{layerSeparate(64, 8, 16<<10), layerSeparate(200, 16, 4<<10), layerSeparate(9, 6, 48<<10)} {
			gatherRoundTrip(t, g.Drv, c, aux, s, l, uint64(i))
			scatterRoundTrip(t, g.Drv, c, s, aux, l, uint64(i))
		}
		require.Positive(t, c.Gathers())
	}
}

// One layer of many consecutive slots by pitched DMA (cuMemcpy2DAsync_v2
// between unified addresses) through staging, both ways, byte-exact: 200
// slots in 1 MiB chunks (16 rows each, the last chunk part full) and the
// default 8 MiB.
func TestGPUPitchedStaging(t *testing.T) {
	g := cudatest.Open(t)
	s, aux := newStream(t, g.Drv), newStream(t, g.Drv)
	for _, chunk := range []int{1 << 20, DefaultGatherChunk} {
		c := newCopier(t, g.Drv, gpuOpts(t, Options{GatherChunkBytes: chunk}))
		off := newCopier(t, g.Drv, gpuOpts(t, Options{GatherChunkBytes: chunk, GatherMinRow: -1}))
		pitchedRoundTrip(t, g.Drv, c, off, s, aux, 200, uint64(chunk))
	}
}
