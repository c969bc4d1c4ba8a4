package offload

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/kvcache"
)

// Issue 19: sizes that cannot fit are refused before anything
// proportional to them is allocated, and size arithmetic never wraps.

// heapGrowth runs f and returns how much the Go heap's reservation grew.
func heapGrowth(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	if after.HeapSys < before.HeapSys {
		return 0
	}
	return after.HeapSys - before.HeapSys
}

// TestHugePoolRefused: PoolBytes 2^58…2^63-1 with the default regions is
// refused by withDefaults (too many slots, or too many regions), with or
// without the memory check, naming the value and the limit, without
// building the region plan (2^62 used to grow it to 24 GB).
func TestHugePoolRefused(t *testing.T) {
	for _, pool := range []int64{1 << 40, 1 << 58, 1 << 60, 1 << 62, math.MaxInt64} {
		for _, skip := range []bool{false, true} {
			t.Run(fmt.Sprintf("%d/skip=%v", pool, skip), func(t *testing.T) {
				cfg := Config{PoolBytes: pool, Layout: smallLayout(8), Backend: BackendHost, SkipMemoryCheck: skip}
				if pool == 1<<40 {
					cfg.RegionBytes = 1 << 20 // 2^20 regions of 2^7 slots
				}
				var err error
				grew := heapGrowth(func() { _, err = newEngine(cfg, engineHooks{}) })
				require.ErrorIs(t, err, ErrInvalidConfig)
				require.Contains(t, err.Error(), fmt.Sprint(pool))
				if pool == 1<<40 {
					require.Contains(t, err.Error(), fmt.Sprintf("%d regions, at most %d (maxRegions)", 1+(1<<40-1<<30)/(1<<20), maxRegions))
				} else if pool == math.MaxInt64 {
					require.Contains(t, err.Error(), "plus StagingBytes = 16777216 overflows int64")
				} else {
					require.Contains(t, err.Error(), fmt.Sprintf("at most %d (kvcache.MaxSlots)", kvcache.MaxSlots))
				}
				require.Less(t, grew, uint64(64<<20), "heap grew by %d bytes", grew)
			})
		}
	}
}

// bigSlotLayout has 512 KiB slots, so that a 256 TiB pool is 2^29 slots:
// within kvcache.MaxSlots, but its slot tables would take ~60 GiB.
func bigSlotLayout() LayoutSpec {
	return LayoutSpec{Kind: LayoutLayerSeparate, Layers: 2, KVHeads: 64, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: 2}
}

// TestHugePoolTablesBounded: a 256 TiB pool in 256 regions passes the
// size checks; with the memory check it is refused for memory, and
// without it New fails on mapping the first region. Either way the
// cache's slot table, key index and TinyLFU sketch (proportional to
// PoolBytes / slot) are not reserved first.
func TestHugePoolTablesBounded(t *testing.T) {
	for _, policy := range []Policy{PolicyLRU, PolicyTinyLFU} {
		for _, skip := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/skip=%v", policy, skip), func(t *testing.T) {
				cfg := Config{PoolBytes: 1 << 48, RegionBytes: 1 << 40, FirstRegionBytes: 1 << 48, Layout: bigSlotLayout(),
					Backend: BackendHost, Policy: policy, SkipMemoryCheck: skip}
				var err error
				grew := heapGrowth(func() { _, err = newEngine(cfg, engineHooks{}) })
				require.Error(t, err)
				if !skip {
					require.ErrorIs(t, err, ErrInsufficientMemory)
				}
				require.Less(t, grew, uint64(256<<20), "heap grew by %d bytes", grew)
			})
		}
	}
}

// TestMemoryCheckCountsTables: the memory check counts the slot tables:
// a pool that fits alone but not with its tables is refused.
func TestMemoryCheckCountsTables(t *testing.T) {
	// 64 MiB of 4 KiB slots (one page each): 2^14 slots.
	page := LayoutSpec{Kind: LayoutLayerSeparate, Layers: 1, KVHeads: 1, HeadDim: 1024, DTypeBytes: 2, TokensPerBlock: 1, NumBlocks: 2}
	tables := kvcache.ReserveBytes(1 << 14)
	avail := (int64(64<<20) + tables/2) / 1024 // the pool fits, the pool and its tables do not
	sys := fakeSystem(map[string]string{"proc/meminfo": fmt.Sprintf("MemAvailable: %d kB\n", avail)}, math.MaxUint64)
	e, err := newEngine(Config{PoolBytes: 64 << 20, StagingBytes: -1, Layout: page, Backend: BackendHost}, engineHooks{sys: &sys})
	if err == nil {
		require.NoError(t, e.Close())
	}
	require.ErrorIs(t, err, ErrInsufficientMemory)
	require.Contains(t, err.Error(), fmt.Sprintf("%d bytes", int64(64<<20)+tables))
}

// TestSizeOverflow: sums and products of sizes that overflow int64 are
// ErrInvalidConfig naming the values (the pool_bytes 2^63-1 with
// region_bytes 2^62 wrapped PoolBytes + StagingBytes negative, passed the
// memory check and aborted in kvcache.New).
func TestSizeOverflow(t *testing.T) {
	var cfg Config
	require.NoError(t, json.Unmarshal([]byte(`{"pool_bytes": 9223372036854775807, "region_bytes": 4611686018427387904, "backend": "host",
		"layout": {"kind": "layer-separate", "layers": 2, "kv_heads": 1, "head_dim": 64, "dtype_bytes": 2, "tokens_per_block": 16, "num_blocks": 8}}`), &cfg))
	for _, c := range []struct {
		name string
		cfg  Config
		msg  string
	}{
		{"pool plus staging", cfg, "PoolBytes = 9223372036854775807 plus StagingBytes = 16777216 overflows"},
		{"blocks × slot", Config{PoolBytes: 1 << 20, Backend: BackendHost, Layout: LayoutSpec{Kind: LayoutCrossLayer, Layers: 1, KVHeads: 1, HeadDim: 1 << 20,
			DTypeBytes: 1, TokensPerBlock: 1 << 20, NumBlocks: 1 << 30}}, "1073741824 blocks × stride 2199023255552 overflows 64 bits"},
		{"geometry product", Config{PoolBytes: 1 << 20, Backend: BackendHost, Layout: LayoutSpec{Kind: LayoutLayerSeparate, Layers: 2, KVHeads: 1 << 30, HeadDim: 1 << 30,
			DTypeBytes: 1 << 30, TokensPerBlock: 1, NumBlocks: 1}}, "overflows 64 bits"},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, skip := range []bool{false, true} {
				c.cfg.SkipMemoryCheck = skip
				_, err := newEngine(c.cfg, engineHooks{})
				require.ErrorIs(t, err, ErrInvalidConfig)
				require.Contains(t, err.Error(), c.msg)
			}
		})
	}
}

// TestTooManyLayers: a layout of 2^17 layers given without tensors is
// refused on its count (DenseRankSpec would build one entry per layer).
func TestTooManyLayers(t *testing.T) {
	l := smallLayout(8)
	l.Layers = 1 << 17
	_, err := newEngine(Config{PoolBytes: 1 << 20, Layout: l, Backend: BackendHost, SkipMemoryCheck: true}, engineHooks{})
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), fmt.Sprintf("Layers = %d, at most %d", 1<<17, 1<<16))
}

// TestMLAKVHeads: MLA has one latent per layer; kv_heads 2 is refused.
func TestMLAKVHeads(t *testing.T) {
	l := LayoutSpec{Kind: LayoutMLA, Layers: 2, KVHeads: 2, HeadDim: 576, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: 4}
	_, err := newEngine(Config{PoolBytes: 1 << 20, Layout: l, Backend: BackendHost, SkipMemoryCheck: true}, engineHooks{})
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), "KVHeads = 2")
}

// TestBadNUMANode: a node the machine lacks, a negative one or a word are
// ErrInvalidConfig naming the value (and, for a number, the nodes there
// are), with or without the memory check — not a mapping failure.
func TestBadNUMANode(t *testing.T) {
	sys := fakeSystem(map[string]string{
		"proc/meminfo":                          meminfo64G,
		"sys/devices/system/node/node0/meminfo": "Node 0 MemFree: 33554432 kB\n",
		"sys/devices/system/node/node1/meminfo": "Node 1 MemFree: 33554432 kB\n",
		"sys/devices/system/node/online":        "0-1\n",
	}, math.MaxUint64)
	for _, c := range []struct{ node, msg string }{
		{"99", `NUMANode "99": no such node; this machine has nodes [0 1]`},
		{"-5", `NUMANode "-5"`},
		{"abc", `NUMANode "abc"`},
	} {
		for _, skip := range []bool{false, true} {
			_, err := newEngine(Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Backend: BackendHost, NUMANode: c.node, SkipMemoryCheck: skip}, engineHooks{sys: &sys})
			require.ErrorIs(t, err, ErrInvalidConfig, "node %s skip %v", c.node, skip)
			require.Contains(t, err.Error(), c.msg)
		}
	}
	e, err := newEngine(Config{PoolBytes: 1 << 20, Layout: smallLayout(8), Backend: BackendHost, NUMANode: "1", SkipMemoryCheck: true}, engineHooks{sys: &sys})
	if err == nil {
		require.NoError(t, e.Close())
	} else {
		// The fake node 1 may not exist on this machine: binding fails
		// later, but not as an invalid config.
		require.False(t, errors.Is(err, ErrInvalidConfig), "%v", err)
	}
}

// BenchmarkRefuseHugePool: refusing PoolBytes 2^62 (the example)
// takes well under 10 ms: nothing proportional to it is built.
func BenchmarkRefuseHugePool(b *testing.B) {
	for _, skip := range []bool{false, true} {
		b.Run(fmt.Sprintf("skip=%v", skip), func(b *testing.B) {
			cfg := Config{PoolBytes: 1 << 62, Layout: smallLayout(8), Backend: BackendHost, SkipMemoryCheck: skip}
			for b.Loop() {
				if _, err := newEngine(cfg, engineHooks{}); err == nil {
					b.Fatal("2^62 bytes accepted")
				}
			}
		})
	}
}
