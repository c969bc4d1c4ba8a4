// Package memfit checks that a pool of host memory fits the machine before
// any of it is mapped: MemAvailable, the memory cgroup's limit (every level,
// v1 and v2), RLIMIT_AS, RLIMIT_MEMLOCK when the pool is mlock'ed, and the
// free memory of a NUMA node it is bound to. The embedded engine (package
// offload) and the node (package nodepool) run the same check.
//
// What it reads comes through System, so that tests inject the readings (a
// fake /proc and /sys tree, a memlock limit) instead of needing root for a
// cgroup.
package memfit

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cgroup"
)

// System is what the check reads about the machine.
type System struct {
	// FS holds /proc and /sys (paths without the leading slash).
	FS fs.FS
	// Memlock returns the soft RLIMIT_MEMLOCK (math.MaxUint64 for
	// unlimited). Nil: not checked.
	Memlock func() (uint64, error)
	// AddrSpace returns the address space the soft RLIMIT_AS leaves the
	// process (the limit minus VmSize); ok is false without a limit. Nil:
	// not checked.
	AddrSpace func() (room int64, ok bool)
}

// Host is this machine and process.
func Host() System {
	return System{FS: os.DirFS("/"), Memlock: HostMemlock, AddrSpace: HostAddrSpace}
}

// HostMemlock is the soft RLIMIT_MEMLOCK of this process.
func HostMemlock() (uint64, error) {
	var r unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &r); err != nil {
		return 0, fmt.Errorf("getrlimit(RLIMIT_MEMLOCK): %w", err)
	}
	if r.Cur == unix.RLIM_INFINITY {
		return math.MaxUint64, nil
	}
	return r.Cur, nil
}

// HostAddrSpace is System.AddrSpace of this process: the soft RLIMIT_AS
// minus VmSize of /proc/self/status.
func HostAddrSpace() (int64, bool) {
	var r unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_AS, &r); err != nil || r.Cur == unix.RLIM_INFINITY || r.Cur > math.MaxInt64 {
		return 0, false
	}
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, false
	}
	used, ok := MeminfoField(data, "VmSize")
	if !ok {
		return 0, false
	}
	return max(int64(r.Cur)-used, 0), true
}

// Read reads a file of s.FS by its absolute path.
func (s System) Read(p string) ([]byte, error) {
	return fs.ReadFile(s.FS, strings.TrimPrefix(p, "/"))
}

// MeminfoField returns a "Name: N kB" field of a meminfo file in bytes.
func MeminfoField(data []byte, name string) (int64, bool) {
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

// MemAvailable is MemAvailable of /proc/meminfo.
func (s System) MemAvailable() (int64, error) {
	data, err := s.Read("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	v, ok := MeminfoField(data, "MemAvailable")
	if !ok {
		return 0, errors.New("/proc/meminfo has no MemAvailable")
	}
	return v, nil
}

// HugePagesFree is the free huge pages of the default size in bytes
// (HugePages_Free times Hugepagesize of /proc/meminfo): memory a hugetlbfs
// mapping takes from the huge page pool, not from MemAvailable. 0 when
// unknown.
func (s System) HugePagesFree() int64 {
	data, err := s.Read("/proc/meminfo")
	if err != nil {
		return 0
	}
	n, ok1 := MeminfoField(data, "HugePages_Free")
	size, ok2 := MeminfoField(data, "Hugepagesize")
	if !ok1 || !ok2 || n <= 0 || size <= 0 || n > math.MaxInt64/size {
		return 0
	}
	return n * size
}

// NodeFree is MemFree of NUMA node n.
func (s System) NodeFree(n int) (int64, error) {
	p := fmt.Sprintf("/sys/devices/system/node/node%d/meminfo", n)
	data, err := s.Read(p)
	if err != nil {
		return 0, err
	}
	v, ok := MeminfoField(data, "MemFree")
	if !ok {
		return 0, fmt.Errorf("%s has no MemFree", p)
	}
	return v, nil
}

// CgroupRoom returns the memory the process's cgroup (and its ancestors)
// still allows: the smallest limit minus usage (usage counted as 0 when
// unknown), and the limit's file; ok is false when no limit is set. It
// reads cgroup v2 (memory.max, memory.current) and v1
// (memory.limit_in_bytes, memory.usage_in_bytes).
func (s System) CgroupRoom() (room int64, where string, ok bool) {
	levels, err := cgroup.Levels(s.Read)
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

// Shortfall is CheckFits' refusal: Need bytes asked for, Avail allowed by
// What (in words, naming the file or limit).
type Shortfall struct {
	Need, Avail int64
	What        string
}

func (e *Shortfall) Error() string {
	return fmt.Sprintf("%d bytes (%.2f GiB) needed, %s allows %d bytes (%.2f GiB)",
		e.Need, GiB(e.Need), e.What, e.Avail, GiB(e.Avail))
}

// NodeError is CheckFits' error when the NUMA node's free memory cannot be
// read (no such node).
type NodeError struct {
	Node int
	Err  error
}

func (e *NodeError) Error() string { return fmt.Sprintf("NUMA node %d: %v", e.Node, e.Err) }
func (e *NodeError) Unwrap() error { return e.Err }

// CheckFits refuses a pool of need bytes that the machine cannot hold:
// MemAvailable, the cgroup limit, RLIMIT_AS, RLIMIT_MEMLOCK when mlock pins
// the pool, and node's free memory when the pool is bound to a NUMA node
// (node < 0: not bound). A refusal is a *Shortfall saying how much is
// available and where the limit comes from; a node whose memory cannot be
// read is a *NodeError. Readings that are missing (no /proc/meminfo, no
// cgroup limit) check nothing.
func (s System) CheckFits(need int64, mlock bool, node int) error {
	refuse := func(avail int64, what string) error {
		return &Shortfall{Need: need, Avail: avail, What: what}
	}
	if avail, err := s.MemAvailable(); err == nil && avail < need {
		return refuse(avail, "MemAvailable in /proc/meminfo")
	}
	if room, where, ok := s.CgroupRoom(); ok && room < need {
		return refuse(room, "the cgroup limit "+where+" (minus usage)")
	}
	if s.AddrSpace != nil {
		if room, ok := s.AddrSpace(); ok && room < need {
			return refuse(room, "RLIMIT_AS (ulimit -v) minus the process's VmSize")
		}
	}
	if mlock && s.Memlock != nil {
		lim, err := s.Memlock()
		if err != nil {
			return err
		}
		if lim < uint64(need) {
			return refuse(int64(min(lim, math.MaxInt64)), "RLIMIT_MEMLOCK (raise it with ulimit -l, or use HostPinning \"none\")")
		}
	}
	if node >= 0 {
		free, err := s.NodeFree(node)
		if err != nil {
			return &NodeError{Node: node, Err: err}
		}
		if free < need {
			return refuse(free, fmt.Sprintf("MemFree of NUMA node %d", node))
		}
	}
	return nil
}

// GiB is n in GiB, for messages.
func GiB(n int64) float64 { return float64(n) / (1 << 30) }
