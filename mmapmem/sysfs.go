package mmapmem

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// defaultTHPSize is the PMD huge-page size of x86-64 and arm64 with 4 KiB
// pages, used when the kernel does not report it.
const defaultTHPSize = 2 << 20

// sysfs reads the kernel's memory reports under a root directory.
type sysfs struct{ root string }

func (s sysfs) path(p string) string {
	if s.root == "" {
		return p
	}
	return filepath.Join(s.root, p)
}

// meminfo parses a meminfo file: "Key: value [kB]" lines, optionally
// prefixed by "Node N " (per-node files). Values in kB are returned in bytes;
// unitless values (page counts) as they are.
func (s sysfs) meminfo(p string) (map[string]int64, error) {
	data, err := os.ReadFile(s.path(p))
	if err != nil {
		return nil, fmt.Errorf("mmapmem: read memory report: %w", err)
	}
	out := make(map[string]int64)
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "Node" {
			fields = fields[2:]
		}
		if len(fields) < 2 || !strings.HasSuffix(fields[0], ":") {
			continue
		}
		v, err := strconv.ParseInt(fields[1], 10, 64)
		if err != nil {
			continue
		}
		if len(fields) >= 3 && fields[2] == "kB" {
			v *= 1024
		}
		out[strings.TrimSuffix(fields[0], ":")] = v
	}
	return out, nil
}

func (s sysfs) field(p, key string) (int64, error) {
	m, err := s.meminfo(p)
	if err != nil {
		return 0, err
	}
	v, ok := m[key]
	if !ok {
		return 0, fmt.Errorf("mmapmem: %s has no %s line", s.path(p), key)
	}
	return v, nil
}

// nodes lists the NUMA nodes the kernel reports, sorted.
func (s sysfs) nodes() ([]int, error) {
	dir := s.path("/sys/devices/system/node")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("%w: cannot list NUMA nodes: %w", errNUMANode, err)
	}
	var nodes []int
	for _, e := range ents {
		if n, ok := strings.CutPrefix(e.Name(), "node"); ok {
			if id, err := strconv.Atoi(n); err == nil {
				nodes = append(nodes, id)
			}
		}
	}
	slices.Sort(nodes)
	return nodes, nil
}

func nodeMeminfo(node int) string {
	return fmt.Sprintf("/sys/devices/system/node/node%d/meminfo", node)
}

// hugePageSize is the default hugetlbfs page size.
func (s sysfs) hugePageSize() (int64, error) {
	return s.field("/proc/meminfo", "Hugepagesize")
}

// thpSize is the transparent huge-page size, or the common default.
func (s sysfs) thpSize() int64 {
	data, err := os.ReadFile(s.path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"))
	if err != nil {
		return defaultTHPSize
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
	if err != nil || v <= 0 {
		return defaultTHPSize
	}
	return v
}

// checkNodeFree refuses a binding to node when its free memory (MemFree, or
// free huge pages for hugetlbfs) is below need bytes.
func (s sysfs) checkNodeFree(node int, need, hugePage int64) error {
	if hugePage > 0 {
		free, err := s.field(nodeMeminfo(node), "HugePages_Free")
		if err != nil {
			return err
		}
		if free*hugePage < need {
			return fmt.Errorf("%w: NUMA node %d has %d free huge pages of %d bytes (%d bytes), %d bytes needed",
				errInsufficientMemory, node, free, hugePage, free*hugePage, need)
		}
		return nil
	}
	free, err := s.field(nodeMeminfo(node), "MemFree")
	if err != nil {
		return err
	}
	if free < need {
		return fmt.Errorf("%w: NUMA node %d has %d bytes free (MemFree), %d bytes needed", errInsufficientMemory, node, free, need)
	}
	return nil
}

// checkAvailable refuses to prefault need bytes when the system reports
// less available memory (MemAvailable).
func (s sysfs) checkAvailable(need int64) error {
	avail, err := s.field("/proc/meminfo", "MemAvailable")
	if err != nil {
		return err
	}
	if avail < need {
		return fmt.Errorf("%w: %d bytes available (MemAvailable), %d bytes needed", errInsufficientMemory, avail, need)
	}
	return nil
}
