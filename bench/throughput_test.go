package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/transfer/cudacopy"
)

// throughputConfigFromEnv is the quick configuration, or the full one with
// KVO_BENCH_FULL=1. KVO_BENCH_TOTAL_MIB, KVO_BENCH_THREADS and
// KVO_BENCH_REPS override single fields; KVO_PTX_FILE names PTX to use
// instead of the embedded one.
func throughputConfigFromEnv(t *testing.T) ThroughputConfig {
	cfg := ThroughputConfig{
		TotalBytes: 64 << 20,
		SegSizes:   []uint64{4 << 10, 64 << 10, 2 << 20},
		CTAs:       []int{8},
		Reps:       3,
		BurnN:      1024,
	}
	if os.Getenv("KVO_BENCH_FULL") == "1" {
		cfg = DefaultThroughputConfig()
	}
	for env, field := range map[string]*int{"KVO_BENCH_THREADS": &cfg.Threads, "KVO_BENCH_REPS": &cfg.Reps} {
		if v := os.Getenv(env); v != "" {
			n, err := strconv.Atoi(v)
			require.NoError(t, err, env)
			*field = n
		}
	}
	if v := os.Getenv("KVO_BENCH_TOTAL_MIB"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, "KVO_BENCH_TOTAL_MIB")
		cfg.TotalBytes = n << 20
	}
	if p := os.Getenv("KVO_PTX_FILE"); p != "" {
		img, err := os.ReadFile(p)
		require.NoError(t, err, "KVO_PTX_FILE")
		cfg.PTX = img
	}
	cfg.Command = strings.Join(os.Args, " ")
	for _, k := range []string{"KVO_BENCH_FULL", "KVO_BENCH_TOTAL_MIB", "KVO_BENCH_THREADS", "KVO_BENCH_REPS", "KVO_PTX_FILE"} {
		if v := os.Getenv(k); v != "" {
			cfg.Command = k + "=" + v + " " + cfg.Command
		}
	}
	return cfg
}

// TestThroughputBench runs the transfer benchmark on the GPU and prints its
// table; with KVO_BENCH_OUT set it writes throughput.{csv,md,json} there.
func TestThroughputBench(t *testing.T) {
	g := cudatest.Open(t)
	res, err := MeasureThroughput(g.Drv, g.Dev, throughputConfigFromEnv(t))
	require.NoError(t, err)
	md := FormatThroughput(res)
	fmt.Println(md)
	if dir := os.Getenv("KVO_BENCH_OUT"); dir != "" {
		writeThroughput(t, dir, res, md)
	}
}

func writeThroughput(t *testing.T, dir string, res ThroughputResults, md string) {
	require.NoError(t, os.MkdirAll(dir, 0o755))
	var csvBuf bytes.Buffer
	require.NoError(t, WriteThroughputCSV(&csvBuf, res))
	js, err := json.MarshalIndent(res, "", "  ")
	require.NoError(t, err)
	for name, data := range map[string][]byte{"throughput.csv": csvBuf.Bytes(), "throughput.md": []byte(md), "throughput.json": js} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), data, 0o644))
	}
}

// sampleResults is a small synthetic result set for the formatting tests.
func sampleResults() ThroughputResults {
	r := ThroughputResults{
		Device:        "NVIDIA H200",
		DriverVersion: 13000,
		Config:        ThroughputConfig{TotalBytes: 64 << 20, SegSizes: []uint64{4 << 10}, Reps: 3, Threads: 1024, Command: "transfer_cudacopy.test"},
		Link:          map[string]float64{"d2h": 55, "h2d": 55, "both": 95},
		SGEMM:         SGEMMInfo{N: 1024, SoloMs: 0.5, TFLOPS: 4.3},
		Calibration:   &cudacopy.Calibration{D2H: cudacopy.GreedyD2HLaunch(), H2D: cudacopy.GreedyD2HLaunch(), TotalBytes: 32 << 20, Entries: []cudacopy.Measurement{{Dir: cudacopy.H2D, Method: cudacopy.MethodKernel, SegBytes: 4096, GBps: 51}}},
	}
	for _, dir := range []string{"d2h", "h2d", "both"} {
		link := r.Link[dir]
		r.Rows = append(r.Rows,
			ThroughputRow{Method: "contiguous", Dir: dir, SegBytes: 64 << 20, GBps: link, MedianGBps: link, PctOfLink: 100, Background: "none"},
			ThroughputRow{Method: "memcpy", Dir: dir, SegBytes: 4096, GBps: 1.4, MedianGBps: 1.3, PctOfLink: 100 * 1.4 / link, Background: "none"},
			ThroughputRow{Method: "kernel", CTAs: 8, Dir: dir, SegBytes: 4096, GBps: 0.95 * link, MedianGBps: 0.94 * link, PctOfLink: 95, Background: "none", Gated: true, PipelinedGBps: 40, SubmitNsPerSeg: 25},
			ThroughputRow{Method: "auto", CTAs: 8, Dir: dir, SegBytes: 4096, GBps: 0.94 * link, MedianGBps: 0.93 * link, PctOfLink: 94, Background: "none", Chosen: "kernel", Gated: true, PipelinedGBps: 39, SubmitNsPerSeg: 26},
			ThroughputRow{Method: "auto", CTAs: 8, Dir: dir, SegBytes: 4096, GBps: 0.85 * link, PctOfLink: 85, Background: "sgemm", PctOfSolo: 90, SGEMMSlowdownPct: 4.5, Chosen: "kernel"},
		)
	}
	return r
}

func TestFormatThroughput(t *testing.T) {
	md := FormatThroughput(sampleResults())
	for _, want := range []string{
		"# Transfer throughput: NVIDIA H200 (driver 13000)",
		"Command: `transfer_cudacopy.test`",
		"Link (contiguous, pinned): d2h 55.0 GB/s, h2d 55.0 GB/s, both 95.0 GB/s.",
		"| segment | memcpy | kernel/8 | auto |",
		"## d2h: GPU rate, gated (GB/s, % of link)",
		"| 4 KiB | 1.4 (3%)† | 52.2 (95%) | 51.7 (94%) kernel |",
		"### d2h: pipelined GB/s · CPU submit ns per segment",
		"| 4 KiB | 0.0 · 0 ns | 40.0 · 25 ns | 39.0 · 26 ns |",
		"| auto | both | 4 KiB | 80.8 | 90% | +4.5% |",
		"- d2h 4 KiB: auto 51.7 GB/s = 98.9% of best (kernel/8) [≥97%: met], 94.0% of link [≥92%: met]",
		"- beside sgemm, auto h2d 4 KiB: 90% of solo [≥80%: met], sgemm slowed 4.5% [≤10%: met]",
		"| h2d | 4 KiB | 51.0 | kernel |",
	} {
		require.Contains(t, md, want)
	}
	r := sampleResults()
	r.SGEMM.Skipped = "kvo_sgemm not in the embedded PTX"
	require.Contains(t, FormatThroughput(r), "Skipped: kvo_sgemm not in the embedded PTX")
}

func TestWriteThroughputCSV(t *testing.T) {
	var b bytes.Buffer
	require.NoError(t, WriteThroughputCSV(&b, sampleResults()))
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	require.Equal(t, "method,ctas,dir,seg_bytes,gbps,pct_of_link,median_gbps,background,pct_of_solo,sgemm_slowdown_pct,chosen,gated,pipelined_gbps,submit_ns_per_seg", lines[0])
	require.Len(t, lines, 1+15)
	require.Equal(t, "kernel,8,d2h,4096,52.25,95.00,51.70,none,0.00,0.00,,true,40.00,25.00", lines[3])
	js, err := json.Marshal(sampleResults())
	require.NoError(t, err)
	require.Contains(t, string(js), `"link_gbps":{"both":95,"d2h":55,"h2d":55}`)
}

func TestThroughputConfigValidate(t *testing.T) {
	require.NoError(t, DefaultThroughputConfig().validate())
	for _, bad := range []ThroughputConfig{
		{Reps: -1},
		{BurnN: 100},
		{TotalBytes: 1000},
		{SegSizes: []uint64{24}},
		{TotalBytes: 1 << 20, SegSizes: []uint64{768 << 10}},
	} {
		require.Error(t, bad.withDefaults().validate(), "%+v", bad)
	}
}

// The whole benchmark runs on the fake driver (tiny sizes): every method,
// direction and the results' shape. The fake has no kvo_sgemm, so the
// burn pass reports itself skipped.
func TestMeasureThroughputFake(t *testing.T) {
	drv := cudafake.New(cudafake.Options{})
	defer func() { require.NoError(t, drv.Close()) }()
	cfg := ThroughputConfig{TotalBytes: 256 << 10, SegSizes: []uint64{4 << 10, 64 << 10}, CTAs: []int{2, 4}, Reps: 1, Seed: 3}
	res, err := MeasureThroughput(drv, 0, cfg)
	require.NoError(t, err)
	require.True(t, drv.Live().IsZero(), "leaked: %+v", drv.Live())
	// 3 contiguous rows + 2 sizes x 6 variants (memcpy, batch, kernel, kernel/2, kernel/4, auto) x 3 dirs.
	require.Len(t, res.Rows, 3+2*6*3)
	for _, row := range res.Rows {
		require.Positive(t, row.GBps, "%+v", row)
		require.Equal(t, "none", row.Background)
		if row.Method != "contiguous" {
			require.Positive(t, row.PipelinedGBps, "%+v", row)
			require.Positive(t, row.SubmitNsPerSeg, "%+v", row)
		}
		if row.Method == "auto" {
			require.NotEmpty(t, row.Chosen)
		}
	}
	require.Contains(t, res.SGEMM.Skipped, "kvo_sgemm")
	require.NotNil(t, res.Calibration)
	require.Contains(t, FormatThroughput(res), "| segment | memcpy | batch | kernel | kernel/2 | kernel/4 | auto |")
	// The link is measured before and after the rows; the reference is the faster.
	for _, dir := range []string{"d2h", "h2d", "both"} {
		require.Positive(t, res.LinkBefore[dir], dir)
		require.Positive(t, res.LinkAfter[dir], dir)
		require.Equal(t, max(res.LinkBefore[dir], res.LinkAfter[dir]), res.Link[dir], dir)
	}
	require.Equal(t, LinkVerdict(res.Link, res.Rows), res.Invalid)
	for _, row := range res.Rows {
		require.InDelta(t, 100*row.GBps/res.Link[row.Dir], row.PctOfLink, 1e-9, "%+v", row)
	}
}

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

// writeBenchOut prints md and, with KVO_BENCH_OUT set, writes it and res
// (as JSON) there as name.md and name.json.
func writeBenchOut(t *testing.T, name, md string, res any) {
	t.Helper()
	fmt.Println(md)
	if dir := os.Getenv("KVO_BENCH_OUT"); dir != "" {
		js, err := json.MarshalIndent(res, "", "  ")
		require.NoError(t, err)
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, name+".md"), []byte(md), 0o644))
		require.NoError(t, os.WriteFile(filepath.Join(dir, name+".json"), js, 0o644))
	}
}

func TestMeasureBlocksFake(t *testing.T) {
	drv := cudafake.New(cudafake.Options{})
	defer func() { require.NoError(t, drv.Close()) }()
	cfg := BlocksConfig{TotalBytes: 2 << 20, SegSizes: []uint64{4 << 10, 16 << 10}, SegsPerBlock: 8, Reps: 1, BurnN: -1}
	res, err := MeasureBlocks(drv, 0, cfg)
	require.NoError(t, err)
	require.True(t, drv.Live().IsZero(), "leaked: %+v", drv.Live())
	require.Len(t, res.Rows, 2*5)
	for _, row := range res.Rows {
		require.Positive(t, row.D2HGBps, "%+v", row)
		require.Positive(t, row.H2DGBps, "%+v", row)
		require.Positive(t, row.BothGBps, "%+v", row)
		require.Equal(t, 8*row.SegBytes, row.BlockBytes)
	}
	md := FormatBlocks(res)
	require.Contains(t, md, "| 4 KiB | 32 KiB | staged |")
	require.Contains(t, md, "sgemm skipped")
	_, err = MeasureBlocks(drv, 0, BlocksConfig{TotalBytes: 1 << 20, SegSizes: []uint64{1 << 20}, BurnN: -1})
	require.ErrorContains(t, err, "at least 2 blocks")
}

// TestBlocksBench (KVO_BENCH_BLOCKS=1) measures MeasureBlocks on the GPU
// and writes blocks.md and blocks.json to KVO_BENCH_OUT.
func TestBlocksBench(t *testing.T) {
	if os.Getenv("KVO_BENCH_BLOCKS") != "1" {
		t.Skip("set KVO_BENCH_BLOCKS=1 to run the block-store benchmark")
	}
	g := cudatest.Open(t)
	res, err := MeasureBlocks(g.Drv, g.Dev, BlocksConfig{})
	require.NoError(t, err)
	writeBenchOut(t, "blocks", FormatBlocks(res), res)
}

// Both directions at once are submitted in the parts of the method the
// variant takes: kernel parts (one descriptor buffer) only where both sides
// take the kernel, MethodAuto included.
func TestEnqueueBothParts(t *testing.T) {
	drv := cudafake.New(cudafake.Options{})
	defer func() { require.NoError(t, drv.Close()) }()
	const segs = 2*dmaPart + 1
	b := &bench{drv: drv, cfg: ThroughputConfig{TotalBytes: segs * 4096, SegSizes: []uint64{4 << 10}, CTAs: []int{2}, Reps: 1}.withDefaults()}
	require.NoError(t, b.setup(0))
	defer func() { require.NoError(t, b.close()) }()
	batchEverywhere := &cudacopy.Calibration{Entries: []cudacopy.Measurement{
		{Dir: cudacopy.D2H, Method: cudacopy.MethodBatch, SegBytes: 4096, GBps: 50},
		{Dir: cudacopy.D2H, Method: cudacopy.MethodKernel, SegBytes: 4096, GBps: 10},
		{Dir: cudacopy.H2D, Method: cudacopy.MethodBatch, SegBytes: 4096, GBps: 50},
		{Dir: cudacopy.H2D, Method: cudacopy.MethodKernel, SegBytes: 4096, GBps: 10},
	}}
	ss := b.segments(4096)
	for _, tc := range []struct {
		o       cudacopy.Options
		tickets int
	}{
		{cudacopy.Options{Method: cudacopy.MethodKernel}, 2},
		{cudacopy.Options{Method: cudacopy.MethodBatch}, 6},
		{cudacopy.Options{Calibration: batchEverywhere}, 6},
	} {
		c, err := b.newCopier(0, tc.o)
		require.NoError(t, err)
		b.onClose(c.Close)
		v := &variant{name: tc.o.Method.String(), method: tc.o.Method, c: c}
		if tc.o.Calibration != nil {
			require.Equal(t, cudacopy.MethodBatch, v.methodFor(cudacopy.D2H, ss.d2h))
		}
		r, err := b.measure(func(t *[]tk) error {
			err := b.enqueueFor(v, "both", ss)(t)
			if len(*t) != tc.tickets {
				return fmt.Errorf("%d submissions, want %d", len(*t), tc.tickets)
			}
			return err
		}, 0)
		require.NoError(t, err, "%s", v.name)
		require.Positive(t, r.ms)
	}
}

// LinkVerdict: a row above MaxPctOfLink of its direction's link, or one
// whose direction has no link, makes the run invalid; the contiguous rows
// themselves are not checked.
func TestLinkVerdict(t *testing.T) {
	link := map[string]float64{"d2h": 55, "h2d": 55, "both": 95}
	row := func(dir string, gbps float64, bg string) ThroughputRow {
		return ThroughputRow{Method: "kernel", CTAs: 8, Dir: dir, SegBytes: 64 << 10, GBps: gbps, Background: bg}
	}
	for _, tc := range []struct {
		name string
		link map[string]float64
		rows []ThroughputRow
		want []string
	}{
		{"none", link, nil, nil},
		{"at the link", link, []ThroughputRow{row("d2h", 55, "none"), row("both", 95, "none")}, nil},
		{"at 102%", link, []ThroughputRow{row("h2d", 56.1, "none")}, nil},
		{"above 102%", link, []ThroughputRow{row("d2h", 50, "none"), row("h2d", 56.2, "none")},
			[]string{"kernel/8 h2d 64 KiB (none): 56.2 GB/s = 102.2% of the link (55.0 GB/s), above 102%"}},
		{"beside sgemm", link, []ThroughputRow{row("both", 110, "sgemm")},
			[]string{"kernel/8 both 64 KiB (sgemm): 110.0 GB/s = 115.8% of the link (95.0 GB/s), above 102%"}},
		{"contiguous rows are the reference", link, []ThroughputRow{{Method: "contiguous", Dir: "d2h", GBps: 60}}, nil},
		{"no link", map[string]float64{"d2h": 55}, []ThroughputRow{row("h2d", 10, "none")},
			[]string{"kernel/8 h2d 64 KiB (none): no h2d link reference"}},
		// The H200 run that motivated the check: a low reference made rows read 110-150% of it.
		{"low reference", map[string]float64{"d2h": 46.2, "h2d": 45.7, "both": 62.1},
			[]ThroughputRow{row("d2h", 51, "none"), row("h2d", 50.3, "none"), row("both", 93, "none")}, []string{
				"kernel/8 d2h 64 KiB (none): 51.0 GB/s = 110.4% of the link (46.2 GB/s), above 102%",
				"kernel/8 h2d 64 KiB (none): 50.3 GB/s = 110.1% of the link (45.7 GB/s), above 102%",
				"kernel/8 both 64 KiB (none): 93.0 GB/s = 149.8% of the link (62.1 GB/s), above 102%"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, LinkVerdict(tc.link, tc.rows))
		})
	}
}

// An invalid run says so and reports no targets.
func TestFormatThroughputInvalid(t *testing.T) {
	r := sampleResults()
	r.LinkBefore = map[string]float64{"d2h": 46.2, "h2d": 45.7, "both": 62.1}
	r.LinkAfter = r.Link
	md := FormatThroughput(r)
	require.Contains(t, md, "The best of before the rows (d2h 46.2, h2d 45.7, both 62.1) and after them (d2h 55.0, h2d 55.0, both 95.0)")
	require.NotContains(t, md, "INVALID")
	require.Contains(t, md, "[≥97%: met]")

	r.Link = r.LinkBefore
	for i := range r.Rows {
		r.Rows[i].PctOfLink = 100 * r.Rows[i].GBps / r.Link[r.Rows[i].Dir]
	}
	r.Invalid = LinkVerdict(r.Link, r.Rows)
	require.NotEmpty(t, r.Invalid)
	md = FormatThroughput(r)
	require.Contains(t, md, fmt.Sprintf("**INVALID**: %d row(s) above 102%% of the link", len(r.Invalid)))
	require.Contains(t, md, "- kernel/8 d2h 4 KiB (none): 52.2 GB/s = 113.1% of the link (46.2 GB/s), above 102%")
	require.Contains(t, md, "Not reported: the run is INVALID")
	require.NotContains(t, md, "[≥97%")
}
