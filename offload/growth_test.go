package offload

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestGrowthSteps: the growth breakdown counts every pool region's steps,
// not the staging region's; each step is taken by one stage at a time, so
// each step's sum stays within Pool.FullPool (their total may not: the stages
// overlap).
func TestGrowthSteps(t *testing.T) {
	slot := int64(8 << 10)
	e := newTestEngine(t, Config{PoolBytes: 64 * slot, FirstRegionBytes: 16 * slot, RegionBytes: 16 * slot,
		StagingBytes: 4 * slot, Layout: smallLayout(8), Policy: PolicyLRU})
	defer func() { require.NoError(t, e.Close()) }()
	require.NoError(t, e.WaitGrown(context.Background()))
	st := e.Stats()
	g := st.Pool.Growth
	for name, d := range map[string]time.Duration{"map": g.Map, "prefault": g.Prefault, "pin": g.Pin, "host ranges": g.HostRanges, "cache": g.Cache} {
		require.Positive(t, d, name)
		require.LessOrEqual(t, d, st.Pool.FullPool, name)
	}
	require.Equal(t, g.Map+g.Prefault+g.Pin+g.HostRanges+g.Cache, g.sum())
	require.EqualValues(t, 5, st.Pool.PinCalls, "4 pool regions and the staging region")
}

// BenchmarkGrowth times growing a host-backend pool (PinNone: mmap and
// prefault, registration with the simulation) of KVO_GROWTH_GIB GiB (default
// 4; keep it within the machine's free memory) in 4 KiB slots, 256 MiB
// regions after a 256 MiB first one, and reports the time of each growth
// step per pool: map, prefault, pin, host ranges, cache (kvcache
// AddRegion); the steps of neighbouring regions overlap, so their sum
// (ms-steps) may exceed the wall time (ms-full-pool).
func BenchmarkGrowth(b *testing.B) {
	gib := int64(4)
	if v := os.Getenv("KVO_GROWTH_GIB"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		require.NoError(b, err)
		gib = n
	}
	layout := LayoutSpec{Kind: LayoutLayerSeparate, Layers: 2, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 8, NumBlocks: 64}
	cfg := Config{PoolBytes: gib << 30, FirstRegionBytes: 256 << 20, RegionBytes: 256 << 20, StagingBytes: -1,
		Layout: layout, Policy: PolicyLRU, Backend: BackendHost, SkipMemoryCheck: true}
	var sum GrowthSteps
	var full, first time.Duration
	for b.Loop() {
		e, err := newEngine(cfg, engineHooks{})
		require.NoError(b, err)
		require.NoError(b, e.WaitGrown(context.Background()))
		st := e.Stats()
		require.Equal(b, int64(4096), st.Pool.BlockBytes)
		sum.Map += st.Pool.Growth.Map
		sum.Prefault += st.Pool.Growth.Prefault
		sum.Pin += st.Pool.Growth.Pin
		sum.HostRanges += st.Pool.Growth.HostRanges
		sum.Cache += st.Pool.Growth.Cache
		full += st.Pool.FullPool
		first += st.Pool.FirstSlot
		require.NoError(b, e.Close())
	}
	n := float64(b.N)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 / n }
	b.ReportMetric(ms(first), "ms-first-slot")
	b.ReportMetric(ms(full), "ms-full-pool")
	b.ReportMetric(ms(sum.Map), "ms-map")
	b.ReportMetric(ms(sum.Prefault), "ms-prefault")
	b.ReportMetric(ms(sum.Pin), "ms-pin")
	b.ReportMetric(ms(sum.HostRanges), "ms-host-ranges")
	b.ReportMetric(ms(sum.Cache), "ms-cache")
	b.ReportMetric(ms(sum.sum()), "ms-steps")
	b.ReportMetric(float64(cfg.PoolBytes)/(1<<30)/(ms(full)/1e3), "GiB/s")
	b.Logf("%d GiB, %d slots: %+v", gib, cfg.PoolBytes/4096, sum)
}
