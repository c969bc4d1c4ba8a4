package benchgpu

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
)

// besideGemm on the fake, with kvo_fill's spin standing in for the matrix
// product: the products outlast the transfers and the slowdown is finite.
func TestBesideGemmFake(t *testing.T) {
	drv := cudafake.New(cudafake.Options{})
	defer func() { require.NoError(t, drv.Close()) }()
	b := &bench{drv: drv, cfg: ThroughputConfig{TotalBytes: 256 << 10, SegSizes: []uint64{4 << 10}, CTAs: []int{2}, Reps: 2}.withDefaults()}
	require.NoError(t, b.setup(0))
	mod, err := drv.ModuleLoadData([]byte("fake"))
	require.NoError(t, err)
	b.onClose(func() error { return drv.ModuleUnload(mod) })
	fn, err := drv.ModuleGetFunction(mod, cudafake.KernelFill)
	require.NoError(t, err)
	table, err := drv.MemAlloc(32)
	require.NoError(t, err)
	b.onClose(func() error { return drv.MemFree(table) })
	// No descriptors: the launch only spins (the fake sleeps 1 ms).
	g := &gemm{drv: drv, fn: fn, s: b.burn, n: 64, args: [][]byte{cuda.Arg(uint64(table)), cuda.Arg(uint32(0)), cuda.Arg(uint64(2e6))}}
	soloMs, err := g.solo(b.ev[0], b.ev[2], 2)
	require.NoError(t, err)
	require.Positive(t, soloMs)
	segs := b.segments(4 << 10)
	tm, slow, err := b.besideGemm(g, soloMs, timing{best: 1, submit: time.Millisecond}, b.enqueueFor(b.variants[0], "both", segs))
	require.NoError(t, err)
	require.Positive(t, tm.best)
	require.GreaterOrEqual(t, tm.median, tm.best)
	require.False(t, math.IsNaN(slow) || math.IsInf(slow, 0), "slowdown %v", slow)
	require.NoError(t, b.close())
	require.True(t, drv.Live().IsZero(), "leaked: %+v", drv.Live())
}
