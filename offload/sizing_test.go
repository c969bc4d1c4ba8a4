package offload

import (
	"context"
	"math"
	"testing"
	"testing/fstest"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/mmapmem"
)

func fakeSystem(files map[string]string, memlock uint64) system {
	m := fstest.MapFS{}
	for p, c := range files {
		m[p] = &fstest.MapFile{Data: []byte(c)}
	}
	return system{fsys: m, fsysName: "fake", memlock: func() (uint64, error) { return memlock, nil }}
}

const meminfo64G = "MemTotal:       131072000 kB\nMemFree:        70000000 kB\nMemAvailable:   67108864 kB\n"

func TestCheckFits(t *testing.T) {
	const gib = int64(1) << 30
	for _, tc := range []struct {
		name    string
		files   map[string]string
		memlock uint64
		need    int64
		mlock   bool
		node    int
		msg     string // "" = fits
	}{
		{"fits", map[string]string{"proc/meminfo": meminfo64G}, math.MaxUint64, 32 * gib, false, -1, ""},
		{"MemAvailable", map[string]string{"proc/meminfo": meminfo64G}, math.MaxUint64, 80 * gib, false, -1, "MemAvailable in /proc/meminfo allows 68719476736 bytes (64.00 GiB)"},
		{"cgroup v2", map[string]string{
			"proc/meminfo":                               meminfo64G,
			"proc/self/cgroup":                           "0::/kubepods/pod1\n",
			"sys/fs/cgroup/kubepods/pod1/memory.max":     "17179869184\n",
			"sys/fs/cgroup/kubepods/pod1/memory.current": "1073741824\n",
		}, math.MaxUint64, 32 * gib, false, -1, "memory.max (minus usage) allows 16106127360 bytes (15.00 GiB)"},
		{"cgroup v2 parent", map[string]string{
			"proc/meminfo":                 meminfo64G,
			"proc/self/cgroup":             "0::/a/b\n",
			"sys/fs/cgroup/a/b/memory.max": "max\n",
			"sys/fs/cgroup/a/memory.max":   "8589934592\n",
		}, math.MaxUint64, 32 * gib, false, -1, "/sys/fs/cgroup/a/memory.max"},
		{"cgroup v2 unlimited", map[string]string{
			"proc/meminfo":               meminfo64G,
			"proc/self/cgroup":           "0::/x\n",
			"sys/fs/cgroup/x/memory.max": "max\n",
		}, math.MaxUint64, 32 * gib, false, -1, ""},
		{"cgroup v1", map[string]string{
			"proc/meminfo":     meminfo64G,
			"proc/self/cgroup": "12:cpu,cpuacct:/x\n9:memory:/docker/abc\n",
			"sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": "4294967296\n",
		}, math.MaxUint64, 8 * gib, false, -1, "memory.limit_in_bytes (minus usage) allows 4294967296 bytes"},
		{"cgroup v1 unlimited", map[string]string{
			"proc/meminfo":     meminfo64G,
			"proc/self/cgroup": "9:memory:/\n",
			"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
		}, math.MaxUint64, 8 * gib, false, -1, ""},
		{"memlock", map[string]string{"proc/meminfo": meminfo64G}, 64 << 10, gib, true, -1, "RLIMIT_MEMLOCK"},
		{"memlock ignored without mlock", map[string]string{"proc/meminfo": meminfo64G}, 64 << 10, gib, false, -1, ""},
		{"numa node", map[string]string{
			"proc/meminfo":                          meminfo64G,
			"sys/devices/system/node/node1/meminfo": "Node 1 MemTotal: 67108864 kB\nNode 1 MemFree: 4194304 kB\n",
		}, math.MaxUint64, 8 * gib, false, 1, "MemFree of NUMA node 1 allows 4294967296 bytes"},
		{"numa node fits", map[string]string{
			"proc/meminfo":                          meminfo64G,
			"sys/devices/system/node/node0/meminfo": "Node 0 MemFree: 33554432 kB\n",
		}, math.MaxUint64, 8 * gib, false, 0, ""},
		{"numa node missing", map[string]string{"proc/meminfo": meminfo64G}, math.MaxUint64, gib, false, 5, "NUMA node 5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := fakeSystem(tc.files, tc.memlock).checkFits(tc.need, tc.mlock, tc.node)
			if tc.msg == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.msg)
			if tc.name != "numa node missing" {
				require.ErrorIs(t, err, ErrInsufficientMemory)
			}
		})
	}
}

func TestGPUNUMANode(t *testing.T) {
	s := fakeSystem(map[string]string{
		"sys/bus/pci/devices/0000:19:00.0/numa_node": "1\n",
		"sys/bus/pci/devices/0000:00:06.0/numa_node": "-1\n",
	}, 0)
	require.Equal(t, 1, s.gpuNUMANode("0000:19:00.0"))
	require.Equal(t, 1, s.gpuNUMANode("00000000:19:00.0"), "nvidia-smi form")
	require.Equal(t, -1, s.gpuNUMANode("00000000:00:06.0"), "sysfs -1: no affinity (the H200 VM)")
	require.Equal(t, -1, s.gpuNUMANode("0000:AA:00.0"), "no such device")
}

func TestHostSystemReads(t *testing.T) {
	s := hostSystem()
	avail, err := s.memAvailable()
	require.NoError(t, err)
	require.Positive(t, avail)
	lim, err := s.memlock()
	require.NoError(t, err)
	require.Positive(t, lim)
}

// TestGrowthRechecksMemory: growth re-reads the machine's memory before
// each region and stops (Stats.Pool.GrowthError) when the region plus the
// headroom no longer fits (other ranks pinned meanwhile), keeping what it
// has; New's check of the whole pool passed when it ran.
func TestGrowthRechecksMemory(t *testing.T) {
	slot := int64(8 << 10)
	fsys := fstest.MapFS{"proc/meminfo": &fstest.MapFile{Data: []byte("MemAvailable: 1048576 kB\n")}} // 1 GiB
	hooks := engineHooks{sys: &system{fsys: fsys}, growStep: func(i int, s growStep, _ *mmapmem.Region) error {
		if i == 1 && s == stepPrefaulted {
			// Other processes took the memory: 40 KiB left (the headroom is 32 KiB).
			fsys["proc/meminfo"] = &fstest.MapFile{Data: []byte("MemAvailable: 40 kB\n")}
		}
		return nil
	}}
	e, err := newEngine(Config{PoolBytes: 32 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot, StagingBytes: -1,
		MemoryHeadroomBytes: 32 << 10, NUMANode: numaNone, Layout: smallLayout(8), Backend: BackendHost}, hooks)
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	err = e.WaitGrown(context.Background())
	require.ErrorIs(t, err, ErrInsufficientMemory)
	require.ErrorContains(t, err, "growth stopped before a region of 65536 bytes (with 32768 bytes of headroom kept)")
	st := e.Stats()
	require.Equal(t, 16*slot, st.Pool.OwnedBytes, "regions 0 and 1 kept")
	require.Contains(t, st.Pool.GrowthError, "MemAvailable")
}
