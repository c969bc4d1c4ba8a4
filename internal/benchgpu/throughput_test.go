package benchgpu

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
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
		"Link (contiguous, pinned; the faster of one copy a direction and the same bytes in 2 MiB pieces by the batch API): d2h 55.0 GB/s, h2d 55.0 GB/s, both 95.0 GB/s.",
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
