package mmapmem_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/mmapmem"
)

const mib = 1 << 20

// checkNoLeak asserts that the test leaves no region mapped.
func checkNoLeak(t *testing.T) {
	t.Helper()
	before := mmapmem.MappedBytes()
	t.Cleanup(func() {
		require.Equal(t, before, mmapmem.MappedBytes(), "bytes still mapped by mmapmem after the test")
	})
}

func hasNode0() bool {
	_, err := os.Stat("/sys/devices/system/node/node0")
	return err == nil
}

// checkRegion verifies everything a successfully built region promises.
func checkRegion(t *testing.T, r *mmapmem.Region, size int64, opts mmapmem.Options) {
	t.Helper()
	page := int64(os.Getpagesize())
	require.Equal(t, size, r.Len())
	require.Zero(t, r.Mapped()%r.PageSize(), "mapped size is a whole number of pages")
	require.GreaterOrEqual(t, r.Mapped(), size)
	require.Less(t, r.Mapped()-size, r.PageSize(), "no rounding beyond one page")
	if !r.HugeTLB() {
		require.Equal(t, page, r.PageSize())
	}
	b := r.Bytes()
	require.Len(t, b, int(size))
	b[size-1] = 0x5A
	require.Equal(t, byte(0x5A), r.Bytes()[size-1])
	b[0] = 0xA5
	require.Equal(t, byte(0xA5), r.Bytes()[0])
	if opts.Memfd {
		require.GreaterOrEqual(t, r.Fd(), 0)
	} else {
		require.Equal(t, -1, r.Fd())
	}
	require.Equal(t, !opts.NoTHP && !r.HugeTLB(), r.THP(), "THP requested iff asked and not hugetlbfs: %s", r.Fallback())
	if r.THP() && r.Mapped() >= 2*mib {
		require.Zero(t, r.Addr()%(2*mib), "THP regions are aligned to the huge-page size")
	}
	node, bound := mmapmem.NUMANode(r)
	require.Equal(t, opts.BindNUMA, bound)
	if bound {
		require.Equal(t, opts.NUMANode, node)
	}

	if !opts.NoPrefault {
		pages, total, err := mmapmem.Resident(r)
		require.NoError(t, err)
		require.Equal(t, int((r.Mapped()+page-1)/page), total)
		require.Equal(t, total, pages, "every page resident after prefault")
	}
	for _, addr := range []uintptr{r.Addr(), r.Addr() + uintptr(r.Mapped()) - 1} {
		flags, err := mmapmem.VMAFlags(addr)
		require.NoError(t, err)
		require.Contains(t, flags, "dc", "MADV_DONTFORK at %#x: %v", addr, flags)
		require.Contains(t, flags, "dd", "MADV_DONTDUMP at %#x: %v", addr, flags)
		if r.THP() {
			require.Contains(t, flags, "hg", "MADV_HUGEPAGE at %#x: %v", addr, flags)
		} else {
			require.NotContains(t, flags, "hg")
		}
		if r.HugeTLB() {
			require.Contains(t, flags, "ht")
		}
	}
}

func TestNewSizesAndOptions(t *testing.T) {
	checkNoLeak(t)
	sizes := []int64{1, 4095, 4096, 4097, mib + 13, 2 * mib, 3*mib + 1, 5*mib + 4097}
	combos := map[string]mmapmem.Options{
		"default":        {},
		"no-thp":         {NoTHP: true},
		"no-prefault":    {NoPrefault: true},
		"one-thread":     {PrefaultThreads: 1},
		"three-threads":  {PrefaultThreads: 3},
		"memfd":          {Memfd: true},
		"memfd-no-thp":   {Memfd: true, NoTHP: true, PrefaultThreads: 2},
		"memfd-lazy":     {Memfd: true, NoPrefault: true, MemfdName: "kvo-test"},
		"hugetlb":        {HugeTLB: true},
		"hugetlb-memfd":  {HugeTLB: true, Memfd: true},
		"numa0":          {BindNUMA: true},
		"numa0-memfd":    {BindNUMA: true, Memfd: true, NoTHP: true},
		"numa0-hugetlb":  {BindNUMA: true, HugeTLB: true},
		"numa0-no-fault": {BindNUMA: true, NoPrefault: true},
	}
	for name, opts := range combos {
		if opts.BindNUMA && !hasNode0() {
			continue
		}
		for _, size := range sizes {
			t.Run(fmt.Sprintf("%s/%d", name, size), func(t *testing.T) {
				r, err := mmapmem.New(size, opts)
				require.NoError(t, err)
				checkRegion(t, r, size, opts)
				require.NoError(t, r.Close())
				require.ErrorIs(t, r.Close(), mmapmem.ErrClosed)
				require.Nil(t, r.Bytes())
			})
		}
	}
}

func TestNoPrefaultLeavesPagesOut(t *testing.T) {
	checkNoLeak(t)
	r, err := mmapmem.New(3*mib, mmapmem.Options{NoPrefault: true})
	require.NoError(t, err)
	defer func() { require.NoError(t, r.Close()) }()
	pages, total, err := mmapmem.Resident(r)
	require.NoError(t, err)
	require.Zero(t, pages)
	require.Equal(t, int(3*mib/int64(os.Getpagesize())), total)
}

func TestTouchPrefault(t *testing.T) {
	checkNoLeak(t)
	mmapmem.ForceTouchPrefault(t)
	for _, opts := range []mmapmem.Options{{}, {NoTHP: true, PrefaultThreads: 5}, {Memfd: true}} {
		r, err := mmapmem.New(3*mib+5, opts)
		require.NoError(t, err)
		checkRegion(t, r, 3*mib+5, opts)
		require.NoError(t, r.Close())
	}
}

func TestPrefaultMethodsAndStripes(t *testing.T) {
	checkNoLeak(t)
	cases := map[string]mmapmem.Options{
		"auto":                {},
		"touch":               {Prefault: mmapmem.PrefaultTouch, PrefaultThreads: 3},
		"populate":            {Prefault: mmapmem.PrefaultPopulate, PrefaultThreads: 3},
		"touch-stripes":       {Prefault: mmapmem.PrefaultTouch, PrefaultThreads: 4, PrefaultStripe: 1},
		"populate-stripes":    {Prefault: mmapmem.PrefaultPopulate, PrefaultThreads: 2, PrefaultStripe: 2 * mib},
		"no-thp-odd-stripe":   {NoTHP: true, Prefault: mmapmem.PrefaultTouch, PrefaultThreads: 3, PrefaultStripe: 12345},
		"memfd-stripes":       {Memfd: true, Prefault: mmapmem.PrefaultPopulate, PrefaultStripe: 64 * mib},
		"one-thread-stripes":  {PrefaultThreads: 1, PrefaultStripe: mib},
		"stripe-beyond-size":  {PrefaultThreads: 5, PrefaultStripe: 1 << 40},
		"memfd-touch-no-thp":  {Memfd: true, NoTHP: true, Prefault: mmapmem.PrefaultTouch},
		"populate-fallback-1": {Prefault: mmapmem.PrefaultPopulate, PrefaultThreads: 1},
	}
	for name, opts := range cases {
		t.Run(name, func(t *testing.T) {
			r, err := mmapmem.New(5*mib+7, opts)
			require.NoError(t, err)
			checkRegion(t, r, 5*mib+7, opts)
			require.NoError(t, r.Close())
		})
	}
}

func TestPrefaultMethodString(t *testing.T) {
	for m, want := range map[mmapmem.PrefaultMethod]string{
		mmapmem.PrefaultAuto: "auto", mmapmem.PrefaultTouch: "touch", mmapmem.PrefaultPopulate: "populate", 7: "PrefaultMethod(7)",
	} {
		require.Equal(t, want, m.String())
	}
	require.Equal(t, mmapmem.PrefaultPopulate, mmapmem.DefaultPrefaultMethod)
}

func TestNUMABindingIsVisible(t *testing.T) {
	if !hasNode0() {
		t.Skip("no NUMA node 0 in sysfs")
	}
	if _, err := os.Stat("/proc/self/numa_maps"); err != nil {
		t.Skip("no /proc/self/numa_maps")
	}
	checkNoLeak(t)
	r, err := mmapmem.New(4*mib, mmapmem.Options{BindNUMA: true, NUMANode: 0})
	require.NoError(t, err)
	defer func() { require.NoError(t, r.Close()) }()
	data, err := os.ReadFile("/proc/self/numa_maps")
	require.NoError(t, err)
	prefix := fmt.Sprintf("%x ", r.Addr())
	var line string
	for l := range strings.Lines(string(data)) {
		if strings.HasPrefix(l, prefix) {
			line = l
		}
	}
	require.Contains(t, line, "bind:0", "numa_maps line for the region: %q", line)
}

func TestHugeTLB(t *testing.T) {
	checkNoLeak(t)
	r, err := mmapmem.New(3*mib+1, mmapmem.Options{HugeTLB: true})
	require.NoError(t, err)
	defer func() { require.NoError(t, r.Close()) }()
	if r.HugeTLB() {
		require.Greater(t, r.PageSize(), int64(os.Getpagesize()))
		require.Equal(t, (3*mib+1+r.PageSize()-1)/r.PageSize()*r.PageSize(), r.Mapped())
		return
	}
	require.Contains(t, r.Fallback(), "hugetlbfs pages unavailable")
	require.Contains(t, r.Fallback(), "using base pages")
	require.True(t, r.THP(), "the fallback keeps transparent huge pages")
}

func TestMemfd(t *testing.T) {
	checkNoLeak(t)
	shm := func() []string {
		ents, err := os.ReadDir("/dev/shm")
		if err != nil {
			return nil
		}
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		return names
	}
	before := shm()
	r, err := mmapmem.New(2*mib+3, mmapmem.Options{Memfd: true, MemfdName: "kvo-memfd-test"})
	require.NoError(t, err)
	require.Equal(t, before, shm(), "nothing created under /dev/shm")

	link, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", r.Fd()))
	require.NoError(t, err)
	require.Contains(t, link, "memfd:kvo-memfd-test")
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(r.Fd(), &st))
	require.Equal(t, r.Mapped(), st.Size)
	flags, err := unix.FcntlInt(uintptr(r.Fd()), unix.F_GETFD, 0)
	require.NoError(t, err)
	require.NotZero(t, flags&unix.FD_CLOEXEC, "memfd is close-on-exec")

	// A second mapping of the fd sees what is written through the region.
	other, err := unix.Mmap(r.Fd(), 0, int(r.Mapped()), unix.PROT_READ, unix.MAP_SHARED)
	require.NoError(t, err)
	copy(r.Bytes()[mib:], "shared by fd")
	require.Equal(t, "shared by fd", string(other[mib:mib+12]))
	require.NoError(t, unix.Munmap(other))

	require.NoError(t, r.Close())
	require.Equal(t, before, shm())
}

func TestHold(t *testing.T) {
	checkNoLeak(t)
	r, err := mmapmem.New(4096, mmapmem.Options{})
	require.NoError(t, err)
	release, err := r.Hold("cuda registration")
	require.NoError(t, err)
	err = r.Close()
	require.ErrorIs(t, err, mmapmem.ErrHeld)
	require.Contains(t, err.Error(), "cuda registration")
	require.NotNil(t, r.Bytes(), "a refused Close leaves the region mapped")
	require.Equal(t, []string{"cuda registration"}, r.Holders())
	release()
	release()
	require.Empty(t, r.Holders())
	require.NoError(t, r.Close())
	_, err = r.Hold("late")
	require.ErrorIs(t, err, mmapmem.ErrClosed)
	_, _, err = mmapmem.Resident(r)
	require.ErrorIs(t, err, mmapmem.ErrClosed)
}

func TestConcurrentHoldAndClose(t *testing.T) {
	checkNoLeak(t)
	r, err := mmapmem.New(64<<10, mmapmem.Options{})
	require.NoError(t, err)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for range 50 {
				if release, err := r.Hold(fmt.Sprint("holder ", i)); err == nil {
					_ = r.Holders()
					release()
				}
			}
		})
	}
	wg.Wait()
	require.NoError(t, r.Close())
}

func TestNewErrors(t *testing.T) {
	checkNoLeak(t)
	cases := []struct {
		name  string
		size  int64
		opts  mmapmem.Options
		is    error
		words []string
	}{
		{"zero", 0, mmapmem.Options{}, mmapmem.ErrSize, []string{"0 bytes", "at least 1"}},
		{"negative", -4096, mmapmem.Options{}, mmapmem.ErrSize, []string{"-4096"}},
		{"too large", mmapmem.MaxSize + 1, mmapmem.Options{}, mmapmem.ErrSize, []string{fmt.Sprint(mmapmem.MaxSize + 1), fmt.Sprint(mmapmem.MaxSize)}},
		{"unmappable", mmapmem.MaxSize, mmapmem.Options{NoPrefault: true}, unix.ENOMEM, []string{fmt.Sprint(mmapmem.MaxSize)}},
		{"more than available", mmapmem.MaxSize, mmapmem.Options{}, mmapmem.ErrInsufficientMemory, []string{"MemAvailable", fmt.Sprint(mmapmem.MaxSize)}},
		{"negative threads", 4096, mmapmem.Options{PrefaultThreads: -2}, mmapmem.ErrOptions, []string{"-2"}},
		{"unknown prefault method", 4096, mmapmem.Options{Prefault: 9}, mmapmem.ErrOptions, []string{"method 9"}},
		{"negative prefault method", 4096, mmapmem.Options{Prefault: -1}, mmapmem.ErrOptions, []string{"method -1"}},
		{"negative stripe", 4096, mmapmem.Options{PrefaultStripe: -4096}, mmapmem.ErrOptions, []string{"-4096"}},
		{"negative node", 4096, mmapmem.Options{BindNUMA: true, NUMANode: -1}, mmapmem.ErrNUMANode, []string{"-1"}},
		{"unknown node", 4096, mmapmem.Options{BindNUMA: true, NUMANode: 4242}, mmapmem.ErrNUMANode, []string{"4242", "nodes:"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, err := mmapmem.New(c.size, c.opts)
			require.Nil(t, r)
			require.ErrorIs(t, err, c.is)
			for _, w := range c.words {
				require.Contains(t, err.Error(), w)
			}
		})
	}
}

// fakeRoot builds a memory report tree: /proc/meminfo and the given nodes'
// meminfo files.
func fakeRoot(t *testing.T, memAvailKB, hugeFree int64, nodeFreeKB map[int]int64) string {
	t.Helper()
	root := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(root, "proc"), 0o755))
	meminfo := fmt.Sprintf("MemTotal: 99999999 kB\nMemAvailable: %d kB\nHugePages_Total: %d\nHugePages_Free: %d\nHugepagesize: 2048 kB\n",
		memAvailKB, hugeFree, hugeFree)
	require.NoError(t, os.WriteFile(filepath.Join(root, "proc/meminfo"), []byte(meminfo), 0o644))
	for n, kb := range nodeFreeKB {
		dir := filepath.Join(root, fmt.Sprintf("sys/devices/system/node/node%d", n))
		require.NoError(t, os.MkdirAll(dir, 0o755))
		body := fmt.Sprintf("Node %d MemTotal: 99999999 kB\nNode %d MemFree: %d kB\nNode %d HugePages_Free: 0\n", n, n, kb, n)
		require.NoError(t, os.WriteFile(filepath.Join(dir, "meminfo"), []byte(body), 0o644))
	}
	return root
}

func TestMemoryChecks(t *testing.T) {
	checkNoLeak(t)
	root := fakeRoot(t, 1024, 0, map[int]int64{0: 1024, 2: 1 << 30, 63: 1 << 30})
	cases := []struct {
		name  string
		size  int64
		opts  mmapmem.Options
		is    error
		words []string
	}{
		{"node missing", 4096, mmapmem.Options{BindNUMA: true, NUMANode: 1}, mmapmem.ErrNUMANode, []string{"node 1 does not exist", "nodes: 0, 2, 63"}},
		{"node short", 2 * mib, mmapmem.Options{BindNUMA: true, NUMANode: 0}, mmapmem.ErrInsufficientMemory, []string{"node 0", "1048576 bytes free", "2097152 bytes needed"}},
		{"system short", 2 * mib, mmapmem.Options{}, mmapmem.ErrInsufficientMemory, []string{"1048576 bytes available", "2097152 bytes needed"}},
		{"memfd short", 2 * mib, mmapmem.Options{Memfd: true}, mmapmem.ErrInsufficientMemory, []string{"MemAvailable"}},
		// Node 63 exists in the fake tree only, so mbind fails after the
		// mapping was made: New must unmap it (checkNoLeak).
		{"mbind fails", 2 * mib, mmapmem.Options{BindNUMA: true, NUMANode: 63}, unix.EINVAL, []string{"mbind", "node 63"}},
		{"mbind fails memfd", 2 * mib, mmapmem.Options{BindNUMA: true, NUMANode: 63, Memfd: true}, unix.EINVAL, []string{"mbind"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.opts.FSRoot = root
			r, err := mmapmem.New(c.size, c.opts)
			require.Nil(t, r)
			require.ErrorIs(t, err, c.is)
			for _, w := range c.words {
				require.Contains(t, err.Error(), w)
			}
		})
	}

	t.Run("lazy region skips the check", func(t *testing.T) {
		r, err := mmapmem.New(2*mib, mmapmem.Options{FSRoot: root, NoPrefault: true})
		require.NoError(t, err)
		require.NoError(t, r.Close())
	})
	t.Run("hugetlb fallback names the reason", func(t *testing.T) {
		root := fakeRoot(t, 1<<20, 0, nil)
		r, err := mmapmem.New(mib, mmapmem.Options{FSRoot: root, HugeTLB: true})
		require.NoError(t, err)
		require.False(t, r.HugeTLB())
		require.Contains(t, r.Fallback(), "HugePages_Free is 0 pages of 2097152 bytes")
		require.NoError(t, r.Close())
	})
	t.Run("no NUMA support", func(t *testing.T) {
		root := fakeRoot(t, 1<<20, 0, nil)
		_, err := mmapmem.New(mib, mmapmem.Options{FSRoot: root, BindNUMA: true})
		require.ErrorIs(t, err, mmapmem.ErrNUMANode)
		require.Contains(t, err.Error(), "cannot list NUMA nodes")
	})
}

func TestVMAFlagsUnknownAddress(t *testing.T) {
	_, err := mmapmem.VMAFlags(0x10)
	require.ErrorContains(t, err, "no mapping contains address 0x10")
}

func TestDefaultPrefaultThreads(t *testing.T) {
	n := mmapmem.DefaultPrefaultThreads()
	require.GreaterOrEqual(t, n, 1)
	require.LessOrEqual(t, n, 16)
}

func FuzzNew(f *testing.F) {
	f.Add(int64(1), uint8(0), uint8(0))
	f.Add(int64(4097), uint8(0b11111), uint8(3))
	f.Add(int64(-1), uint8(0), uint8(0))
	f.Add(int64(0), uint8(0b100), uint8(1))
	f.Add(mmapmem.MaxSize+1, uint8(0b10), uint8(0))
	f.Add(int64(3<<20+1), uint8(0b1000), uint8(7))
	f.Add(int64(5<<20+3), uint8(0b1000000), uint8(45))
	f.Add(int64(8192), uint8(0b1100000), uint8(2))
	f.Add(int64(3<<20+7), uint8(0b10000000), uint8(4))
	f.Add(int64(4096), uint8(0b10000010), uint8(0))
	f.Fuzz(func(t *testing.T, size int64, bits, threads uint8) {
		opts := mmapmem.Options{
			NoTHP:           bits&1 != 0,
			NoPrefault:      bits&2 != 0,
			Memfd:           bits&4 != 0,
			HugeTLB:         bits&8 != 0,
			BindNUMA:        bits&16 != 0 && hasNode0(),
			PrefaultThreads: int(threads%20) - 1,
			Prefault:        mmapmem.PrefaultMethod(bits>>5&3) - 1,
			PrefaultStripe:  int64(threads/20) * 777,
			DeferPrefault:   bits&128 != 0,
		}
		// Keep the target cheap: large regions are mapped, not touched.
		if size > 16*mib && !opts.Memfd {
			opts.NoPrefault = true
		}
		if size > 16*mib && opts.Memfd {
			size %= 16 * mib
		}
		before := mmapmem.MappedBytes()
		r, err := mmapmem.New(size, opts)
		if err != nil {
			require.Nil(t, r)
			require.Equal(t, before, mmapmem.MappedBytes(), "a failed New leaves nothing mapped")
			valid := size > 0 && size <= mmapmem.MaxSize && opts.PrefaultThreads >= 0 && opts.Prefault >= mmapmem.PrefaultAuto && opts.Prefault <= mmapmem.PrefaultPopulate &&
				!(opts.NoPrefault && opts.DeferPrefault)
			if !valid {
				require.True(t, slices.ContainsFunc([]error{mmapmem.ErrSize, mmapmem.ErrOptions}, func(e error) bool { return errors.Is(err, e) }), "error %v", err)
			}
			return
		}
		require.Equal(t, size, r.Len())
		require.GreaterOrEqual(t, r.Mapped(), size)
		require.Less(t, r.Mapped()-size, r.PageSize())
		require.Equal(t, opts.DeferPrefault, r.Deferred())
		if r.Deferred() && r.Mapped() <= 16*mib {
			require.NoError(t, r.Prefault(0, r.Mapped()))
		}
		require.NoError(t, r.Close())
		require.ErrorIs(t, r.Close(), mmapmem.ErrClosed)
		require.Equal(t, before, mmapmem.MappedBytes())
	})
}

func TestHugeBytes(t *testing.T) {
	checkNoLeak(t)
	for name, opts := range map[string]mmapmem.Options{"thp": {}, "no-thp": {NoTHP: true}, "memfd": {Memfd: true}} {
		t.Run(name, func(t *testing.T) {
			r, err := mmapmem.New(8*mib, opts)
			require.NoError(t, err)
			h, err := mmapmem.HugeBytes(r)
			require.NoError(t, err)
			require.GreaterOrEqual(t, h, int64(0))
			require.LessOrEqual(t, h, r.Mapped())
			require.NoError(t, r.Close())
			_, err = mmapmem.HugeBytes(r)
			require.ErrorIs(t, err, mmapmem.ErrClosed)
		})
	}
}
