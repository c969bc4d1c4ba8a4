package offload

import (
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/internal/memfit"
)

// system is what the engine reads about the machine: files under a root
// (tests point it at a fake /proc and /sys tree) and RLIMIT_MEMLOCK. The
// readings and the check are internal/memfit's, which the node shares.
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
	return system{fsys: os.DirFS("/"), fsysName: "/", memlock: memfit.HostMemlock, addrSpace: memfit.HostAddrSpace}
}

func (s system) fit() memfit.System {
	return memfit.System{FS: s.fsys, Memlock: s.memlock, AddrSpace: s.addrSpace}
}

func (s system) read(p string) ([]byte, error) { return s.fit().Read(p) }

// memAvailable is MemAvailable of /proc/meminfo.
func (s system) memAvailable() (int64, error) { return s.fit().MemAvailable() }

// checkFits refuses a pool of need bytes that the machine cannot hold
// (memfit.System.CheckFits: MemAvailable, the cgroup limit, RLIMIT_AS,
// RLIMIT_MEMLOCK when mlock pins the pool, and node's free memory when the
// pool is bound to a NUMA node; node < 0: not bound). The error wraps
// ErrInsufficientMemory and says how much is available and where the limit
// comes from; a NUMA node it cannot read wraps ErrInvalidConfig.
func (s system) checkFits(need int64, mlock bool, node int) error {
	err := s.fit().CheckFits(need, mlock, node)
	var short *memfit.Shortfall
	var bad *memfit.NodeError
	switch {
	case errors.As(err, &short):
		return fmt.Errorf("%w: %w", ErrInsufficientMemory, err)
	case errors.As(err, &bad):
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return err
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
	data, err := s.read(path.Join("/sys/bus/pci/devices", cudadev.SysfsBusID(busID), "numa_node"))
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || n < 0 {
		return -1
	}
	return n
}

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
