package benchgpu

import (
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
)

func TestMeasureKernelVariantsFake(t *testing.T) {
	drv := cudafake.New(cudafake.Options{})
	defer func() { require.NoError(t, drv.Close()) }()
	variants := []KernelVariant{
		{Threads: 1024, CTAs: 8, HighPriority: true, CopyKernel: cudacopy.DefaultCopyKernel},
		{Threads: 256, CTAs: 32, CopyKernel: cudacopy.DefaultCopyKernel},
		{Threads: 256, CTAs: 32, CopyKernel: cudacopy.StreamingCopyKernel},
		{Threads: 256, CTAs: 1000, CopyKernel: cudacopy.DefaultCopyKernel},
	}
	res, err := MeasureKernelVariants(drv, 0, KernelSweepConfig{TotalBytes: 256 << 10, Reps: 1, Variants: variants})
	require.NoError(t, err)
	require.True(t, drv.Live().IsZero(), "leaked: %+v", drv.Live())
	require.Len(t, res.Rows, 4)
	for _, i := range []int{0, 1} {
		require.Empty(t, res.Rows[i].Skipped)
		require.Len(t, res.Rows[i].Solo, 4)
		for k, v := range res.Rows[i].Solo {
			require.Positive(t, v, k)
		}
	}
	require.Contains(t, res.Rows[2].Skipped, cudacopy.StreamingCopyKernel)
	require.Contains(t, res.Rows[3].Skipped, "CTAs 1000")
	require.Positive(t, res.Link["d2h"])
	md := FormatKernelSweep(res)
	require.Contains(t, md, "| kernel | CTAs×threads | warps | priority | d2h 4 KiB | h2d 4 KiB | d2h 64 KiB | h2d 64 KiB |")
	require.Contains(t, md, "| kvo_copy | 8×1024 | 256 | high |")
	require.Contains(t, md, "| kvo_copy_cs | 32×256 | 256 | normal | skipped: ")
	require.Contains(t, md, "Pick: kvo_copy")
	t.Log("\n" + md)

	// The fence sweep's shape: both directions and every size beside sgemm.
	fence := []KernelVariant{{Threads: 256, CTAs: 4, HighPriority: true, CopyKernel: cudacopy.SysFenceCopyKernel, FenceBytes: 2 * cudacopy.FenceUnit, PaceGBps: 40}}
	res, err = MeasureKernelVariants(drv, 0, KernelSweepConfig{TotalBytes: 256 << 10, Reps: 1, Variants: fence, Dirs: []string{"d2h", "h2d", "both"}, BesideAll: true})
	require.NoError(t, err)
	require.True(t, drv.Live().IsZero(), "leaked: %+v", drv.Live())
	require.Empty(t, res.Rows[0].Skipped)
	require.Len(t, res.Rows[0].Solo, 6)
	require.Equal(t, []uint64{4 << 10, 64 << 10}, res.BesideSizes)
	md = FormatKernelSweep(res)
	require.Contains(t, md, "| d2h 4 KiB | h2d 4 KiB | both 4 KiB | d2h 64 KiB | h2d 64 KiB | both 64 KiB |")
	require.Contains(t, md, "| kvo_copy_sys/8 KiB @40 GB/s | 4×256 | 32 | high |")

	// The batch sweep: DMA sides fanned over several streams, mixed sides.
	res, err = MeasureKernelVariants(drv, 0, KernelSweepConfig{TotalBytes: 256 << 10, Reps: 1, Variants: BatchKernelVariants(), Dirs: []string{"d2h", "h2d", "both"}})
	require.NoError(t, err)
	require.True(t, drv.Live().IsZero(), "leaked: %+v", drv.Live())
	require.Len(t, res.Rows, len(BatchKernelVariants()))
	for _, row := range res.Rows {
		require.Empty(t, row.Skipped, "%s", row.Variant)
		require.Len(t, row.Solo, 6)
	}
	md = FormatKernelSweep(res)
	require.Contains(t, md, "| batch ×4 streams | – | – | high |")
	require.Contains(t, md, "| kvo_copy_sys/4 KiB · h2d batch ×4 streams | 4×512 |")
	require.Contains(t, md, "| batch ×4 streams · h2d kernel | – | – | high |")
	// The bidirectional sweep: the H2D side on its own grid, and each
	// direction's rate within a run of both at once, each at least half the
	// total (its bytes over its own end, which is at most the run's end).
	res, err = MeasureKernelVariants(drv, 0, KernelSweepConfig{TotalBytes: 256 << 10, Reps: 1, Variants: BidirKernelVariants(), Dirs: []string{"h2d", "both"}, SegSizes: []uint64{4 << 10}})
	require.NoError(t, err)
	require.True(t, drv.Live().IsZero(), "leaked: %+v", drv.Live())
	for _, row := range res.Rows {
		require.Empty(t, row.Skipped, "%s", row.Variant)
		sides, total := row.BothSides["both/4096"], row.Solo["both/4096"]
		require.Positive(t, total)
		for _, side := range sides {
			require.GreaterOrEqual(t, side, total/2*(1-1e-9), "%s: %v of %v", row.Variant, sides, total)
		}
		require.NotContains(t, row.BothSides, "h2d/4096")
	}
	md = FormatKernelSweep(res)
	require.Contains(t, md, "| kvo_copy_probe/4 KiB · h2d kernel 8×1024 | 8×192 | 48 | high |")
	require.Contains(t, md, "| kvo_copy · h2d kernel 8×1024 | 8×1024 | 256 | high |")
	require.Regexp(t, `\| [0-9.]+ \(\d+%\) \(d2h [0-9.]+ · h2d [0-9.]+\) \|`, md)
	// An H2D grid without the H2D kernel is refused; one field alone takes
	// the other from the default launch.
	res, err = MeasureKernelVariants(drv, 0, KernelSweepConfig{TotalBytes: 256 << 10, Reps: 1, Dirs: []string{"h2d"}, SegSizes: []uint64{4 << 10}, Variants: []KernelVariant{
		{Threads: 192, CTAs: 8, HighPriority: true, CopyKernel: cudacopy.ProbeCopyKernel, H2DMethod: cudacopy.MethodBatch, H2DCTAs: 8},
		{Threads: 192, CTAs: 8, HighPriority: true, CopyKernel: cudacopy.ProbeCopyKernel, H2DMethod: cudacopy.MethodKernel, H2DCTAs: 8},
	}})
	require.NoError(t, err)
	require.True(t, drv.Live().IsZero(), "leaked: %+v", drv.Live())
	require.Contains(t, res.Rows[0].Skipped, "H2DCTAs 8 and H2DThreads 0 need H2DMethod kernel")
	require.Empty(t, res.Rows[1].Skipped)
	require.Contains(t, FormatKernelSweep(res), "| kvo_copy_probe · h2d kernel 8×512 | 8×192 |")
	// A fan needs the greatest priority: skipped before any copier exists.
	res, err = MeasureKernelVariants(drv, 0, KernelSweepConfig{TotalBytes: 256 << 10, Reps: 1, Variants: []KernelVariant{{Method: cudacopy.MethodBatch, Streams: 2}}})
	require.NoError(t, err)
	require.True(t, drv.Live().IsZero(), "leaked: %+v", drv.Live())
	require.Equal(t, "Streams needs HighPriority", res.Rows[0].Skipped)
	_, err = MeasureKernelVariants(drv, 0, KernelSweepConfig{TotalBytes: 256 << 10, Reps: 1, Variants: fence, Dirs: []string{"up"}})
	require.ErrorContains(t, err, `"up"`)
}

func TestKernelSweepPick(t *testing.T) {
	v := func(threads, ctas int) KernelVariant {
		return KernelVariant{Threads: threads, CTAs: ctas, CopyKernel: cudacopy.DefaultCopyKernel, HighPriority: true}
	}
	r := KernelSweepResults{
		Link:     map[string]float64{"d2h": 55, "h2d": 55},
		SGEMM:    SGEMMInfo{N: 2048, SoloMs: 1, TFLOPS: 17},
		SegSizes: []uint64{4096},
		Rows: []KernelVariantResult{
			{Variant: v(1024, 8), Solo: map[string]float64{"d2h/4096": 52, "h2d/4096": 51}, Beside: map[string]float64{"d2h/4096": 50, "h2d/4096": 50}, SlowPct: map[string]float64{"d2h/4096": 300, "h2d/4096": 40}},
			{Variant: v(256, 16), Gated: true, Solo: map[string]float64{"d2h/4096": 50, "h2d/4096": 45}, Pipelined: map[string]float64{"d2h/4096": 40, "h2d/4096": 38}, SubmitNsPerSeg: map[string]float64{"d2h/4096": 21, "h2d/4096": 22}, Beside: map[string]float64{"d2h/4096": 49, "h2d/4096": 44}, SlowPct: map[string]float64{"d2h/4096": 8, "h2d/4096": 9}},
			{Variant: v(128, 16), Solo: map[string]float64{"d2h/4096": 40, "h2d/4096": 30}, Beside: map[string]float64{"d2h/4096": 40, "h2d/4096": 30}, SlowPct: map[string]float64{"d2h/4096": 2, "h2d/4096": 1}},
			{Variant: v(64, 4), Skipped: "absent"},
		},
	}
	best, ok := r.Pick()
	require.True(t, ok)
	require.Equal(t, v(256, 16), best.Variant)
	md := FormatKernelSweep(r)
	require.Contains(t, md, "| kvo_copy | 16×256 | 128 | high | 50.0 (91%) | 45.0 (82%) | 40.0 · 21 | 38.0 · 22 | 49.0 | +8.0% | 44.0 | +9.0% |")
	require.Contains(t, md, "Pick: kvo_copy 16×256 high")

	r.Rows[1].SlowPct["h2d/4096"], r.Rows[2].SlowPct["d2h/4096"] = 11, 12
	best, ok = r.Pick()
	require.False(t, ok)
	require.Equal(t, v(256, 16), best.Variant, "least worst slowdown")
	require.Contains(t, FormatKernelSweep(r), "No variant kept the sgemm slowdown ≤ 10%; least slowdown: kvo_copy 16×256 high.")
}

// TestKernelVariants (KVO_BENCH_VARIANTS=1) sweeps the copy kernel's
// launch shape, priority and kernel on the GPU and prints one table; the
// PTX comes from KVO_PTX_FILE when set. KVO_BENCH_BURN_N overrides the
// matrix size (default 2048), KVO_BENCH_TOTAL_MIB the bytes per direction
// per run (default 256). KVO_BENCH_VARIANTS=fence sweeps
// FenceKernelVariants instead, at 4, 16 and 64 KiB, each direction and both
// at once, every size beside the matrix product; KVO_BENCH_VARIANTS=batch
// sweeps BatchKernelVariants the same way, =probe ProbeKernelVariants and
// =probegrid ProbeGridVariants (D2H and both at once), =bidir
// BidirKernelVariants (each direction and both at once, 4 and 16 KiB).
func TestKernelVariants(t *testing.T) {
	cfg := KernelSweepConfig{}
	all, stores := []string{"d2h", "h2d", "both"}, []string{"d2h", "both"}
	small, upTo64K := []uint64{4 << 10, 16 << 10}, []uint64{4 << 10, 16 << 10, 64 << 10}
	sweeps := map[string]struct {
		variants func() []KernelVariant
		dirs     []string
		sizes    []uint64
	}{
		"fence":     {FenceKernelVariants, all, upTo64K},
		"probe":     {ProbeKernelVariants, stores, upTo64K},
		"probegrid": {ProbeGridVariants, stores, upTo64K},
		"batch":     {BatchKernelVariants, all, upTo64K},
		"bidir":     {BidirKernelVariants, all, small},
	}
	name := os.Getenv("KVO_BENCH_VARIANTS")
	if sw, ok := sweeps[name]; ok {
		cfg.Variants, cfg.Dirs, cfg.BesideAll, cfg.SegSizes = sw.variants(), sw.dirs, true, sw.sizes
	} else if name != "1" {
		t.Skip("set KVO_BENCH_VARIANTS=1 (or fence, batch, probe, probegrid, bidir) to run the copy-kernel variant sweep")
	}
	g := cudatest.Open(t)
	if p := os.Getenv("KVO_PTX_FILE"); p != "" {
		img, err := os.ReadFile(p)
		require.NoError(t, err, "KVO_PTX_FILE")
		cfg.PTX = img
	}
	if v := os.Getenv("KVO_BENCH_BURN_N"); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err, "KVO_BENCH_BURN_N")
		cfg.BurnN = n
	}
	if v := os.Getenv("KVO_BENCH_TOTAL_MIB"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, "KVO_BENCH_TOTAL_MIB")
		cfg.TotalBytes = n << 20
	}
	res, err := MeasureKernelVariants(g.Drv, g.Dev, cfg)
	require.NoError(t, err)
	writeBenchOut(t, "kernel_variants", FormatKernelSweep(res), res)
}
