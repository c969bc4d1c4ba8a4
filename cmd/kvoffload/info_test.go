package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/offload"
)

// fakeRoot writes files under a temporary root for a prober.
func fakeRoot(t *testing.T, files map[string]string) string {
	root := t.TempDir()
	for name, body := range files {
		p := filepath.Join(root, name)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, []byte(body), 0o644))
	}
	return root
}

func TestInfoWithFakeDriver(t *testing.T) {
	drv := cudafake.New(cudafake.Options{DriverVersion: 13000})
	defer func() { require.NoError(t, drv.Close()) }()
	dev, err := drv.DeviceGet(0)
	require.NoError(t, err)
	bus, err := drv.DevicePCIBusID(dev)
	require.NoError(t, err)
	pci := "sys/bus/pci/devices/" + cuda.SysfsBusID(bus) + "/"
	root := fakeRoot(t, map[string]string{
		"proc/meminfo": "MemTotal:       131072000 kB\nMemAvailable:   120000000 kB\nHugePages_Total:       4\nHugePages_Free:        3\nHugepagesize:       2048 kB\n",
		"sys/kernel/mm/transparent_hugepage/enabled":       "always [madvise] never\n",
		"sys/kernel/mm/transparent_hugepage/defrag":        "[always] defer madvise never\n",
		"sys/kernel/mm/transparent_hugepage/shmem_enabled": "always within_size advise [never] deny force\n",
		"proc/self/cgroup":                      "0::/kvo/job\n",
		"sys/fs/cgroup/kvo/job/memory.max":      "max\n",
		"sys/fs/cgroup/kvo/memory.max":          "68719476736\n",
		"sys/devices/system/node/node0/meminfo": "",
		"sys/module/nvidia/version":             "580.159.04\n",
		pci + "current_link_speed":              "32.0 GT/s PCIe\n",
		pci + "max_link_speed":                  "32.0 GT/s PCIe\n",
		pci + "current_link_width":              "16\n",
		pci + "max_link_width":                  "16\n",
		pci + "numa_node":                       "-1\n",
	})
	p := prober{root: root, load: func() (cuda.Driver, error) { return drv, nil },
		memlock: func() (unix.Rlimit, error) { return unix.Rlimit{Cur: unix.RLIM_INFINITY}, nil }}
	m := p.collect(0)

	require.Equal(t, int64(131072000)<<10, m.Host.MemTotalBytes)
	require.Equal(t, "madvise", m.Host.THP)
	require.Equal(t, "always", m.Host.THPDefrag)
	require.Equal(t, "never", m.Host.ShmemTHP)
	require.Equal(t, "hugetlbfs, as far as the free pages go", m.Host.NodePoolPages, "3 hugetlbfs pages are free")
	require.Equal(t, int64(4), m.Host.HugePagesTotal)
	require.Equal(t, int64(2<<20), m.Host.HugePageBytes)
	require.Equal(t, int64(-1), m.Host.MemlockBytes)
	require.Equal(t, int64(64<<30), m.Host.CgroupMemoryBytes)
	require.Equal(t, "/sys/fs/cgroup/kvo/memory.max", m.Host.CgroupMemorySource)
	require.Equal(t, 1, m.Host.NUMANodes)

	require.True(t, m.CUDA.Available)
	require.Equal(t, "580.159.04", m.CUDA.DriverVersion)
	require.Equal(t, "13.0", m.CUDA.CUDAVersion)
	require.True(t, m.CUDA.BatchAPI)
	require.Len(t, m.CUDA.Devices, 1)
	d := m.CUDA.Devices[0]
	require.Empty(t, d.Error)
	require.Equal(t, 5, d.LinkGen)
	require.Equal(t, 16, d.LinkWidth)
	require.Equal(t, -1, d.NUMANode)
	require.Equal(t, "cuda", m.Backend.Name)

	var out bytes.Buffer
	require.NoError(t, m.print(&out))
	for _, w := range []string{"PCIe gen5 x16", "580.159.04 (CUDA 13.0)", "cuMemcpyBatchAsync bound", "auto picks  cuda", "unlimited", "64 GiB (/sys/fs/cgroup/kvo/memory.max)"} {
		require.Contains(t, out.String(), w)
	}

	m2 := p.collect(3)
	require.Equal(t, "host", m2.Backend.Name)
	require.Contains(t, m2.Backend.Reason, "device 3")
}

func TestInfoWithoutDriver(t *testing.T) {
	p := prober{root: fakeRoot(t, nil), load: func() (cuda.Driver, error) { return nil, cuda.ErrNoDriver },
		memlock: func() (unix.Rlimit, error) { return unix.Rlimit{Cur: 8 << 20}, nil }}
	m := p.collect(0)
	require.False(t, m.CUDA.Available)
	require.Equal(t, "host", m.Backend.Name)
	require.Contains(t, m.Backend.Reason, "driver not available")
	require.Equal(t, "unknown", m.Host.THP)
	require.Equal(t, int64(8<<20), m.Host.MemlockBytes)
	require.Equal(t, int64(-1), m.Host.CgroupMemoryBytes)
	var out bytes.Buffer
	require.NoError(t, m.print(&out))
	require.Contains(t, out.String(), "unavailable")
}

func TestInfoCommandJSON(t *testing.T) {
	code, out, errs := runCLI(t, "info", "--json")
	require.Equal(t, exitOK, code, errs)
	var m machineInfo
	require.NoError(t, json.Unmarshal([]byte(out), &m))
	require.Positive(t, m.Host.CPUs)
	require.Contains(t, []string{"cuda", "host"}, m.Backend.Name)

	code, out, _ = runCLI(t, "info")
	require.Equal(t, exitOK, code)
	require.Contains(t, out, "auto picks")
}

// TestNodePoolPages: which pages a node pool's regions get, by free
// hugetlbfs pages and shmem_enabled.
func TestNodePoolPages(t *testing.T) {
	require.Contains(t, nodePoolPages("never", 2), "hugetlbfs")
	require.Equal(t, "THP (shmem_enabled=advise)", nodePoolPages("advise", 0))
	require.Equal(t, "base pages (shmem_enabled=never)", nodePoolPages("never", 0))
	require.Contains(t, nodePoolPages("", 0), "unreadable")
}

func TestPCIeGen(t *testing.T) {
	for in, want := range map[string]int{"2.5 GT/s PCIe": 1, "8.0 GT/s PCIe": 3, "16 GT/s": 4, "32.0 GT/s PCIe": 5, "64.0 GT/s PCIe": 6, "Unknown": 0, "": 0, "7 GT/s": 0} {
		require.Equal(t, want, pcieGen(in), in)
	}
}

// TestInfoDisk: info --disk reports the records an engine's disk tier left
// in a directory (its mode, capacity and records by fingerprint), changing
// nothing there; text and JSON.
func TestInfoDisk(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	e, err := offload.New(offload.Config{PoolBytes: 4 * 8192, Backend: offload.BackendHost, SkipMemoryCheck: true,
		Layout: offload.LayoutSpec{Kind: offload.LayoutLayerSeparate, Layers: 2, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: 8},
		Disk:   &offload.DiskConfig{Dirs: []string{dir}, CapacityBytes: 16 * disk.SlotBytes(8192), AdmitAll: true}})
	require.NoError(t, err)
	tokens := make([]uint32, 6*16)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	keys := e.Keys(tokens)
	for i, k := range keys { // four slots: two blocks evicted to disk
		op, err := e.Store(ctx, []offload.Key{k}, []int{i}, offload.StoreOptions{})
		require.NoError(t, err)
		require.NoError(t, op.Wait(ctx))
	}
	require.NoError(t, e.FlushDisk(ctx))
	mode := e.Stats().Disk.Mode
	require.NoError(t, e.Close())
	before, err := os.ReadDir(dir)
	require.NoError(t, err)

	code, out, errs := runCLI(t, "info", "--json", "--disk", dir)
	require.Equal(t, exitOK, code, errs)
	var m machineInfo
	require.NoError(t, json.Unmarshal([]byte(out), &m))
	require.Len(t, m.Disk, 1)
	d := m.Disk[0]
	require.Empty(t, d.Error)
	require.Equal(t, mode, d.Mode)
	require.True(t, d.Writable)
	require.Len(t, d.Files, 1)
	require.Equal(t, int64(16), d.Files[0].CapacityRecords)
	require.Len(t, d.Files[0].Records, 1, "one fingerprint")
	for _, n := range d.Files[0].Records {
		require.Equal(t, int64(2), n)
	}

	code, out, errs = runCLI(t, "info", "--disk", dir)
	require.Equal(t, exitOK, code, errs)
	require.Contains(t, out, "Disk tier "+dir)
	require.Contains(t, out, "mode")
	require.Contains(t, out, mode+", writable")
	require.Contains(t, out, "16 records of")
	require.Contains(t, out, "records found")
	after, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Equal(t, len(before), len(after), "info changes nothing in the directory")

	code, out, _ = runCLI(t, "info", "--disk", filepath.Join(dir, "absent"))
	require.Equal(t, exitOK, code)
	require.Contains(t, out, "error")
}
