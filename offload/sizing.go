package offload

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cgroup"
	"github.com/kvoffload/kvoffload/transfer"
)

// system is what the engine reads about the machine: files under a root
// (tests point it at a fake /proc and /sys tree) and RLIMIT_MEMLOCK.
type system struct {
	fsys    fs.FS
	memlock func() (uint64, error) // soft RLIMIT_MEMLOCK; math.MaxUint64 for unlimited
	// addrSpace returns the address space the soft RLIMIT_AS leaves the
	// process (the limit minus VmSize); ok is false without a limit. Nil:
	// not checked.
	addrSpace func() (room int64, ok bool)
	fsysName  string // for messages
}

func hostSystem() system {
	return system{fsys: os.DirFS("/"), fsysName: "/", memlock: func() (uint64, error) {
		var r unix.Rlimit
		if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &r); err != nil {
			return 0, fmt.Errorf("getrlimit(RLIMIT_MEMLOCK): %w", err)
		}
		if r.Cur == unix.RLIM_INFINITY {
			return math.MaxUint64, nil
		}
		return r.Cur, nil
	}, addrSpace: hostAddrSpace}
}

// hostAddrSpace is system.addrSpace of this process: the soft RLIMIT_AS
// minus VmSize of /proc/self/status.
func hostAddrSpace() (int64, bool) {
	var r unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_AS, &r); err != nil || r.Cur == unix.RLIM_INFINITY || r.Cur > math.MaxInt64 {
		return 0, false
	}
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, false
	}
	used, ok := meminfoField(data, "VmSize")
	if !ok {
		return 0, false
	}
	return max(int64(r.Cur)-used, 0), true
}

func (s system) read(p string) ([]byte, error) {
	return fs.ReadFile(s.fsys, strings.TrimPrefix(p, "/"))
}

// meminfoField returns a "Name: N kB" field of a meminfo file in bytes.
func meminfoField(data []byte, name string) (int64, bool) {
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		// "MemAvailable: N kB" or, per node, "Node 0 MemFree: N kB".
		for i := 0; i+1 < len(f); i++ {
			if f[i] == name+":" {
				v, err := strconv.ParseInt(f[i+1], 10, 64)
				if err != nil {
					return 0, false
				}
				if i+2 < len(f) && f[i+2] == "kB" {
					v *= 1024
				}
				return v, true
			}
		}
	}
	return 0, false
}

// memAvailable is MemAvailable of /proc/meminfo.
func (s system) memAvailable() (int64, error) {
	data, err := s.read("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	v, ok := meminfoField(data, "MemAvailable")
	if !ok {
		return 0, errors.New("/proc/meminfo has no MemAvailable")
	}
	return v, nil
}

// nodeFree is MemFree of NUMA node n.
func (s system) nodeFree(n int) (int64, error) {
	p := fmt.Sprintf("/sys/devices/system/node/node%d/meminfo", n)
	data, err := s.read(p)
	if err != nil {
		return 0, err
	}
	v, ok := meminfoField(data, "MemFree")
	if !ok {
		return 0, fmt.Errorf("%s has no MemFree", p)
	}
	return v, nil
}

// cgroupRoom returns the memory the process's cgroup (and its ancestors)
// still allows: the smallest limit minus usage (usage counted as 0 when
// unknown); ok is false when no limit is set. It reads cgroup v2
// (memory.max, memory.current) and v1 (memory.limit_in_bytes,
// memory.usage_in_bytes).
func (s system) cgroupRoom() (room int64, where string, ok bool) {
	levels, err := cgroup.Levels(s.read)
	if err != nil {
		return 0, "", false
	}
	room = math.MaxInt64
	for _, lv := range levels {
		if lv.Unlimited {
			continue
		}
		if r := max(lv.Limit-lv.Usage, 0); r < room {
			room, where, ok = r, lv.LimitFile, true
		}
	}
	return room, where, ok
}

// checkFits refuses a pool of need bytes that the machine cannot hold:
// MemAvailable, the cgroup limit, RLIMIT_MEMLOCK when mlock pins the pool,
// and node's free memory when the pool is bound to a NUMA node (node < 0:
// not bound). The error wraps ErrInsufficientMemory and says how much is
// available and where the limit comes from.
func (s system) checkFits(need int64, mlock bool, node int) error {
	refuse := func(avail int64, what string) error {
		return fmt.Errorf("%w: %d bytes (%.2f GiB) needed, %s allows %d bytes (%.2f GiB)",
			ErrInsufficientMemory, need, gib(need), what, avail, gib(avail))
	}
	if avail, err := s.memAvailable(); err == nil && avail < need {
		return refuse(avail, "MemAvailable in /proc/meminfo")
	}
	if room, where, ok := s.cgroupRoom(); ok && room < need {
		return refuse(room, "the cgroup limit "+where+" (minus usage)")
	}
	if s.addrSpace != nil {
		if room, ok := s.addrSpace(); ok && room < need {
			return refuse(room, "RLIMIT_AS (ulimit -v) minus the process's VmSize")
		}
	}
	if mlock && s.memlock != nil {
		lim, err := s.memlock()
		if err != nil {
			return err
		}
		if lim < uint64(need) {
			return refuse(int64(lim), "RLIMIT_MEMLOCK (raise it with ulimit -l, or use HostPinning \"none\")")
		}
	}
	if node >= 0 {
		free, err := s.nodeFree(node)
		if err != nil {
			return fmt.Errorf("%w: NUMA node %d: %w", ErrInvalidConfig, node, err)
		}
		if free < need {
			return refuse(free, fmt.Sprintf("MemFree of NUMA node %d", node))
		}
	}
	return nil
}

// checkNode refuses a NUMA node the machine does not have, with an error
// wrapping ErrInvalidConfig that names the node and the nodes that exist
// (the nodeN entries of /sys/devices/system/node).
func (s system) checkNode(node int) error {
	const dir = "/sys/devices/system/node"
	ents, err := fs.ReadDir(s.fsys, strings.TrimPrefix(dir, "/"))
	var nodes []int
	for _, e := range ents {
		if n, err := strconv.Atoi(strings.TrimPrefix(e.Name(), "node")); err == nil && strings.HasPrefix(e.Name(), "node") && n >= 0 {
			if n == node {
				return nil
			}
			nodes = append(nodes, n)
		}
	}
	if err != nil || len(nodes) == 0 {
		return fmt.Errorf("%w: NUMANode %q: this machine has no NUMA nodes under %s", ErrInvalidConfig, strconv.Itoa(node), dir)
	}
	slices.Sort(nodes)
	return fmt.Errorf("%w: NUMANode %q: no such node; this machine has nodes %v (%s)", ErrInvalidConfig, strconv.Itoa(node), nodes, dir)
}

// gpuNUMANode returns the NUMA node of the PCI device busID from
// /sys/bus/pci/devices/<bus id>/numa_node, or -1 when sysfs says none (-1)
// or has no such file.
func (s system) gpuNUMANode(busID string) int {
	data, err := s.read(path.Join("/sys/bus/pci/devices", transfer.SysfsBusID(busID), "numa_node"))
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || n < 0 {
		return -1
	}
	return n
}

func gib(n int64) float64 { return float64(n) / (1 << 30) }

// addSizes is a+b for non-negative sizes, false on overflow.
func addSizes(a, b int64) (int64, bool) {
	if a > math.MaxInt64-b {
		return 0, false
	}
	return a + b, true
}

// mulSizes is a×b for non-negative sizes, false on overflow.
func mulSizes(a, b int64) (int64, bool) {
	if a < 0 || b < 0 {
		return 0, false
	}
	if a != 0 && b > math.MaxInt64/a {
		return 0, false
	}
	return a * b, true
}
