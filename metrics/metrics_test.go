package metrics_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvoffload/kvoffload/metrics"
	"github.com/kvoffload/kvoffload/offload"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"
)

func newEngine(t *testing.T) *offload.Engine {
	t.Helper()
	e, err := offload.New(offload.Config{PoolBytes: 8 * 8192, Backend: offload.BackendHost, SkipMemoryCheck: true,
		Layout: offload.LayoutSpec{Kind: offload.LayoutLayerSeparate, Layers: 2, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: 16}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// work stores more blocks than the pool holds (evictions), loads and looks
// some up.
func work(t *testing.T, e *offload.Engine) {
	ctx := context.Background()
	tokens := make([]uint32, 16*16)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	keys := e.Keys(tokens)
	for i := 0; i < len(keys); i += 4 {
		op, err := e.Store(ctx, keys[i:i+4], []int{i, i + 1, i + 2, i + 3}, offload.StoreOptions{})
		require.NoError(t, err)
		require.NoError(t, op.Wait(ctx))
		require.NoError(t, op.Release())
	}
	_, err := e.Lookup(keys, offload.LookupOptions{})
	require.NoError(t, err)
	op, err := e.Load(ctx, keys[12:], []int{0, 1, 2, 3}, offload.LoadOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(ctx))
	require.NoError(t, op.Release())
}

func parse(t *testing.T, r io.Reader) map[string]*dto.MetricFamily {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(r)
	require.NoError(t, err)
	return mfs
}

// value returns the sample of family name whose label (if given) matches.
func value(t *testing.T, mfs map[string]*dto.MetricFamily, name, label, want string) float64 {
	t.Helper()
	mf, ok := mfs[name]
	require.True(t, ok, "metric %s missing", name)
	for _, m := range mf.GetMetric() {
		match := label == ""
		for _, lp := range m.GetLabel() {
			if lp.GetName() == label && lp.GetValue() == want {
				match = true
			}
		}
		if !match {
			continue
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		}
	}
	t.Fatalf("%s{%s=%q} missing", name, label, want)
	return 0
}

// TestScrapeAgreesWithStats scrapes /metrics over HTTP, parses it with the
// Prometheus text parser and checks the samples against Stats.
func TestScrapeAgreesWithStats(t *testing.T) {
	e := newEngine(t)
	work(t, e)
	srv := httptest.NewServer(metrics.Handler(e))
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	mfs := parse(t, resp.Body)
	s := e.Stats() // idle engine: nothing moves between the scrape and this

	require.Positive(t, s.Evictions)
	require.Equal(t, float64(s.Lookups), value(t, mfs, "kvoffload_lookups_total", "tier", "cpu"))
	require.Equal(t, float64(s.LookupKeys), value(t, mfs, "kvoffload_cpu_block_lookup_total", "tier", "cpu"))
	require.Equal(t, float64(s.Hits), value(t, mfs, "kvoffload_cpu_block_hit_total", "tier", "cpu"))
	require.Equal(t, float64(s.Misses), value(t, mfs, "kvoffload_cpu_block_miss_total", "tier", "cpu"))
	require.Equal(t, float64(s.Evictions), value(t, mfs, "kvoffload_block_eviction_total", "tier", "cpu"))
	require.Equal(t, float64(s.Outcome(offload.OutcomeStored)), value(t, mfs, "kvoffload_block_outcomes_total", "outcome", "stored"))
	require.Equal(t, float64(s.Outcome(offload.OutcomeRefusedFull)), value(t, mfs, "kvoffload_stores_skipped_total", "reason", "refused-full"))
	require.Equal(t, float64(s.Copies.Store.Bytes), value(t, mfs, "kvoffload_total_bytes_total", "transfer_type", metrics.GPUToCPU))
	require.Equal(t, float64(s.Copies.Load.Bytes), value(t, mfs, "kvoffload_total_bytes_total", "transfer_type", metrics.CPUToGPU))
	require.Equal(t, float64(s.Copies.Store.Blocks), value(t, mfs, "kvoffload_total_blocks_total", "transfer_type", metrics.GPUToCPU))
	require.Equal(t, float64(s.Copies.Store.Latency.Count), value(t, mfs, "kvoffload_transfer_latency_seconds", "transfer_type", metrics.GPUToCPU))
	require.Equal(t, float64(s.Copies.Load.Latency.Count), value(t, mfs, "kvoffload_transfer_latency_seconds", "transfer_type", metrics.CPUToGPU))
	require.Equal(t, float64(s.Pool.Bytes), value(t, mfs, "kvoffload_pool_capacity_bytes", "tier", "cpu"))
	require.Equal(t, float64(s.Pool.OwnedBytes), value(t, mfs, "kvoffload_pool_owned_bytes", "tier", "cpu"))
	require.Equal(t, float64(s.Pool.InUseBytes), value(t, mfs, "kvoffload_pool_in_use_bytes", "tier", "cpu"))
	require.Equal(t, float64(s.Copies.InFlightBytes), value(t, mfs, "kvoffload_pool_in_flight_bytes", "tier", "cpu"))
	require.Positive(t, s.Pool.InUseBytes, "blocks are stored")
	require.Equal(t, float64(s.Pool.InUseBytes)/float64(s.Pool.OwnedBytes), value(t, mfs, "kvoffload_cpu_cache_usage_perc", "tier", "cpu"))
	require.Equal(t, float64(s.Pool.SlotsFree), value(t, mfs, "kvoffload_pool_slots", "state", "free"))
	require.Equal(t, float64(s.Pool.GrowthTargetBytes), value(t, mfs, "kvoffload_growth_target_bytes", "tier", "cpu"))
	require.Equal(t, dto.MetricType_HISTOGRAM, mfs["kvoffload_transfer_latency_seconds"].GetType())
	require.Equal(t, dto.MetricType_COUNTER, mfs["kvoffload_cpu_block_hit_total"].GetType())
}

// TestWriteTextIsTheExposition checks that WriteText (what the C ABI and
// Python return) parses the same way.
func TestWriteTextIsTheExposition(t *testing.T) {
	e := newEngine(t)
	work(t, e)
	var buf bytes.Buffer
	require.NoError(t, metrics.WriteText(&buf, e))
	mfs := parse(t, &buf)
	require.Equal(t, float64(e.Stats().Hits), value(t, mfs, "kvoffload_cpu_block_hit_total", "tier", "cpu"))
}

// sample returns the sample of family name whose labels include all of want.
func sample(t *testing.T, mfs map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	t.Helper()
	mf, ok := mfs[name]
	require.True(t, ok, "metric %s missing", name)
	for _, m := range mf.GetMetric() {
		got := map[string]string{}
		for _, lp := range m.GetLabel() {
			got[lp.GetName()] = lp.GetValue()
		}
		match := true
		for k, v := range want {
			match = match && got[k] == v
		}
		if !match {
			continue
		}
		if m.Counter != nil {
			return m.Counter.GetValue()
		}
		return m.Gauge.GetValue()
	}
	t.Fatalf("%s%v missing", name, want)
	return 0
}

// TestDiskTierMetrics: an engine with a disk tier exports its Disk* Stats
// with tier="disk"; one without exports no disk series.
func TestDiskTierMetrics(t *testing.T) {
	var buf bytes.Buffer
	require.NoError(t, metrics.WriteText(&buf, newEngine(t)))
	mfs := parse(t, &buf)
	_, ok := mfs["kvoffload_tier_records"]
	require.False(t, ok, "no disk tier, no disk series")

	e, err := offload.New(offload.Config{PoolBytes: 8 * 8192, Backend: offload.BackendHost, SkipMemoryCheck: true,
		Layout: offload.LayoutSpec{Kind: offload.LayoutLayerSeparate, Layers: 2, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: 16},
		Disk:   &offload.DiskConfig{Dirs: []string{t.TempDir()}, CapacityBytes: 1 << 20, AdmitAll: true}})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	work(t, e)
	require.NoError(t, e.FlushDisk(context.Background()))
	tokens := make([]uint32, 16*16)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	_, err = e.Lookup(e.Keys(tokens), offload.LookupOptions{}) // the first blocks are on disk now
	require.NoError(t, err)
	buf.Reset()
	require.NoError(t, metrics.WriteText(&buf, e))
	mfs = parse(t, &buf)
	s := e.Stats()
	require.Positive(t, s.Disk.Writes)
	require.Positive(t, s.Disk.LookupHits)
	disk := func(kv ...string) map[string]string {
		m := map[string]string{"tier": "disk"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   int64
	}{
		{"kvoffload_cpu_block_lookup_total", disk(), s.Misses},
		{"kvoffload_cpu_block_hit_total", disk(), s.Disk.LookupHits},
		{"kvoffload_cpu_block_miss_total", disk(), s.Misses - s.Disk.LookupHits},
		{"kvoffload_admission_rejections_total", disk(), s.Disk.NotAdmitted},
		{"kvoffload_tier_reads_total", disk("result", "hit"), s.Disk.Hits},
		{"kvoffload_tier_reads_total", disk("result", "miss"), s.Disk.Misses},
		{"kvoffload_tier_writes_total", disk("result", "written"), s.Disk.Writes},
		{"kvoffload_tier_writes_total", disk("result", "error"), s.Disk.WriteErrors},
		{"kvoffload_tier_writes_total", disk("result", "dropped"), s.Disk.Dropped},
		{"kvoffload_tier_write_copies_total", disk(), s.Disk.Copies},
		{"kvoffload_tier_corrupt_total", disk(), s.Disk.Corrupt},
		{"kvoffload_tier_records", disk(), s.Disk.Records},
		{"kvoffload_tier_bytes", disk(), s.Disk.Bytes},
		{"kvoffload_tier_capacity_records", disk(), s.Disk.Capacity},
		{"kvoffload_tier_io_mode", disk("mode", s.Disk.Mode), 1},
		{"kvoffload_cpu_block_hit_total", map[string]string{"tier": "cpu"}, s.Hits},
	} {
		require.Equal(t, float64(c.want), sample(t, mfs, c.name, c.labels), "%s%v", c.name, c.labels)
	}
	require.Equal(t, dto.MetricType_COUNTER, mfs["kvoffload_tier_writes_total"].GetType())
	require.Equal(t, dto.MetricType_GAUGE, mfs["kvoffload_tier_records"].GetType())
	require.Equal(t, float64(1), sample(t, mfs, "kvoffload_tier_directories", disk("state", "read_write")))

	// The start-up and fault counts, each from its own field.
	buf.Reset()
	require.NoError(t, metrics.WriteText(&buf, statsSource{Disk: offload.DiskStats{Mode: "direct", Capacity: 10, TornAtOpen: 201,
		StaleAtOpen: 202, IOErrors: 210, NoSpace: 4, Evictions: 205, Dirs: 3, ReadOnlyDirs: 1, UnusableDirs: 2}}))
	mfs = parse(t, &buf)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"kvoffload_tier_discarded_at_open_total", disk("reason", "torn"), 201},
		{"kvoffload_tier_discarded_at_open_total", disk("reason", "stale"), 202},
		{"kvoffload_tier_io_errors_total", disk("reason", "io"), 206},
		{"kvoffload_tier_io_errors_total", disk("reason", "no_space"), 4},
		{"kvoffload_tier_evictions_total", disk(), 205},
		{"kvoffload_tier_directories", disk("state", "read_write"), 2},
		{"kvoffload_tier_directories", disk("state", "read_only"), 1},
		{"kvoffload_tier_directories", disk("state", "unusable"), 2},
	} {
		require.Equal(t, c.want, sample(t, mfs, c.name, c.labels), "%s%v", c.name, c.labels)
	}
}

// statsSource is a Source of fixed Stats.
type statsSource offload.Stats

func (s statsSource) Stats() offload.Stats { return offload.Stats(s) }

// TestClusterTierMetrics: an engine with a cluster tier exports its
// Cluster* Stats with tier="cluster", each from its own field; one without
// exports no cluster series.
func TestClusterTierMetrics(t *testing.T) {
	var buf bytes.Buffer
	require.NoError(t, metrics.WriteText(&buf, newEngine(t)))
	mfs := parse(t, &buf)
	_, ok := mfs["kvoffload_tier_available"]
	require.False(t, ok, "no cluster tier, no cluster series")

	// Distinct values, so that a field exported as another shows.
	s := offload.Stats{Cluster: offload.ClusterStats{Configured: true, Writes: 101, WriteBytes: 102, WriteErrors: 103,
		Dropped: 104, Hits: 105, HitBytes: 106, Misses: 107, Timeouts: 108,
		Corrupt: 109, Errors: 110, Available: true, Unavailable: 111 + 112, UnavailableWrites: 112}}
	buf.Reset()
	require.NoError(t, metrics.WriteText(&buf, statsSource(s)))
	mfs = parse(t, &buf)
	cl := func(kv ...string) map[string]string {
		m := map[string]string{"tier": "cluster"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   int64
	}{
		{"kvoffload_cpu_block_lookup_total", cl(), 105 + 107},
		{"kvoffload_cpu_block_hit_total", cl(), 105},
		{"kvoffload_cpu_block_miss_total", cl(), 107},
		{"kvoffload_tier_reads_total", cl("result", "hit"), 105},
		{"kvoffload_tier_reads_total", cl("result", "miss"), 107},
		{"kvoffload_tier_read_failures_total", cl("reason", "timeout"), 108},
		{"kvoffload_tier_read_failures_total", cl("reason", "error"), 110},
		{"kvoffload_tier_read_failures_total", cl("reason", "unavailable"), 111},
		{"kvoffload_tier_writes_total", cl("result", "written"), 101},
		{"kvoffload_tier_writes_total", cl("result", "error"), 103},
		{"kvoffload_tier_writes_total", cl("result", "dropped"), 104},
		{"kvoffload_tier_writes_total", cl("result", "unavailable"), 112},
		{"kvoffload_tier_corrupt_total", cl(), 109},
		{"kvoffload_tier_transfer_bytes_total", cl("direction", "written"), 102},
		{"kvoffload_tier_transfer_bytes_total", cl("direction", "read"), 106},
		{"kvoffload_tier_available", cl(), 1},
	} {
		require.Equal(t, float64(c.want), sample(t, mfs, c.name, c.labels), "%s%v", c.name, c.labels)
	}
	require.Equal(t, dto.MetricType_COUNTER, mfs["kvoffload_tier_read_failures_total"].GetType())
	require.Equal(t, dto.MetricType_GAUGE, mfs["kvoffload_tier_available"].GetType())
	_, ok = mfs["kvoffload_tier_io_mode"]
	require.False(t, ok, "no disk tier, no disk series")

	s.Cluster.Available = false
	buf.Reset()
	require.NoError(t, metrics.WriteText(&buf, statsSource(s)))
	require.Zero(t, sample(t, parse(t, &buf), "kvoffload_tier_available", cl()))
}
