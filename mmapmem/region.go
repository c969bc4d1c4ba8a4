package mmapmem

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// MaxSize is the largest size New accepts: 2^48 bytes (256 TiB), the whole
// virtual address space of a 4-level page table. Sizes below it can still be
// unmappable; New then returns the kernel's error.
const MaxSize int64 = 1 << 48

// Errors. Every error New, OpenMemfd and Region's methods return names the
// bad value; ErrClosed and ErrHeld are the sentinels callers branch on
// (errors.Is): the others (a bad size or option, an unknown NUMA node, memory
// not free, a range outside the region, a stopped prefault) are not worth
// matching, only reporting.
var (
	// errSize means the size asked for is zero, negative or above MaxSize.
	errSize = errors.New("mmapmem: invalid size")
	// errOptions means an Options field holds an invalid value.
	errOptions = errors.New("mmapmem: invalid options")
	// errNUMANode means the NUMA node asked for does not exist.
	errNUMANode = errors.New("mmapmem: unknown NUMA node")
	// errInsufficientMemory means the memory is not free (on the node, in the
	// system, or in the tmpfs backing a memfd) and New refused to map it.
	errInsufficientMemory = errors.New("mmapmem: not enough free memory")
	// ErrClosed means the region was already closed.
	ErrClosed = errors.New("mmapmem: region is closed")
	// ErrHeld means the region cannot be closed because it is held (pinned).
	ErrHeld = errors.New("mmapmem: region is held")
	// errRange means a byte range given to Region.Prefault is not inside
	// the region's mapping or does not start on a page boundary.
	errRange = errors.New("mmapmem: range outside the region")
)

// Options select how a region is backed. The zero value is the default:
// anonymous memory, transparent huge pages requested, no NUMA binding,
// prefaulted on DefaultPrefaultThreads() threads.
type Options struct {
	// NoTHP turns off MADV_HUGEPAGE (transparent huge pages are asked for by
	// default).
	NoTHP bool
	// HugeTLB asks for hugetlbfs pages (MAP_HUGETLB, or MFD_HUGETLB for a
	// memfd); the mapping is rounded up to the huge-page size. When none are
	// reserved the region falls back to ordinary pages and Fallback says why.
	HugeTLB bool
	// BindNUMA binds the region to NUMANode with mbind(MPOL_BIND) before the
	// first touch, after checking the node has the memory free.
	BindNUMA bool
	// NUMANode is the node BindNUMA binds to.
	NUMANode int
	// NoPrefault leaves pages to be faulted in on first use.
	NoPrefault bool
	// DeferPrefault maps the region without touching it, for a caller that
	// prefaults it piece by piece with Region.Prefault (package register
	// does, overlapping the prefault of one registration range with the
	// registration of the one before). Everything else New does before the
	// first touch (advice, NUMA binding, the free-memory checks, fallocate)
	// is done as without it. It excludes NoPrefault.
	DeferPrefault bool
	// PrefaultThreads is the number of OS threads that prefault in parallel;
	// 0 means DefaultPrefaultThreads(). Negative is an error.
	PrefaultThreads int
	// Prefault is how pages are faulted in (the zero value, auto:
	// DefaultPrefaultMethod).
	Prefault PrefaultMethod
	// PrefaultNice is added to the nice value of the threads that prefault
	// (New, Region.Prefault), so that on a machine whose CPUs are busy the
	// prefault yields to the process's other threads (a serving loop)
	// rather than taking an equal share (it also slows the prefault where
	// other threads of the growth compete). 0 means the default: 10 on a
	// machine of at most 4 CPUs, where a serving loop shares the few CPUs
	// with the pool's growth, none on larger ones; negative keeps the
	// threads at the caller's priority; above 19 is an error. The threads
	// end with the prefault (a raised nice value cannot be lowered again
	// without privilege).
	PrefaultNice int
	// PrefaultStop, when closed, makes a prefault in progress (New's, or a
	// Region.Prefault call) stop within one piece of a few MiB per thread
	// and return an error ("prefault stopped"), instead of
	// finishing a region of GiBs (an engine closing while its pool grows).
	// nil never stops.
	PrefaultStop <-chan struct{}
	// PrefaultStripe, when positive, hands the region out to the prefault
	// threads in stripes of this many bytes taken in turn from a shared
	// counter, rather than one contiguous part per thread (0). It is
	// rounded up to a multiple of the huge-page size where transparent huge
	// pages apply (of the page size otherwise). Negative is an error.
	PrefaultStripe int64
	// Memfd backs the region by a memfd (memfd_create with MFD_CLOEXEC,
	// mapped MAP_SHARED) so that it can be shared by file descriptor.
	Memfd bool
	// MemfdName names the memfd as seen in /proc/PID/fd; "" means
	// "kvoffload-region".
	MemfdName string
	// FSRoot is where /proc/meminfo and /sys/devices/system/node are read
	// from ("" means "/"). Tests point it at a fake tree.
	FSRoot string
}

// DefaultPrefaultThreads is the number of prefault threads used when
// Options.PrefaultThreads is 0: the number of CPUs, at most 16.
func DefaultPrefaultThreads() int { return min(runtime.NumCPU(), 16) }

// defaultPrefaultNice is the nice increment of prefault threads when
// Options.PrefaultNice is 0: on a machine of at most smallMachineCPUs CPUs,
// 10 (a weight of about a tenth of a thread at the default priority), so
// that a serving loop sharing the few CPUs with the pool's growth keeps
// most of its request rate; on larger machines none, where the lowered
// priority slowed growth itself without a serving loop to protect.
func defaultPrefaultNice() int {
	if runtime.NumCPU() <= smallMachineCPUs {
		return 10
	}
	return 0
}

// smallMachineCPUs is the most CPUs of a machine on which prefault threads
// run at a lowered priority by default.
const smallMachineCPUs = 4

// mappedBytes counts the bytes this package has mapped and not unmapped yet,
// so tests can check that a failed New leaves nothing behind.
var mappedBytes atomic.Int64

// Region is one mmap'd piece of host memory of an exact size. Its accessors
// are safe for concurrent use; Close must not race with users of Bytes.
type Region struct {
	ptr      unsafe.Pointer
	size     int64
	mapped   int64
	pageSize int64
	fd       int
	hugeTLB  bool
	thp      bool
	node     int
	fallback string
	plan     prefaultPlan
	// deferred: mapped with Options.DeferPrefault and not yet prefaulted
	// whole by one Prefault call.
	deferred atomic.Bool

	mu       sync.Mutex
	closed   bool
	holds    map[uint64]string
	nextHold uint64
}

// New maps a region of size bytes with the given options. On error nothing
// is left mapped.
func New(size int64, opts Options) (*Region, error) {
	if size <= 0 {
		return nil, fmt.Errorf("%w: %d bytes: must be at least 1", errSize, size)
	}
	if size > MaxSize {
		return nil, fmt.Errorf("%w: %d bytes exceeds the limit of %d bytes (MaxSize)", errSize, size, MaxSize)
	}
	if opts.PrefaultThreads < 0 {
		return nil, fmt.Errorf("%w: PrefaultThreads %d: must be 0 (default) or positive", errOptions, opts.PrefaultThreads)
	}
	if !opts.Prefault.valid() {
		return nil, fmt.Errorf("%w: Prefault method %d: must be PrefaultAuto, PrefaultTouch or PrefaultPopulate", errOptions, int(opts.Prefault))
	}
	if opts.PrefaultNice > 19 {
		return nil, fmt.Errorf("%w: PrefaultNice %d: must be at most 19 (0: DefaultPrefaultNice(), negative: none)", errOptions, opts.PrefaultNice)
	}
	if opts.PrefaultStripe < 0 {
		return nil, fmt.Errorf("%w: PrefaultStripe %d: must be 0 (one part per thread) or positive", errOptions, opts.PrefaultStripe)
	}
	if opts.NoPrefault && opts.DeferPrefault {
		return nil, fmt.Errorf("%w: NoPrefault and DeferPrefault are both set: pick one", errOptions)
	}
	if opts.BindNUMA && opts.NUMANode < 0 {
		return nil, fmt.Errorf("%w: node %d: must not be negative", errNUMANode, opts.NUMANode)
	}
	sys := sysfs{root: opts.FSRoot}
	page := int64(os.Getpagesize())
	b := builder{size: size, opts: opts, sys: sys, page: page, thpSize: sys.thpSize(), existing: -1}
	if opts.BindNUMA {
		nodes, err := sys.nodes()
		if err != nil {
			return nil, err
		}
		if !slices.Contains(nodes, opts.NUMANode) {
			return nil, fmt.Errorf("%w: node %d does not exist (nodes: %s)", errNUMANode, opts.NUMANode, joinInts(nodes))
		}
	}

	var fallback []string
	if opts.HugeTLB {
		r, err := b.hugeTLB()
		if err == nil {
			return r, nil
		}
		if !errors.Is(err, errHugeTLBUnavailable) {
			return nil, err
		}
		fallback = append(fallback, err.Error())
	}
	if !opts.NoPrefault && !opts.BindNUMA {
		if err := b.sys.checkAvailable(alignUp(size, page)); err != nil {
			return nil, err
		}
	}
	r, err := b.build(page, false)
	if err != nil {
		return nil, err
	}
	r.fallback = strings.Join(append(fallback, r.fallback), "; ")
	r.fallback = strings.Trim(r.fallback, "; ")
	return r, nil
}

// Len is the size asked for.
func (r *Region) Len() int64 { return r.size }

// Mapped is the size actually mapped: Len rounded up to PageSize.
func (r *Region) Mapped() int64 { return r.mapped }

// PageSize is the size of the pages backing the region: the base page size,
// or the huge-page size when hugetlbfs pages are in use.
func (r *Region) PageSize() int64 { return r.pageSize }

// Addr is the region's start address. It must not be dereferenced after
// Close.
func (r *Region) Addr() uintptr { return uintptr(r.ptr) }

// Pointer is the region's start address as an unsafe.Pointer (for driver
// calls). It must not be dereferenced after Close.
func (r *Region) Pointer() unsafe.Pointer { return r.ptr }

// Bytes is the region's memory, Len bytes long, or nil once it is closed.
func (r *Region) Bytes() []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	return unsafe.Slice((*byte)(r.ptr), r.size)
}

// Fd is the memfd backing the region, or -1 for anonymous memory. It is
// owned by the region and closed by Close.
func (r *Region) Fd() int { return r.fd }

// HugeTLB reports whether hugetlbfs pages back the region.
func (r *Region) HugeTLB() bool { return r.hugeTLB }

// THP reports whether transparent huge pages were requested (MADV_HUGEPAGE)
// and accepted by the kernel.
func (r *Region) THP() bool { return r.thp }

// NUMANode is the node the region is bound to, and whether it is bound.
func (r *Region) numaNode() (int, bool) { return r.node, r.node >= 0 }

// Fallback says, when not empty, which option could not be honoured and why
// (no hugetlbfs pages reserved, THP unavailable).
func (r *Region) Fallback() string { return r.fallback }

// Deferred reports whether the region's prefault is still deferred: it was
// mapped with Options.DeferPrefault and no Prefault call has covered its
// whole mapping yet (a Prefault of [0, Mapped) that succeeds ends the
// deferral, so that a caller pinning it afterwards, such as package
// register, treats it as resident and does not prefault it again). Pieces
// prefaulted by separate calls do not end it, even when together they
// cover the mapping.
func (r *Region) Deferred() bool { return r.deferred.Load() }

// Prefault faults in bytes [off, off+n) of the mapping for writing, the way
// New does (the region's prefault threads, method and stripes), and returns
// once every page of the range is resident. n is rounded up to the page
// size; off must be a multiple of PageSize and off+n at most Mapped,
// otherwise it fails ("range outside the region"). When
// Options.PrefaultStop is closed it returns early, within a piece of a few
// MiB per thread, with an error ("prefault stopped"). It never changes the memory's
// contents, so it is safe on a region in use and on pages already
// resident. Prefaulting the whole mapping in one call ends a deferred
// prefault (Deferred then reports false). A closed region returns
// ErrClosed; like Bytes, Prefault must not race with Close.
func (r *Region) Prefault(off, n int64) error {
	if off < 0 || n <= 0 || off%r.pageSize != 0 || n > r.mapped-off {
		return fmt.Errorf("%w: prefault of %d bytes at offset %d of %s: the offset must be a multiple of the page size %d and the range inside the %d bytes mapped",
			errRange, n, off, r, r.pageSize, r.mapped)
	}
	r.mu.Lock()
	closed := r.closed
	r.mu.Unlock()
	if closed {
		return fmt.Errorf("%w: cannot prefault %s", ErrClosed, r)
	}
	n = min(alignUp(n, r.pageSize), r.mapped-off)
	mem := unsafe.Slice((*byte)(unsafe.Add(r.ptr, off)), n)
	if err := prefault(mem, r.plan); err != nil {
		return fmt.Errorf("mmapmem: prefault %d bytes at offset %d of %s: %w", n, off, r, err)
	}
	if off == 0 && n == r.mapped {
		r.deferred.Store(false)
	}
	return nil
}

// String names the region for messages: address, size and mapped size.
func (r *Region) String() string {
	return fmt.Sprintf("region %#x (%d bytes, %d mapped)", uintptr(r.ptr), r.size, r.mapped)
}

// Hold marks the region as in use by holder (a short description such as
// "cuda registration"); Close refuses with ErrHeld while any hold remains.
// Hold fails with ErrClosed on a closed region. The returned release drops
// the hold; calling it again does nothing.
func (r *Region) Hold(holder string) (release func(), err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, fmt.Errorf("%w: cannot hold %s for %s", ErrClosed, r, holder)
	}
	if r.holds == nil {
		r.holds = make(map[uint64]string)
	}
	id := r.nextHold
	r.nextHold++
	r.holds[id] = holder
	return func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		delete(r.holds, id)
	}, nil
}

// Holders lists the holders of the region's current holds, sorted.
func (r *Region) Holders() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.holdersLocked()
}

func (r *Region) holdersLocked() []string {
	hs := make([]string, 0, len(r.holds))
	for _, h := range r.holds {
		hs = append(hs, h)
	}
	slices.Sort(hs)
	return hs
}

// Close unmaps the region and closes its memfd. It returns ErrClosed if the
// region was already closed and ErrHeld, leaving it mapped, while it is held.
func (r *Region) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return fmt.Errorf("%w: %s was already closed", ErrClosed, r)
	}
	if len(r.holds) > 0 {
		return fmt.Errorf("%w: %s is held by %s; release it first", ErrHeld, r, strings.Join(r.holdersLocked(), ", "))
	}
	if err := unmap(r.ptr, r.mapped); err != nil {
		return fmt.Errorf("mmapmem: close %s: %w", r, err)
	}
	r.closed = true
	if r.fd >= 0 {
		if err := unix.Close(r.fd); err != nil {
			return fmt.Errorf("mmapmem: close memfd %d of %s: %w", r.fd, r, err)
		}
	}
	return nil
}

func alignUp(n, a int64) int64 { return (n + a - 1) / a * a }

func joinInts(xs []int) string {
	if len(xs) == 0 {
		return "none"
	}
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ", ")
}
