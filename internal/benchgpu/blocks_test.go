package benchgpu

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

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
	if len(res.Invalid) > 0 {
		t.Errorf("the run is INVALID: %q", res.Invalid)
	}
}

// BlocksVerdict marks a row above MaxPctOfLink of its direction's link
// invalid, and a missing reference too; rows at the link pass.
func TestBlocksVerdict(t *testing.T) {
	link := map[string]float64{"d2h": 55.3, "h2d": 55.4, "both": 92.6}
	ok := BlocksRow{Method: "auto", SegBytes: 32 << 10, D2HGBps: 55.3, H2DGBps: 55.0, BothGBps: 92.6 * 1.019}
	require.Empty(t, BlocksVerdict(link, []BlocksRow{ok}))
	over := ok
	over.BothGBps = 96.4 // 104% of 92.6: the blocks run of b6fdae6
	bad := BlocksVerdict(link, []BlocksRow{ok, over})
	require.Len(t, bad, 1)
	require.Contains(t, bad[0], "auto both 32 KiB: 96.4 GB/s = 104.1% of the link (92.6 GB/s), above 102%")
	require.Len(t, BlocksVerdict(map[string]float64{"d2h": 55.3, "h2d": 55.4}, []BlocksRow{ok}), 1, "no both-ways reference")
	require.Contains(t, FormatBlocks(BlocksResults{Link: link, Rows: []BlocksRow{over}, Invalid: bad}), "**INVALID**")
}
