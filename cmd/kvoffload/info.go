package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cgroup"
	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/tier/disk"
)

var infoCommand = command{
	name:    "info",
	summary: "Print the driver, devices, PCIe links, NUMA, huge pages, memlock and cgroup limits, and the backend \"auto\" picks.",
	details: `Works without a GPU: the CUDA section then says why the driver is unavailable
and "auto" picks the host backend. With --disk, it also reports what the disk
tier would find in each directory (read only: nothing there is changed): the
I/O mode Open would use (direct or buffered), the records files with their
capacity, and the records found, by fingerprint.`,
	flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
		asJSON := fs.Bool("json", false, "print the facts as one JSON object")
		device := fs.Int("device", 0, "CUDA device ordinal `N` the auto backend would use")
		diskDirs := fs.String("disk", "", "report the disk tier in `dirs` (comma-separated), as the engine's Disk.Dirs")
		return func(_ context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			if *device < 0 {
				return fmt.Errorf("%w: --device %d must not be negative", errUsage, *device)
			}
			info := defaultProber().collect(*device)
			if *diskDirs != "" {
				for _, d := range strings.Split(*diskDirs, ",") {
					info.Disk = append(info.Disk, disk.Inspect(d))
				}
			}
			if *asJSON {
				return writeJSON(e.stdout, info)
			}
			return info.print(e.stdout)
		}
	},
}

// machineInfo is what info reports.
type machineInfo struct {
	Host    hostInfo    `json:"host"`
	CUDA    cudaInfo    `json:"cuda"`
	Backend backendInfo `json:"auto_backend"`
	// Disk is what --disk found in each directory.
	Disk []disk.DirInfo `json:"disk,omitempty"`
}

type hostInfo struct {
	CPUs              int    `json:"cpus"`
	MemTotalBytes     int64  `json:"mem_total_bytes"`
	MemAvailableBytes int64  `json:"mem_available_bytes"`
	THP               string `json:"thp"`        // the bracketed mode of transparent_hugepage/enabled
	THPDefrag         string `json:"thp_defrag"` // ... of transparent_hugepage/defrag
	// ShmemTHP is the bracketed mode of transparent_hugepage/shmem_enabled:
	// whether shared memory (a node pool's memfd regions) can get THP.
	ShmemTHP string `json:"shmem_thp"`
	// NodePoolPages is what a node pool (`kvoffload serve`) would map its
	// regions with here: hugetlbfs pages when some are free, else THP as
	// shmem_enabled allows, else base pages.
	NodePoolPages  string `json:"node_pool_pages"`
	HugePagesTotal int64  `json:"hugepages_total"`
	HugePagesFree  int64  `json:"hugepages_free"`
	HugePageBytes  int64  `json:"hugepage_bytes"`
	// MemlockBytes is RLIMIT_MEMLOCK's soft limit; -1 when unlimited.
	MemlockBytes int64 `json:"memlock_bytes"`
	// CgroupMemoryBytes is the smallest memory limit of the process's
	// cgroup and its ancestors; -1 when none is set.
	CgroupMemoryBytes  int64  `json:"cgroup_memory_bytes"`
	CgroupMemorySource string `json:"cgroup_memory_source,omitempty"`
	NUMANodes          int    `json:"numa_nodes"`
}

type cudaInfo struct {
	Available bool   `json:"available"`
	Error     string `json:"error,omitempty"`
	// DriverVersion is the kernel module's version (/sys/module/nvidia/version).
	DriverVersion string `json:"driver_version,omitempty"`
	// CUDAVersion is the CUDA version the driver API implements
	// (cuDriverGetVersion), e.g. "13.0".
	CUDAVersion string       `json:"cuda_version,omitempty"`
	BatchAPI    bool         `json:"batch_api"`
	Devices     []deviceInfo `json:"devices,omitempty"`
}

type deviceInfo struct {
	Ordinal           int    `json:"ordinal"`
	Name              string `json:"name"`
	ComputeCapability string `json:"compute_capability"`
	SMs               int    `json:"sms"`
	MemoryBytes       uint64 `json:"memory_bytes"`
	PCIBusID          string `json:"pci_bus_id"`
	// Link speed and width from sysfs (current and maximum); LinkGen is the
	// PCIe generation the speed corresponds to (0: unknown).
	LinkSpeed    string `json:"link_speed,omitempty"`
	LinkGen      int    `json:"link_gen"`
	LinkWidth    int    `json:"link_width"`
	MaxLinkGen   int    `json:"max_link_gen"`
	MaxLinkWidth int    `json:"max_link_width"`
	// NUMANode is the device's node from sysfs; -1: no affinity.
	NUMANode                 int    `json:"numa_node"`
	HostRegisterSupported    bool   `json:"host_register_supported"`
	HostPointerForRegistered bool   `json:"host_pointer_for_registered_mem"`
	Error                    string `json:"error,omitempty"`
}

type backendInfo struct {
	Name   string `json:"name"`
	Reason string `json:"reason"`
}

// prober reads the machine: files under root (sysfs and procfs), the CUDA
// driver through load, and RLIMIT_MEMLOCK through memlock. Tests replace
// all three.
type prober struct {
	root    string
	load    func() (cuda.Driver, error)
	memlock func() (unix.Rlimit, error)
}

func defaultProber() prober {
	return prober{root: "/", load: cuda.Load, memlock: func() (unix.Rlimit, error) {
		var r unix.Rlimit
		err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &r)
		return r, err
	}}
}

func (p prober) read(name string) (string, error) {
	b, err := os.ReadFile(filepath.Join(p.root, name))
	return strings.TrimSpace(string(b)), err
}

// collect gathers everything info reports. It never fails: what cannot be
// read is reported as unknown or with its error.
func (p prober) collect(device int) machineInfo {
	var m machineInfo
	m.Host = p.host()
	drv, err := p.load()
	if err != nil {
		m.CUDA.Error = err.Error()
		m.Backend = backendInfo{Name: "host", Reason: "CUDA unavailable: " + err.Error()}
		return m
	}
	m.CUDA = p.cuda(drv)
	m.Backend = autoBackend(m.CUDA, device)
	return m
}

// autoBackend says what Config.Backend "auto" picks for device: CUDA when
// the driver loaded and the device answers, else the host backend.
func autoBackend(c cudaInfo, device int) backendInfo {
	switch {
	case !c.Available:
		return backendInfo{Name: "host", Reason: "CUDA unavailable: " + c.Error}
	case device >= len(c.Devices):
		return backendInfo{Name: "host", Reason: fmt.Sprintf("device %d asked for, the driver sees %d device(s)", device, len(c.Devices))}
	case c.Devices[device].Error != "":
		return backendInfo{Name: "host", Reason: fmt.Sprintf("device %d: %s", device, c.Devices[device].Error)}
	}
	return backendInfo{Name: "cuda", Reason: fmt.Sprintf("libcuda loaded, device %d at PCI %s", device, c.Devices[device].PCIBusID)}
}

func (p prober) host() hostInfo {
	h := hostInfo{CPUs: runtime.NumCPU(), MemlockBytes: -1, CgroupMemoryBytes: -1}
	if mi, err := p.read("proc/meminfo"); err == nil {
		h.MemTotalBytes = meminfoBytes(mi, "MemTotal")
		h.MemAvailableBytes = meminfoBytes(mi, "MemAvailable")
		h.HugePagesTotal = meminfoBytes(mi, "HugePages_Total")
		h.HugePagesFree = meminfoBytes(mi, "HugePages_Free")
		h.HugePageBytes = meminfoBytes(mi, "Hugepagesize")
	}
	h.THP = p.bracketed("sys/kernel/mm/transparent_hugepage/enabled")
	h.THPDefrag = p.bracketed("sys/kernel/mm/transparent_hugepage/defrag")
	h.ShmemTHP = p.bracketed("sys/kernel/mm/transparent_hugepage/shmem_enabled")
	h.NodePoolPages = nodePoolPages(h.ShmemTHP, h.HugePagesFree)
	if r, err := p.memlock(); err == nil && r.Cur != unix.RLIM_INFINITY {
		h.MemlockBytes = int64(min(r.Cur, math.MaxInt64))
	}
	h.CgroupMemoryBytes, h.CgroupMemorySource = p.cgroupLimit()
	if nodes, err := filepath.Glob(filepath.Join(p.root, "sys/devices/system/node/node[0-9]*")); err == nil {
		h.NUMANodes = len(nodes)
	}
	return h
}

// meminfoBytes returns field of /proc/meminfo in bytes (kB values are
// converted; counts such as HugePages_Total are returned as they are).
func meminfoBytes(meminfo, field string) int64 {
	sc := bufio.NewScanner(strings.NewReader(meminfo))
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok || name != field {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			return 0
		}
		n, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0
		}
		if len(f) > 1 && f[1] == "kB" {
			n <<= 10
		}
		return n
	}
	return 0
}

// bracketed returns the [selected] word of a sysfs choice file, or
// "unknown".
func (p prober) bracketed(name string) string {
	s, err := p.read(name)
	if err != nil {
		return "unknown"
	}
	if i := strings.IndexByte(s, '['); i >= 0 {
		if j := strings.IndexByte(s[i:], ']'); j > 0 {
			return s[i+1 : i+j]
		}
	}
	return s
}

// cgroupLimit returns the smallest memory limit (v2 memory.max or v1
// memory.limit_in_bytes) of the process's cgroup and its ancestors, and
// the file it comes from; -1 when none is set.
func (p prober) cgroupLimit() (int64, string) {
	levels, err := cgroup.Levels(func(name string) ([]byte, error) {
		return os.ReadFile(filepath.Join(p.root, name))
	})
	if err != nil {
		return -1, ""
	}
	best, where := int64(-1), ""
	for _, lv := range levels {
		if !lv.Unlimited && (best < 0 || lv.Limit < best) {
			best, where = lv.Limit, lv.LimitFile
		}
	}
	return best, where
}

func (p prober) cuda(drv cuda.Driver) cudaInfo {
	c := cudaInfo{Available: true, BatchAPI: drv.HasMemcpyBatch()}
	if v, err := p.read("sys/module/nvidia/version"); err == nil {
		c.DriverVersion = v
	}
	if v, err := drv.DriverVersion(); err == nil {
		c.CUDAVersion = fmt.Sprintf("%d.%d", v/1000, v%1000/10)
	}
	n, err := drv.DeviceCount()
	if err != nil {
		c.Available, c.Error = false, "counting devices: "+err.Error()
		return c
	}
	if n == 0 {
		c.Available, c.Error = false, "the driver sees no device"
		return c
	}
	for i := range n {
		c.Devices = append(c.Devices, p.device(drv, i))
	}
	return c
}

func (p prober) device(drv cuda.Driver, ordinal int) deviceInfo {
	d := deviceInfo{Ordinal: ordinal, NUMANode: -1}
	dev, err := drv.DeviceGet(ordinal)
	if err != nil {
		d.Error = err.Error()
		return d
	}
	var errs []error
	attr := func(a cuda.Attribute) int {
		v, err := drv.DeviceAttribute(a, dev)
		errs = append(errs, err)
		return v
	}
	d.Name, err = drv.DeviceName(dev)
	errs = append(errs, err)
	d.ComputeCapability = fmt.Sprintf("%d.%d", attr(cuda.AttrComputeCapabilityMajor), attr(cuda.AttrComputeCapabilityMinor))
	d.SMs = attr(cuda.AttrMultiprocessorCount)
	d.HostRegisterSupported = attr(cuda.AttrHostRegisterSupported) == 1
	d.HostPointerForRegistered = attr(cuda.AttrCanUseHostPointerForRegisteredMem) == 1
	d.MemoryBytes, err = drv.DeviceTotalMem(dev)
	errs = append(errs, err)
	d.PCIBusID, err = drv.DevicePCIBusID(dev)
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		d.Error = err.Error()
	}
	if d.PCIBusID == "" {
		return d
	}
	dir := filepath.Join("sys/bus/pci/devices", cuda.SysfsBusID(d.PCIBusID))
	if s, err := p.read(filepath.Join(dir, "current_link_speed")); err == nil {
		d.LinkSpeed = s
		d.LinkGen = pcieGen(s)
	}
	if s, err := p.read(filepath.Join(dir, "max_link_speed")); err == nil {
		d.MaxLinkGen = pcieGen(s)
	}
	d.LinkWidth = p.readInt(filepath.Join(dir, "current_link_width"), 0)
	d.MaxLinkWidth = p.readInt(filepath.Join(dir, "max_link_width"), 0)
	d.NUMANode = max(p.readInt(filepath.Join(dir, "numa_node"), -1), -1)
	return d
}

func (p prober) readInt(name string, dflt int) int {
	s, err := p.read(name)
	if err != nil {
		return dflt
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		return dflt
	}
	return n
}

// pcieGen maps a sysfs link speed ("32.0 GT/s PCIe", "16 GT/s") to the PCIe
// generation; 0 when unknown.
func pcieGen(speed string) int {
	f := strings.Fields(speed)
	if len(f) == 0 {
		return 0
	}
	gt, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return 0
	}
	for gen, s := range []float64{2.5, 5, 8, 16, 32, 64, 128} {
		if math.Abs(gt-s) < 0.01 {
			return gen + 1
		}
	}
	return 0
}

func (m machineInfo) print(w io.Writer) error {
	var b bytes.Buffer
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	row := func(k, format string, args ...any) { fmt.Fprintf(tw, "%s\t"+format+"\n", append([]any{k}, args...)...) }
	h := m.Host
	fmt.Fprintln(tw, "Host")
	row("  CPUs", "%d", h.CPUs)
	row("  memory", "%s total, %s available", formatSize(h.MemTotalBytes), formatSize(h.MemAvailableBytes))
	row("  NUMA nodes", "%d", h.NUMANodes)
	row("  THP", "enabled=%s defrag=%s", h.THP, h.THPDefrag)
	row("  hugetlbfs pages", "%d total, %d free, %s each", h.HugePagesTotal, h.HugePagesFree, formatSize(h.HugePageBytes))
	row("  shared memory THP", "shmem_enabled=%s (a node pool's pages: %s)", h.ShmemTHP, h.NodePoolPages)
	row("  RLIMIT_MEMLOCK", "%s", limitString(h.MemlockBytes))
	cg := limitString(h.CgroupMemoryBytes)
	if h.CgroupMemorySource != "" {
		cg += " (" + h.CgroupMemorySource + ")"
	}
	row("  cgroup memory limit", "%s", cg)
	fmt.Fprintln(tw, "CUDA")
	c := m.CUDA
	if !c.Available {
		row("  driver", "unavailable: %s", c.Error)
	} else {
		drvVer := c.DriverVersion
		if drvVer == "" {
			drvVer = "unknown"
		}
		row("  driver", "%s (CUDA %s)", drvVer, c.CUDAVersion)
		row("  batch copy API", "%s", yesNo(c.BatchAPI, "cuMemcpyBatchAsync bound", "absent (driver < 12.8)"))
		for _, d := range c.Devices {
			row(fmt.Sprintf("  device %d", d.Ordinal), "%s, sm_%s, %d SMs, %s", d.Name, strings.ReplaceAll(d.ComputeCapability, ".", ""), d.SMs, formatSize(int64(d.MemoryBytes)))
			link := "unknown (no sysfs entry)"
			if d.LinkWidth > 0 || d.LinkGen > 0 {
				link = fmt.Sprintf("PCIe gen%d x%d (max gen%d x%d)", d.LinkGen, d.LinkWidth, d.MaxLinkGen, d.MaxLinkWidth)
			}
			row("    PCI", "%s, %s", d.PCIBusID, link)
			numa := "none (sysfs numa_node -1)"
			if d.NUMANode >= 0 {
				numa = strconv.Itoa(d.NUMANode)
			}
			row("    NUMA node", "%s", numa)
			row("    host memory", "register %s, host pointer usable by kernels %s", yesNo(d.HostRegisterSupported, "supported", "unsupported"), yesNo(d.HostPointerForRegistered, "yes", "no"))
			if d.Error != "" {
				row("    error", "%s", d.Error)
			}
		}
	}
	fmt.Fprintln(tw, "Backend")
	row("  auto picks", "%s: %s", m.Backend.Name, m.Backend.Reason)
	for _, d := range m.Disk {
		fmt.Fprintf(tw, "Disk tier %s\n", d.Dir)
		if d.Error != "" {
			row("  error", "%s", d.Error)
		}
		row("  mode", "%s, %s", d.Mode, yesNo(d.Writable, "writable", "read-only (records served, none written)"))
		if d.Holder != "" {
			row("  in use by", "%s", d.Holder)
		}
		if len(d.Files) == 0 {
			row("  records file", "none yet (created at the engine's start)")
		}
		for _, f := range d.Files {
			row("  "+filepath.Base(f.Path), "%s, %d records of %s", formatSize(f.FileBytes), f.CapacityRecords, formatSize(f.SlotBytes))
			var total int64
			fps := make([]string, 0, len(f.Records))
			for fp, n := range f.Records {
				total += n
				fps = append(fps, fmt.Sprintf("%d of %s", n, fp))
			}
			sort.Strings(fps)
			found := fmt.Sprintf("%d", total)
			if len(fps) > 0 {
				found += " (by fingerprint: " + strings.Join(fps, ", ") + ")"
			}
			row("    records found", "%s; %d damaged", found, f.Damaged)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := w.Write(b.Bytes())
	return err
}

func limitString(n int64) string {
	if n < 0 {
		return "unlimited"
	}
	return formatSize(n)
}

func yesNo(b bool, yes, no string) string {
	if b {
		return yes
	}
	return no
}

// writeJSON writes v as indented JSON followed by a newline.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// nodePoolPages says which pages a node pool's memfd regions get on a host
// whose shmem_enabled mode is shmem and with free hugetlbfs pages free
// (nodepool.Server's choice, before it maps: it reports what it got).
func nodePoolPages(shmem string, free int64) string {
	switch {
	case free > 0:
		return "hugetlbfs, as far as the free pages go"
	case shmem == "always" || shmem == "within_size" || shmem == "advise":
		return "THP (shmem_enabled=" + shmem + ")"
	case shmem == "":
		return "base pages (shmem_enabled unreadable)"
	}
	return "base pages (shmem_enabled=" + shmem + ")"
}
