// Package mmapmem owns regions: exact-size pieces of host memory mapped with
// mmap(2), ready to be pinned by package register and carved into slots by
// the engine. It knows nothing of CUDA.
//
// A Region is mapped at the size asked for, rounded up to the page size (or
// to the huge-page size for hugetlbfs pages) and nothing more: Len reports the
// size asked, Mapped the rounded size actually owned.
//
// Invariants every Region keeps:
//   - MADV_DONTFORK and MADV_DONTDUMP are applied to the whole mapping, so a
//     forked child never copies pinned pages on write and core dumps never
//     contain KV-cache contents.
//   - With NUMA binding, mbind(MPOL_BIND) is applied before the first touch,
//     and only after the node was checked to have the memory free: an OOM
//     kill half-way through a prefault is not an error anyone can handle.
//   - The memfd-backed variant is fallocate'd before it is touched, so a full
//     tmpfs is an error from New rather than a SIGBUS later. Its file lives
//     only in the kernel (memfd_create): nothing is left on disk or in
//     /dev/shm after a crash.
//   - Prefaulting never changes contents (MADV_POPULATE_WRITE, or an atomic
//     add of zero per page), so Region.Prefault is safe on memory in use.
//     A region mapped with Options.DeferPrefault is left untouched by New
//     for its owner to prefault range by range with Region.Prefault.
//   - Prefaulting never holds the process's mmap_lock for long: each
//     thread faults its part in pieces of a few MiB, one madvise each, so
//     that the rest of the process (the Go runtime mapping heap, a serving
//     loop faulting pages) waits milliseconds, not seconds. Its threads run
//     at a lowered priority (Options.PrefaultNice) and it stops between
//     pieces once Options.PrefaultStop is closed.
//   - A failed New leaves nothing mapped and no file descriptor open.
//   - Close unmaps. Closing twice returns ErrClosed; closing a region that is
//     held (see Region.Hold: package register holds every region it pinned)
//     returns ErrHeld and leaves the region mapped.
//
// After Close the memory is gone: slices from Bytes must not be used, and
// Addr must not be dereferenced. The package is Linux-only and assumes a
// 64-bit address space.
package mmapmem
