package offload

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// smallLayout is a layer-separate layout of 2 layers, 1 head of 64 bf16,
// 16 tokens per block: 2 KiB segments, 8 KiB slots; no tensors (the host
// backend allocates them).
func smallLayout(blocks int) LayoutSpec {
	return LayoutSpec{Kind: LayoutLayerSeparate, Layers: 2, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: blocks}
}

func TestWithDefaults(t *testing.T) {
	cfg, numa, slot, err := withDefaults(Config{PoolBytes: 1 << 20, Layout: smallLayout(8)})
	require.NoError(t, err)
	require.Equal(t, int64(8192), slot)
	require.Equal(t, BackendAuto, cfg.Backend)
	require.Equal(t, PolicyLRU, cfg.Policy)
	require.Equal(t, HugePagesTHP, cfg.HugePages)
	require.Equal(t, PinNone, cfg.HostPinning)
	require.Equal(t, int64(1<<20), cfg.FirstRegionBytes, "first region capped at the pool")
	require.Equal(t, defaultRegionBytes, cfg.RegionBytes)
	require.Equal(t, defaultStagingBytes, cfg.StagingBytes)
	require.Positive(t, cfg.PrefaultThreads)
	require.True(t, numa.auto)
	require.Equal(t, -1, numa.node)

	_, numa, _, err = withDefaults(Config{PoolBytes: 1 << 20, Layout: smallLayout(8), NUMANode: "3"})
	require.NoError(t, err)
	require.Equal(t, numaSetting{node: 3}, numa)
}

func TestWithDefaultsErrors(t *testing.T) {
	ok := Config{PoolBytes: 1 << 20, Layout: smallLayout(8)}
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		is     error
		msg    string
	}{
		{"zero pool", func(c *Config) { c.PoolBytes = 0 }, ErrInvalidConfig, "PoolBytes = 0"},
		{"pool below one block", func(c *Config) { c.PoolBytes = 4096 }, ErrPoolTooSmall, "one block of 8192 bytes"},
		{"unknown backend", func(c *Config) { c.Backend = "rocm" }, ErrInvalidConfig, `Backend "rocm"`},
		{"unknown pinning", func(c *Config) { c.HostPinning = "pin" }, ErrInvalidConfig, `HostPinning "pin"`},
		{"unknown huge pages", func(c *Config) { c.HugePages = "2M" }, ErrInvalidConfig, `HugePages "2M"`},
		{"bad numa", func(c *Config) { c.NUMANode = "-2" }, ErrInvalidConfig, `NUMANode "-2"`},
		{"unknown policy", func(c *Config) { c.Policy = "arc" }, ErrInvalidConfig, `Policy "arc"`},
		{"negative device", func(c *Config) { c.Device = -1 }, ErrInvalidConfig, "Device = -1"},
		{"negative threads", func(c *Config) { c.PrefaultThreads = -1 }, ErrInvalidConfig, "PrefaultThreads = -1"},
		{"nice above 19", func(c *Config) { c.PrefaultNice = 20 }, ErrInvalidConfig, "PrefaultNice = 20"},
		{"negative in flight", func(c *Config) { c.MaxInFlightBytes = -1 }, ErrInvalidConfig, "MaxInFlightBytes = -1"},
		{"in flight below a block", func(c *Config) { c.MaxInFlightBytes = 100 }, ErrInvalidConfig, "MaxInFlightBytes = 100"},
		{"region below a block", func(c *Config) { c.RegionBytes = 100 }, ErrInvalidConfig, "RegionBytes = 100"},
		{"unknown layout", func(c *Config) { c.Layout.Kind = "paged" }, ErrInvalidConfig, `Layout.Kind "paged"`},
		{"zero layers", func(c *Config) { c.Layout.Layers = 0 }, ErrInvalidConfig, "Layers = 0"},
		{"zero blocks", func(c *Config) { c.Layout.NumBlocks = 0 }, ErrInvalidConfig, "NumBlocks = 0"},
		{"negative device bytes", func(c *Config) { c.MaxDeviceBytes = -1 }, ErrInvalidConfig, "MaxDeviceBytes = -1"},
		{"device bytes below the minimum", func(c *Config) { c.MaxDeviceBytes = 1 << 20 }, ErrInvalidConfig, "minimum 10485760"},
		{"cuda without tensors", func(c *Config) { c.Backend = BackendCUDA }, ErrInvalidConfig, "needs the device tensors"},
		{"stride below segment", func(c *Config) {
			c.Layout.LayerTensors = []LayerTensors{{K: 1 << 30, V: 1 << 31, Stride: 16}, {K: 1 << 32, V: 1 << 33, Stride: 16}}
		}, ErrInvalidConfig, "stride 16"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := ok
			c.Layout.LayerTensors = nil
			tc.mutate(&c)
			_, _, _, err := withDefaults(c)
			require.ErrorIs(t, err, tc.is)
			require.ErrorContains(t, err, tc.msg)
		})
	}
}

func TestRegionPlan(t *testing.T) {
	require.Equal(t, []int64{1000}, regionPlan(1050, 4000, 5000, 100), "pool rounded down to whole slots")
	require.Equal(t, []int64{200, 500, 500, 300}, regionPlan(1500, 250, 500, 100))
	require.Equal(t, []int64{100}, regionPlan(100, 100, 100, 100))
}

func TestLayoutSpecRoundTrip(t *testing.T) {
	l := smallLayout(4)
	l.LayerTensors = []LayerTensors{{K: 1 << 20, V: 2 << 20, Stride: 2048}, {K: 3 << 20, V: 4 << 20, Stride: 2048}}
	spec, err := kvLayoutSpec(l)
	require.NoError(t, err)
	require.Equal(t, l, fromKVLayoutSpec(spec))
}

func FuzzConfig(f *testing.F) {
	f.Add(int64(1<<20), int64(0), 2, 1, 64, 2, 16, 8, "auto", "tinylfu", "auto")
	f.Add(int64(100), int64(-1), 0, 0, 0, 0, 0, 0, "x", "y", "z")
	f.Add(int64(1<<40), int64(1<<62), 1<<20, 1<<20, 1<<20, 8, 1<<20, 1<<30, "host", "lru", "7")
	f.Fuzz(func(t *testing.T, pool, region int64, layers, heads, dim, dt, tpb, blocks int, backend, policy, numa string) {
		cfg := Config{PoolBytes: pool, RegionBytes: region, Backend: Backend(backend), Policy: Policy(policy), NUMANode: numa,
			Layout: LayoutSpec{Kind: LayoutCrossLayer, Layers: layers, KVHeads: heads, HeadDim: dim, DTypeBytes: dt, TokensPerBlock: tpb, NumBlocks: blocks}}
		out, _, slot, err := withDefaults(cfg)
		if err != nil {
			return
		}
		require.Positive(t, slot)
		require.GreaterOrEqual(t, out.PoolBytes, slot)
		plan := regionPlan(out.PoolBytes, out.FirstRegionBytes, out.RegionBytes, slot)
		var sum int64
		for _, r := range plan {
			require.Positive(t, r)
			require.Zero(t, r%slot)
			sum += r
		}
		require.LessOrEqual(t, sum, out.PoolBytes)
		require.Greater(t, sum+slot, out.PoolBytes-out.PoolBytes%slot)
	})
}

// The typed Config enums keep their JSON strings both ways, take "" as the
// default, and refuse an unknown value with ErrInvalidConfig naming it.
func TestConfigEnumsJSON(t *testing.T) {
	cfg := Config{PoolBytes: 1 << 20, Backend: BackendHost, HostPinning: PinMlock, HugePages: HugePagesHugeTLB,
		Policy: PolicyTinyLFU, Layout: LayoutSpec{Kind: LayoutMLA}}
	b, err := json.Marshal(cfg)
	require.NoError(t, err)
	for _, want := range []string{`"backend":"host"`, `"host_pinning":"mlock"`, `"huge_pages":"hugetlb"`, `"policy":"tinylfu"`, `"kind":"mla"`} {
		require.Contains(t, string(b), want)
	}
	var back Config
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, cfg, back)

	var disk Config
	require.NoError(t, json.Unmarshal([]byte(`{"disk":{"dirs":["/x"],"fsync":"on-close","direct":"off"}}`), &disk))
	require.Equal(t, DiskFsyncOnClose, disk.Disk.Fsync)
	require.Equal(t, DiskDirectOff, disk.Disk.Direct)

	var empty Config
	require.NoError(t, json.Unmarshal([]byte(`{"backend":"","policy":""}`), &empty))
	require.Equal(t, Backend(""), empty.Backend)

	for _, c := range []struct{ json, field string }{
		{`{"backend":"gpu"}`, `Backend "gpu"`},
		{`{"host_pinning":"always"}`, `HostPinning "always"`},
		{`{"huge_pages":"2m"}`, `HugePages "2m"`},
		{`{"policy":"lfu"}`, `Policy "lfu"`},
		{`{"layout":{"kind":"paged"}}`, `Layout.Kind "paged"`},
		{`{"disk":{"dirs":["/x"],"fsync":"sometimes"}}`, `Disk.Fsync "sometimes"`},
		{`{"disk":{"dirs":["/x"],"direct":"maybe"}}`, `Disk.Direct "maybe"`},
	} {
		var got Config
		err := json.Unmarshal([]byte(c.json), &got)
		require.ErrorIs(t, err, ErrInvalidConfig, c.json)
		require.ErrorContains(t, err, c.field, c.json)
	}
}
