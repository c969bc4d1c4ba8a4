package mmapmem

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// errHugeTLBUnavailable marks a hugetlbfs attempt that New falls back from.
var errHugeTLBUnavailable = errors.New("hugetlbfs pages unavailable")

// builder maps one region; New uses it once for hugetlbfs pages (when asked)
// and once for base pages.
type builder struct {
	size    int64
	opts    Options
	sys     sysfs
	page    int64
	thpSize int64
	// existing, when >= 0, is a memfd received from another process
	// (OpenMemfd): it is mapped instead of creating one, never truncated
	// nor fallocate'd (its owner did both), and on error left open for the
	// caller.
	existing int
}

// hugeTLB tries to build the region from hugetlbfs pages. Any failure is
// returned wrapping errHugeTLBUnavailable, with the reason, and left nothing
// mapped.
func (b *builder) hugeTLB() (*Region, error) {
	hp, err := b.sys.hugePageSize()
	if err != nil {
		return nil, fmt.Errorf("%w: %w; using base pages", errHugeTLBUnavailable, err)
	}
	mapped := alignUp(b.size, hp)
	info, err := b.sys.meminfo("/proc/meminfo")
	if err == nil && info["HugePages_Free"]*hp < mapped {
		return nil, fmt.Errorf("%w: %d bytes needed, HugePages_Free is %d pages of %d bytes; using base pages",
			errHugeTLBUnavailable, mapped, info["HugePages_Free"], hp)
	}
	r, err := b.build(hp, true)
	if err != nil {
		return nil, fmt.Errorf("%w: %w; using base pages", errHugeTLBUnavailable, err)
	}
	return r, nil
}

// build maps, advises, binds, allocates and prefaults one region backed by
// pages of pageSize (hugetlbfs pages when huge). On error nothing is left
// mapped or open.
func (b *builder) build(pageSize int64, huge bool) (*Region, error) {
	o := b.opts
	mapped := alignUp(b.size, pageSize)
	if o.BindNUMA {
		hp := int64(0)
		if huge {
			hp = pageSize
		}
		if err := b.sys.checkNodeFree(o.NUMANode, mapped, hp); err != nil {
			return nil, err
		}
	}
	r := &Region{size: b.size, mapped: mapped, pageSize: pageSize, fd: -1, hugeTLB: huge, node: -1}
	thp := !huge && !o.NoTHP
	align := pageSize
	if thp && mapped >= b.thpSize {
		align = b.thpSize
	}

	if b.existing >= 0 {
		r.fd = b.existing
	} else if o.Memfd {
		name := o.MemfdName
		if name == "" {
			name = "kvoffload-region"
		}
		flags := unix.MFD_CLOEXEC
		if huge {
			flags |= unix.MFD_HUGETLB
		}
		fd, err := unix.MemfdCreate(name, flags)
		if err != nil {
			return nil, fmt.Errorf("mmapmem: memfd_create(%q): %w", name, err)
		}
		if err := unix.Ftruncate(fd, mapped); err != nil {
			_ = unix.Close(fd)
			return nil, fmt.Errorf("mmapmem: ftruncate memfd to %d bytes: %w", mapped, err)
		}
		r.fd = fd
	}
	ptr, err := mapAligned(r.fd, mapped, align, b.page, huge)
	if err != nil {
		if r.fd >= 0 && b.existing < 0 {
			_ = unix.Close(r.fd)
		}
		return nil, err
	}
	r.ptr = ptr
	fail := func(err error) (*Region, error) {
		_ = unmap(r.ptr, r.mapped)
		if r.fd >= 0 && b.existing < 0 {
			_ = unix.Close(r.fd)
		}
		return nil, err
	}
	mem := unsafe.Slice((*byte)(ptr), mapped)
	if err := unix.Madvise(mem, unix.MADV_DONTFORK); err != nil {
		return fail(fmt.Errorf("mmapmem: madvise(MADV_DONTFORK) on %s: %w", r, err))
	}
	if err := unix.Madvise(mem, unix.MADV_DONTDUMP); err != nil {
		return fail(fmt.Errorf("mmapmem: madvise(MADV_DONTDUMP) on %s: %w", r, err))
	}
	if thp {
		if err := unix.Madvise(mem, unix.MADV_HUGEPAGE); err != nil {
			r.fallback = fmt.Sprintf("transparent huge pages unavailable: madvise(MADV_HUGEPAGE): %v", err)
		} else {
			r.thp = true
		}
	}
	if o.BindNUMA {
		if err := mbind(ptr, mapped, o.NUMANode); err != nil {
			return fail(fmt.Errorf("mmapmem: mbind %s to NUMA node %d: %w", r, o.NUMANode, err))
		}
		r.node = o.NUMANode
	}
	if r.fd >= 0 && b.existing < 0 {
		if err := unix.Fallocate(r.fd, 0, 0, mapped); err != nil {
			if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.ENOMEM) {
				err = fmt.Errorf("%w: %w", errInsufficientMemory, err)
			}
			return fail(fmt.Errorf("mmapmem: fallocate %d bytes of memfd: %w", mapped, err))
		}
	}
	threads := o.PrefaultThreads
	if threads == 0 {
		threads = DefaultPrefaultThreads()
	}
	nice := o.PrefaultNice
	switch {
	case nice == 0:
		nice = defaultPrefaultNice()
	case nice < 0:
		nice = 0
	}
	r.plan = prefaultPlan{page: b.page, align: max(align, pageSize), threads: threads, method: o.Prefault.resolve(),
		nice: nice, stop: o.PrefaultStop}
	if o.PrefaultStripe > 0 {
		r.plan.stripe = alignUp(o.PrefaultStripe, r.plan.align)
	}
	r.deferred.Store(o.DeferPrefault)
	if !o.NoPrefault && !o.DeferPrefault {
		if err := prefault(mem, r.plan); err != nil {
			return fail(fmt.Errorf("mmapmem: prefault %s: %w", r, err))
		}
	}
	return r, nil
}

// mapAligned maps length bytes (of the memfd fd, or anonymous when fd < 0)
// read-write at an address aligned to align. Alignment larger than a page is
// obtained by reserving length+align bytes, mapping over the aligned part
// and trimming the rest, so that transparent huge pages line up with it.
func mapAligned(fd int, length, align, page int64, huge bool) (unsafe.Pointer, error) {
	flags := unix.MAP_SHARED
	if fd < 0 {
		flags = unix.MAP_PRIVATE | unix.MAP_ANONYMOUS
		if huge {
			flags |= unix.MAP_HUGETLB
		}
	}
	const prot = unix.PROT_READ | unix.PROT_WRITE
	if align <= page || huge {
		p, err := unix.MmapPtr(fd, 0, nil, uintptr(length), prot, flags)
		if err != nil {
			return nil, fmt.Errorf("mmapmem: mmap %d bytes: %w", length, err)
		}
		mappedBytes.Add(length)
		return p, nil
	}
	total := length + align
	res, err := unix.MmapPtr(-1, 0, nil, uintptr(total), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("mmapmem: reserve address space for %d bytes (%d with alignment): %w", length, total, err)
	}
	head := alignUp(int64(uintptr(res)), align) - int64(uintptr(res))
	at := unsafe.Add(res, head)
	p, err := unix.MmapPtr(fd, 0, at, uintptr(length), prot, flags|unix.MAP_FIXED)
	if err != nil {
		_ = unix.MunmapPtr(res, uintptr(total))
		return nil, fmt.Errorf("mmapmem: mmap %d bytes: %w", length, err)
	}
	if head > 0 {
		if err := unix.MunmapPtr(res, uintptr(head)); err != nil {
			_ = unix.MunmapPtr(res, uintptr(total))
			return nil, fmt.Errorf("mmapmem: trim reservation head: %w", err)
		}
	}
	if tail := total - head - length; tail > 0 {
		if err := unix.MunmapPtr(unsafe.Add(p, length), uintptr(tail)); err != nil {
			_ = unix.MunmapPtr(p, uintptr(length+tail))
			return nil, fmt.Errorf("mmapmem: trim reservation tail: %w", err)
		}
	}
	mappedBytes.Add(length)
	return p, nil
}

// unmap releases a mapping made by mapAligned.
func unmap(p unsafe.Pointer, length int64) error {
	if err := unix.MunmapPtr(p, uintptr(length)); err != nil {
		return err
	}
	mappedBytes.Add(-length)
	return nil
}

// mbind binds [p, p+length) to node with MPOL_BIND.
func mbind(p unsafe.Pointer, length int64, node int) error {
	mask := make([]uint64, node/64+1)
	mask[node/64] = 1 << (node % 64)
	// The kernel counts maxnode one past the last bit it reads.
	maxnode := uintptr(len(mask)*64 + 1)
	_, _, errno := unix.Syscall6(unix.SYS_MBIND, uintptr(p), uintptr(length), unix.MPOL_BIND,
		uintptr(unsafe.Pointer(&mask[0])), maxnode, 0)
	if errno != 0 {
		return errno
	}
	return nil
}
