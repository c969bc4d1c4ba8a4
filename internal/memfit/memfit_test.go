package memfit

import (
	"errors"
	"math"
	"testing"
	"testing/fstest"
)

func fake(files map[string]string) System {
	m := fstest.MapFS{}
	for p, c := range files {
		m[p] = &fstest.MapFile{Data: []byte(c)}
	}
	return System{FS: m, Memlock: func() (uint64, error) { return math.MaxUint64, nil }}
}

func TestCheckFits(t *testing.T) {
	const gib = int64(1) << 30
	meminfo := "MemTotal: 131072000 kB\nMemAvailable: 67108864 kB\n"
	cg := map[string]string{
		"proc/meminfo":                 meminfo,
		"proc/self/cgroup":             "0::/job\n",
		"sys/fs/cgroup/job/memory.max": "1073741824\n",
	}
	if err := fake(map[string]string{"proc/meminfo": meminfo}).CheckFits(32*gib, false, -1); err != nil {
		t.Fatalf("32 GiB of 64 available: %v", err)
	}
	var short *Shortfall
	err := fake(map[string]string{"proc/meminfo": meminfo}).CheckFits(200*gib, false, -1)
	if !errors.As(err, &short) || short.What != "MemAvailable in /proc/meminfo" || short.Avail != 64*gib {
		t.Fatalf("200 GiB of 64 available: %v", err)
	}
	err = fake(cg).CheckFits(2*gib, false, -1)
	if !errors.As(err, &short) || short.Avail != gib || short.Need != 2*gib {
		t.Fatalf("2 GiB in a 1 GiB cgroup: %v", err)
	}
	if err := fake(map[string]string{}).CheckFits(200*gib, false, 3); err == nil {
		t.Fatal("an unreadable NUMA node passed")
	} else if ne := (*NodeError)(nil); !errors.As(err, &ne) || ne.Node != 3 {
		t.Fatalf("NUMA node 3: %v", err)
	}
}

func TestHugePagesFree(t *testing.T) {
	s := fake(map[string]string{"proc/meminfo": "HugePages_Total: 8\nHugePages_Free: 3\nHugepagesize: 2048 kB\n"})
	if got := s.HugePagesFree(); got != 3<<21 {
		t.Fatalf("%d bytes, want %d", got, 3<<21)
	}
	if got := fake(map[string]string{"proc/meminfo": "MemAvailable: 1 kB\n"}).HugePagesFree(); got != 0 {
		t.Fatalf("no huge pages: %d", got)
	}
}
