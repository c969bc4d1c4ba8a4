package mmapmem

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// hugetlbfsMagic is statfs.f_type of a hugetlbfs file (MFD_HUGETLB memfd).
const hugetlbfsMagic = 0x958458f6

// OpenMemfd maps size bytes of a memfd that another process created (a
// region of New with Options.Memfd, received over a unix socket) the way New
// maps its own: MAP_SHARED, MADV_DONTFORK and MADV_DONTDUMP, MADV_HUGEPAGE
// unless Options.NoTHP, NUMA binding when asked, and a parallel prefault
// (Options.PrefaultThreads, Options.Prefault; NoPrefault and DeferPrefault
// as for New) which fills this process's page tables without changing
// the contents. Whether the memfd is on hugetlbfs is read from the file
// (fstatfs), and the mapping is rounded to its page size; the file must
// hold at least that much. The memfd is neither truncated nor allocated:
// its creator did both. Options.Memfd, MemfdName and HugeTLB are ignored.
//
// On success the Region owns fd (Close closes it); on error fd is left open
// and still the caller's, and nothing is mapped.
func OpenMemfd(fd int, size int64, opts Options) (*Region, error) {
	if fd < 0 {
		return nil, fmt.Errorf("%w: memfd %d", errOptions, fd)
	}
	if size <= 0 || size > MaxSize {
		return nil, fmt.Errorf("%w: %d bytes: must be in [1, %d]", errSize, size, MaxSize)
	}
	if opts.PrefaultThreads < 0 || !opts.Prefault.valid() || opts.PrefaultNice > 19 || opts.PrefaultStripe < 0 ||
		(opts.NoPrefault && opts.DeferPrefault) {
		return nil, fmt.Errorf("%w: prefault options %+v", errOptions, opts)
	}
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		return nil, fmt.Errorf("mmapmem: fstatfs memfd %d: %w", fd, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("mmapmem: fstat memfd %d: %w", fd, err)
	}
	page := int64(os.Getpagesize())
	pageSize, huge := page, false
	if uint32(fs.Type) == hugetlbfsMagic {
		pageSize, huge = fs.Bsize, true
	}
	if mapped := alignUp(size, pageSize); st.Size < mapped {
		return nil, fmt.Errorf("%w: memfd %d holds %d bytes, %d needed to map %d bytes", errSize, fd, st.Size, mapped, size)
	}
	opts.Memfd, opts.HugeTLB = false, false
	sys := sysfs{root: opts.FSRoot}
	b := builder{size: size, opts: opts, sys: sys, page: page, thpSize: sys.thpSize(), existing: fd}
	return b.build(pageSize, huge)
}
