package main

import (
	"encoding/csv"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/internal/benchgpu"
	"github.com/stretchr/testify/require"
)

func TestBenchWithoutGPU(t *testing.T) {
	if _, err := defaultProber().load(); err == nil {
		t.Skip("a CUDA driver is present")
	}
	out := filepath.Join(t.TempDir(), "out")
	code, stdout, errs := runCLI(t, "bench", "--out", out)
	require.Equal(t, exitError, code)
	require.Empty(t, stdout)
	require.Contains(t, errs, "needs a CUDA GPU")
	require.NoDirExists(t, out, "nothing is written without a GPU")
}

func TestWriteBenchFiles(t *testing.T) {
	res := benchgpu.ThroughputResults{Device: "test GPU", Link: map[string]float64{"d2h": 55, "h2d": 54, "both": 95},
		Config: benchgpu.DefaultThroughputConfig()}
	for _, seg := range []uint64{4 << 10, 64 << 10, 2 << 20} {
		for _, dir := range []string{"d2h", "h2d", "both"} {
			res.Rows = append(res.Rows,
				benchgpu.ThroughputRow{Method: "memcpy", Dir: dir, SegBytes: seg, GBps: float64(seg>>10) / 50, Background: "none"},
				benchgpu.ThroughputRow{Method: "kernel", CTAs: 8, Dir: dir, SegBytes: seg, GBps: 52, Background: "none"})
		}
	}
	sum := benchSummary{Command: "kvoffload bench --reps=1", Started: time.Unix(0, 0).UTC(), Machine: defaultProber().collect(0),
		Throughput: &res, Pinning: toPinningRows([]benchgpu.PinningResult{{Size: 1 << 30, Map: time.Second, Register: time.Second,
			Total: 2 * time.Second, GiBps: 0.5, Mapped: 1 << 30, PageSize: 4096, Ranges: 1, Threads: 2,
			HostAlloc: 4 * time.Second, Speedup: 2}}),
		Skipped: []string{"pinning 48 GiB skipped: above 80% of MemAvailable"}}
	dir := t.TempDir()
	files, err := writeBenchFiles(dir, sum)
	require.NoError(t, err)
	for _, name := range []string{"throughput.csv", "pinning.csv", "summary.json", "results.md", "throughput-d2h.svg", "throughput-h2d.svg", "throughput-both.svg"} {
		require.Contains(t, files, filepath.Join(dir, name))
	}

	var back benchSummary
	b, err := os.ReadFile(filepath.Join(dir, "summary.json"))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, sum.Pinning, back.Pinning)
	require.Len(t, back.Throughput.Rows, len(res.Rows))

	f, err := os.Open(filepath.Join(dir, "pinning.csv"))
	require.NoError(t, err)
	recs, err := csv.NewReader(f).ReadAll()
	require.NoError(t, f.Close())
	require.NoError(t, err)
	require.Len(t, recs, 2)
	require.Equal(t, "size_bytes", recs[0][0])
	require.Equal(t, "1073741824", recs[1][0])

	svg, err := os.ReadFile(filepath.Join(dir, "throughput-d2h.svg"))
	require.NoError(t, err)
	require.Contains(t, string(svg), "stroke-dasharray")
	require.Contains(t, string(svg), "kernel/8 CTAs")

	md, err := os.ReadFile(filepath.Join(dir, "results.md"))
	require.NoError(t, err)
	for _, w := range []string{"## Throughput", "## Pinning", "kvoffload bench --reps=1", "48 GiB skipped"} {
		require.Contains(t, string(md), w)
	}
}

func TestPinningSizes(t *testing.T) {
	b := benchRun{pools: []int64{1 << 30, 16 << 30, 48 << 30}}
	keep, skipped := b.pinningSizes(40 << 30)
	require.Equal(t, []int64{1 << 30, 16 << 30}, keep)
	require.Len(t, skipped, 1)
	require.True(t, strings.HasPrefix(skipped[0], "pinning 48 GiB skipped"))
	keep, skipped = b.pinningSizes(0)
	require.Len(t, keep, 3, "unknown MemAvailable skips nothing")
	require.Empty(t, skipped)
}

func TestListFlags(t *testing.T) {
	var s sizeList
	require.NoError(t, s.Set("4KiB, 2MiB,1G"))
	require.Equal(t, sizeList{4 << 10, 2 << 20, 1 << 30}, s)
	require.Equal(t, "4KiB,2MiB,1GiB", s.String())
	require.ErrorIs(t, s.Set("4KiB,0"), errSize)
	require.Error(t, s.Set(""))
	var n intList
	require.NoError(t, n.Set("2,4, 8"))
	require.Equal(t, intList{2, 4, 8}, n)
	require.Equal(t, "2,4,8", n.String())
	require.Error(t, n.Set("2,x"))
	require.Error(t, n.Set("0"))
}

// The summary rows keep what FormatPinning needs: the cold run and the
// pipeline chunk survive the round trip through pinningRow.
func TestPinningRowsKeepColdAndChunk(t *testing.T) {
	in := []benchgpu.PinningResult{{Size: 1 << 30, Map: time.Millisecond, Register: 50 * time.Millisecond, Total: 51 * time.Millisecond,
		GiBps: 19.6, Threads: 16, Chunk: 2 << 30, HostAlloc: 400 * time.Millisecond, Speedup: 7.8, ColdSpeedup: 2.5,
		Cold: benchgpu.PinningRun{Map: 2 * time.Millisecond, Register: 158 * time.Millisecond, Total: 160 * time.Millisecond, GiBps: 6.25}}}
	got := formatPinningRows(toPinningRows(in))
	require.Equal(t, benchgpu.FormatPinning(in), got)
	require.Contains(t, got, "160 ms")
	require.Contains(t, got, "pipelined")
}

// --ptx names a readable, non-empty file, or the command line is wrong.
func TestBenchPTXFlag(t *testing.T) {
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty.ptx")
	require.NoError(t, os.WriteFile(empty, nil, 0o644))
	for _, tc := range []struct{ file, want string }{
		{filepath.Join(dir, "missing.ptx"), "--ptx: open"},
		{empty, "--ptx " + empty + " is empty"},
	} {
		code, stdout, errs := runCLI(t, "bench", "--out", filepath.Join(dir, "out"), "--ptx", tc.file)
		require.Equal(t, exitUsage, code, tc.file)
		require.Empty(t, stdout)
		require.Contains(t, errs, tc.want)
	}
	require.NoDirExists(t, filepath.Join(dir, "out"))
}

// A throughput row above 102% of the link makes the run invalid: "valid":
// false in summary.json, INVALID and no targets in results.md, and an
// error that exits with status 3.
func TestBenchVerdict(t *testing.T) {
	link := map[string]float64{"d2h": 46.2, "h2d": 45.7, "both": 62.1}
	rows := []benchgpu.ThroughputRow{
		{Method: "contiguous", Dir: "d2h", SegBytes: 2 << 30, GBps: 46.2, PctOfLink: 100, Background: "none"},
		{Method: "auto", CTAs: 8, Dir: "d2h", SegBytes: 64 << 10, GBps: 52, PctOfLink: 112.6, Background: "none", Chosen: "kernel"},
	}
	res := benchgpu.ThroughputResults{Device: "test GPU", Link: link, Config: benchgpu.DefaultThroughputConfig(), Rows: rows, Invalid: benchgpu.LinkVerdict(link, rows)}
	sum := benchSummary{Command: "kvoffload bench", Throughput: &res}
	err := sum.verdict()
	require.ErrorIs(t, err, errVerification)
	require.Contains(t, err.Error(), "INVALID")
	require.False(t, sum.Valid)
	dir := t.TempDir()
	_, err = writeBenchFiles(dir, sum)
	require.NoError(t, err)
	js, err := os.ReadFile(filepath.Join(dir, "summary.json"))
	require.NoError(t, err)
	require.Contains(t, string(js), `"valid": false`)
	md, err := os.ReadFile(filepath.Join(dir, "results.md"))
	require.NoError(t, err)
	require.Contains(t, string(md), "**INVALID**")
	require.Contains(t, string(md), "Not reported: the run is INVALID")
	require.NotContains(t, string(md), "[≥97%")

	res.Link = map[string]float64{"d2h": 55.3, "h2d": 55.4, "both": 95.1}
	res.Invalid = benchgpu.LinkVerdict(res.Link, rows)
	require.NoError(t, sum.verdict())
	require.True(t, sum.Valid)
	require.True(t, (&benchSummary{}).verdict() == nil, "a pinning-only run is valid")
}
