package benchgpu_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/benchgpu"
	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/register"
)

const gib = 1 << 30

func TestFormatPinning(t *testing.T) {
	results := []benchgpu.PinningResult{
		{Size: gib, Cold: benchgpu.PinningRun{Map: 60 * time.Millisecond, Register: 25 * time.Millisecond, Total: 85 * time.Millisecond, GiBps: 11.8}, ColdSpeedup: 4.8, Map: 30 * time.Millisecond, Register: 25 * time.Millisecond, Total: 55 * time.Millisecond, GiBps: 18.2,
			Mapped: gib, PageSize: 4096, Ranges: 1, Threads: 16, HostAlloc: 411 * time.Millisecond, HostAllocGiBs: 2.4, Speedup: 7.5},
		{Size: 48 * gib, Cold: benchgpu.PinningRun{Map: 7000 * time.Millisecond, Register: 1180 * time.Millisecond, Total: 8180 * time.Millisecond, GiBps: 5.9}, ColdSpeedup: 2.4, Map: 1080 * time.Millisecond, Register: 1180 * time.Millisecond, Total: 2260 * time.Millisecond, GiBps: 21.2,
			Mapped: 48 * gib, PageSize: 4096, Ranges: 1, Threads: 16, HostAlloc: 19700 * time.Millisecond, HostAllocGiBs: 2.4, Speedup: 8.7},
		{Size: 5*gib + 1, Total: time.Second, GiBps: 5, Mapped: 5*gib + 4096, PageSize: 4096, Ranges: 1, Threads: 16,
			Fallback: "hugetlbfs pages unavailable"},
	}
	out := benchgpu.FormatPinning(results)
	require.Contains(t, out, "| 1 GiB | 60 ms | 25 ms | 85 ms | 11.8 | 30 ms | 25 ms | 55 ms | 18.2 | 1 | 0 | 411 ms | 2.4 | 7.5× (4.8×) |")
	require.Contains(t, out, "| 48 GiB | 7000 ms | 1180 ms | 8180 ms | 5.9 | 1080 ms | 1180 ms | 2260 ms | 21.2 | 1 | 0 | 19700 ms | 2.4 | 8.7× (2.4×) |")
	require.Contains(t, out, "| 5368709121 B | 0.00 ms | 0.00 ms | 0.00 ms | 0.0 | 0.00 ms | 0.00 ms | 1000 ms | 5.0 | 1 | 4095 | – | – | – |")
	require.Contains(t, out, "Order per size: ours (cold), cuMemHostAlloc, ours (warm)")
	require.Contains(t, out, "Ours, sequential: New = mmapmem.New (mmap, advice, THP unless disabled, prefault on 16 threads)")
	require.Contains(t, out, "| size | cold: New | Register | total | GiB/s | warm: New | Register |")
	require.Contains(t, out, "Fallback at 5368709121 B: hugetlbfs pages unavailable")
	require.Contains(t, out, "At 48 GiB, warm: 21.2 GiB/s, 8.7×, 0 bytes beyond asked: target met.")
	require.Contains(t, out, "At 48 GiB, cold: 5.9 GiB/s, 2.4×, 0 bytes beyond asked: target MISSED.")

	for i := range results {
		results[i].Chunk = 2 * gib
	}
	require.Contains(t, benchgpu.FormatPinning(results), "Ours, pipelined: New = mmapmem.New with DeferPrefault (mmap and advice, THP unless disabled, nothing touched); "+
		"Register = register.NewCUDA's Pinner.Register in 2 GiB ranges, prefaulting range k+1 on 16 threads while cuMemHostRegister_v2 (PORTABLE|DEVICEMAP) registers range k.")
	results[1].Speedup = 6.9
	require.Contains(t, benchgpu.FormatPinning(results), "At 48 GiB, warm: 21.2 GiB/s, 6.9×, 0 bytes beyond asked: target MISSED.")
	results[1].Speedup, results[1].GiBps = 8.7, 17.9
	require.Contains(t, benchgpu.FormatPinning(results), "At 48 GiB, warm: 17.9 GiB/s, 8.7×, 0 bytes beyond asked: target MISSED.")
}

func TestMeasurePinningFake(t *testing.T) {
	cases := []struct {
		name      string
		opts      benchgpu.PinningOptions
		chunk     int64 // reported
		rangeSize int64
	}{
		{"pipelined, chunk cut to the range limit", benchgpu.PinningOptions{RangeLimit: 1 << 20}, 1 << 20, 1 << 20},
		{"pipelined", benchgpu.PinningOptions{RangeLimit: 1 << 20, PipelineChunk: 256 << 10}, 256 << 10, 256 << 10},
		{"pipelined, default chunk", benchgpu.PinningOptions{}, register.DefaultPipelineChunk, register.DefaultPipelineChunk},
		{"sequential", benchgpu.PinningOptions{RangeLimit: 1 << 20, PipelineChunk: 256 << 10, Sequential: true}, 0, 1 << 20},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			measurePinningFake(t, c.opts, c.chunk, c.rangeSize)
		})
	}
}

func measurePinningFake(t *testing.T, opts benchgpu.PinningOptions, chunk, rangeSize int64) {
	fd := cudafake.New(cudafake.Options{CheckContext: true})
	defer func() { require.NoError(t, fd.Close()) }()
	sizes := []int64{1<<20 + 1, 3 << 20}
	results, err := benchgpu.MeasurePinning(fd, 0, sizes, opts)
	require.NoError(t, err)
	require.Len(t, results, 2)
	for i, r := range results {
		require.Equal(t, sizes[i], r.Size)
		require.Equal(t, chunk, r.Chunk)
		require.GreaterOrEqual(t, r.Extra(), int64(0))
		require.Less(t, r.Extra(), r.PageSize)
		require.Equal(t, int((r.Mapped+rangeSize-1)/rangeSize), r.Ranges)
		require.Equal(t, r.Map+r.Register, r.Total)
		require.Equal(t, r.Cold.Map+r.Cold.Register, r.Cold.Total)
		require.Positive(t, r.GiBps)
		require.Positive(t, r.Cold.GiBps)
		require.Positive(t, r.HostAlloc)
		require.Positive(t, r.Speedup)
		require.Positive(t, r.ColdSpeedup)
	}
	require.True(t, fd.Live().IsZero(), "everything released: %+v", fd.Live())
	require.Equal(t, 2, fd.Calls(cuda.OpMemHostAlloc))
	require.Equal(t, 2, fd.Calls(cuda.OpMemFreeHost))
	t.Log("\n" + benchgpu.FormatPinning(results))
}

func TestMeasurePinningErrors(t *testing.T) {
	fd := cudafake.New(cudafake.Options{})
	defer func() { require.NoError(t, fd.Close()) }()

	_, err := benchgpu.MeasurePinning(fd, 0, []int64{1 << 20, 0}, benchgpu.PinningOptions{})
	require.ErrorContains(t, err, "pinning size 0")

	fd.FailAt(cuda.OpMemHostRegister, 1, cuda.ErrorOutOfMemory)
	_, err = benchgpu.MeasurePinning(fd, 0, []int64{1 << 20}, benchgpu.PinningOptions{})
	require.True(t, cuda.IsCode(err, cuda.ErrorOutOfMemory))
	require.ErrorContains(t, err, "register 1048576 bytes")

	fd.FailAt(cuda.OpMemHostAlloc, 1, cuda.ErrorOutOfMemory)
	results, err := benchgpu.MeasurePinning(fd, 0, []int64{1 << 20}, benchgpu.PinningOptions{})
	require.ErrorContains(t, err, "cuMemHostAlloc 1048576 bytes")
	require.Empty(t, results)

	results, err = benchgpu.MeasurePinning(fd, 0, []int64{1 << 20}, benchgpu.PinningOptions{SkipHostAlloc: true})
	require.NoError(t, err)
	require.Zero(t, results[0].HostAlloc)
	require.Contains(t, benchgpu.FormatPinning(results), "| – | – | – |")
	require.True(t, fd.Live().IsZero(), "everything released: %+v", fd.Live())
}

// pinSizes reads KVO_PIN_SIZES, a comma-separated list of sizes in GiB
// (default "1").
func pinSizes(t testing.TB) []int64 {
	spec := os.Getenv("KVO_PIN_SIZES")
	if spec == "" {
		spec = "1"
	}
	var sizes []int64
	for _, f := range strings.Split(spec, ",") {
		g, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || g <= 0 {
			t.Fatalf("KVO_PIN_SIZES=%q: %q is not a positive number of GiB", spec, f)
		}
		sizes = append(sizes, int64(g*gib))
	}
	return sizes
}

// pinOptions reads KVO_PIN_CHUNK (the pipeline chunk in GiB, default
// register.DefaultPipelineChunk) and KVO_PIN_SEQUENTIAL=1 (prefault all,
// then register, for comparison).
func pinOptions(t testing.TB) benchgpu.PinningOptions {
	var opts benchgpu.PinningOptions
	if s := os.Getenv("KVO_PIN_CHUNK"); s != "" {
		g, err := strconv.ParseFloat(s, 64)
		chunk := int64(g*gib) / (2 << 20) * (2 << 20)
		if err != nil || chunk <= 0 {
			t.Fatalf("KVO_PIN_CHUNK=%q is not a number of GiB of at least 2 MiB", s)
		}
		opts.PipelineChunk = chunk
	}
	opts.Sequential = os.Getenv("KVO_PIN_SEQUENTIAL") == "1"
	return opts
}

// TestPinningBench measures time to pinned memory on the GPU at the sizes
// of KVO_PIN_SIZES, pipelined (see pinOptions for KVO_PIN_CHUNK and
// KVO_PIN_SEQUENTIAL), and logs the table (run with -test.v). With
// KVO_RESULTS_DIR or KVO_BENCH_OUT set it also writes the table to
// pinning.md there.
func TestPinningBench(t *testing.T) {
	g := cudatest.Open(t)
	results, err := benchgpu.MeasurePinning(g.Drv, g.Dev, pinSizes(t), pinOptions(t))
	require.NoError(t, err)
	table := benchgpu.FormatPinning(results)
	t.Log("\n" + table)
	dir := os.Getenv("KVO_RESULTS_DIR")
	if dir == "" {
		dir = os.Getenv("KVO_BENCH_OUT")
	}
	if dir != "" {
		require.NoError(t, os.MkdirAll(dir, 0o755))
		name, _ := g.Drv.DeviceName(g.Dev)
		doc := fmt.Sprintf("# Time to pinned memory\n\n%s, %s.\n\n%s", name, time.Now().UTC().Format(time.DateOnly), table)
		require.NoError(t, os.WriteFile(filepath.Join(dir, "pinning.md"), []byte(doc), 0o644))
	}
}

// BenchmarkPinning reports GiB/s end to end and the speed-up over
// cuMemHostAlloc per size of KVO_PIN_SIZES (one measurement per iteration).
func BenchmarkPinning(b *testing.B) {
	g := cudatest.Open(b)
	for _, size := range pinSizes(b) {
		b.Run(fmt.Sprintf("%dMiB", size>>20), func(b *testing.B) {
			var gibps, speedup float64
			for b.Loop() {
				results, err := benchgpu.MeasurePinning(g.Drv, g.Dev, []int64{size}, pinOptions(b))
				require.NoError(b, err)
				gibps += results[0].GiBps
				speedup += results[0].Speedup
			}
			b.ReportMetric(gibps/float64(b.N), "GiB/s")
			b.ReportMetric(speedup/float64(b.N), "x-vs-cuMemHostAlloc")
		})
	}
}

func TestMeasurePinningVariantsFake(t *testing.T) {
	fd := cudafake.New(cudafake.Options{CheckContext: true})
	defer func() { require.NoError(t, fd.Close()) }()
	variants := benchgpu.DefaultPinningVariants()
	require.Len(t, variants, 14)
	results, err := benchgpu.MeasurePinningVariants(fd, 0, 4<<20+5, variants)
	require.NoError(t, err)
	require.Len(t, results, len(variants))
	registered := 0
	for i, r := range results {
		require.Equal(t, variants[i].Name, r.Variant.Name)
		require.Positive(t, r.Prefault)
		require.Positive(t, r.PrefaultGiBps)
		require.GreaterOrEqual(t, r.HugeBytes, int64(0))
		if r.Variant.Register {
			registered++
			require.Positive(t, r.Register)
		} else {
			require.Zero(t, r.Register)
		}
	}
	require.Equal(t, 4, registered)
	require.Equal(t, 4, fd.Calls(cuda.OpMemHostRegister))
	require.True(t, fd.Live().IsZero(), "everything released: %+v", fd.Live())
	out := benchgpu.FormatPinningVariants(benchgpu.ReadPinningEnv(), results)
	require.Contains(t, out, "GOMAXPROCS")
	require.Contains(t, out, "| touch ×16 no THP + register | 4194309 B |")
	require.Contains(t, out, "Fastest prefault: ")
	t.Log("\n" + out)

	_, err = benchgpu.MeasurePinningVariants(fd, 0, 0, variants)
	require.ErrorContains(t, err, "pinning size 0")
	fd.FailAt(cuda.OpMemHostRegister, 5, cuda.ErrorOutOfMemory)
	_, err = benchgpu.MeasurePinningVariants(fd, 0, 1<<20, variants)
	require.True(t, cuda.IsCode(err, cuda.ErrorOutOfMemory))
	require.ErrorContains(t, err, "touch ×16 THP + register")
	require.True(t, fd.Live().IsZero(), "everything released after a failure: %+v", fd.Live())
}

func TestFormatPinningVariants(t *testing.T) {
	env := benchgpu.PinningEnv{GOMAXPROCS: 5, NumCPU: 16, CPUMax: "500000 100000", THPEnabled: "always [madvise] never", THPDefrag: "madvise", Kernel: "6.8.0"}
	results := []benchgpu.PinningVariantResult{
		{Variant: benchgpu.PinningVariant{Name: "touch ×16"}, Size: 8 * gib, Prefault: 200 * time.Millisecond, PrefaultGiBps: 40, HugeBytes: 8 * gib},
		{Variant: benchgpu.PinningVariant{Name: "populate ×16 THP + register", Region: mmapmem.Options{Prefault: mmapmem.PrefaultPopulate}, Register: true},
			Size: 8 * gib, Prefault: 100 * time.Millisecond, Register: 300 * time.Millisecond, PrefaultGiBps: 80, HugeBytes: 4 * gib},
	}
	out := benchgpu.FormatPinningVariants(env, results)
	require.Contains(t, out, `GOMAXPROCS 5, NumCPU 16, cgroup cpu.max "500000 100000"`)
	require.Contains(t, out, "| touch ×16 | 8 GiB | 200 ms | 40.0 | 100% | – | – |")
	require.Contains(t, out, "| populate ×16 THP + register | 8 GiB | 100 ms | 80.0 | 50% | 300 ms | 20.0 |")
	require.Contains(t, out, "Fastest prefault: populate ×16 THP + register (80.0 GiB/s, method populate; mmapmem.DefaultPrefaultMethod is populate).")
}

// TestPinningVariants sweeps prefault method × threads × work split at
// KVO_PIN_VARIANT_GIB GiB (default 8) on the GPU machine, with
// registration timed with and without transparent huge pages, and logs one
// table (run with -test.v).
func TestPinningVariants(t *testing.T) {
	g := cudatest.Open(t)
	size := int64(8 * gib)
	if s := os.Getenv("KVO_PIN_VARIANT_GIB"); s != "" {
		v, err := strconv.ParseFloat(s, 64)
		if err != nil || v <= 0 {
			t.Fatalf("KVO_PIN_VARIANT_GIB=%q is not a positive number of GiB", s)
		}
		size = int64(v * gib)
	}
	results, err := benchgpu.MeasurePinningVariants(g.Drv, g.Dev, size, benchgpu.DefaultPinningVariants())
	require.NoError(t, err)
	t.Log("\n" + benchgpu.FormatPinningVariants(benchgpu.ReadPinningEnv(), results))
}
