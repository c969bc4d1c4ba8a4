package mmapmem

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// PrefaultMethod says how New faults a region's pages in. The zero value
// is auto: DefaultPrefaultMethod, or touching where the kernel lacks it.
type PrefaultMethod int

const (
	// prefaultAuto is the zero value: DefaultPrefaultMethod.
	prefaultAuto PrefaultMethod = iota
	// PrefaultTouch writes one byte per base page from each prefault
	// thread: a page fault per page (one per huge page where transparent
	// huge pages apply), taken in user mode on that thread.
	PrefaultTouch
	// PrefaultPopulate calls madvise(MADV_POPULATE_WRITE) (Linux ≥ 5.14) on
	// each thread's part, falling back to PrefaultTouch where the kernel
	// refuses it with EINVAL.
	PrefaultPopulate
)

// DefaultPrefaultMethod is what the zero PrefaultMethod (auto) means:
// MADV_POPULATE_WRITE, which faults pages in without writing them and is a
// little faster than touching, alone and followed by registration (benchgpu's
// TestPinningVariants compares them); it falls back to touching where the
// kernel lacks it.
const DefaultPrefaultMethod = PrefaultPopulate

func (m PrefaultMethod) String() string {
	switch m {
	case prefaultAuto:
		return "auto"
	case PrefaultTouch:
		return "touch"
	case PrefaultPopulate:
		return "populate"
	}
	return fmt.Sprintf("PrefaultMethod(%d)", int(m))
}

func (m PrefaultMethod) valid() bool { return m >= prefaultAuto && m <= PrefaultPopulate }

// resolve maps prefaultAuto to DefaultPrefaultMethod.
func (m PrefaultMethod) resolve() PrefaultMethod {
	if m == prefaultAuto {
		return DefaultPrefaultMethod
	}
	return m
}

// populateUnsupported is set once MADV_POPULATE_WRITE (Linux ≥ 5.14) was
// refused with EINVAL; PrefaultPopulate then touches one byte per page.
var populateUnsupported atomic.Bool

// prefaultPlan is how one region is prefaulted.
type prefaultPlan struct {
	page    int64 // base page size: the touch stride
	align   int64 // parts are multiples of this (the huge-page size with THP)
	threads int
	method  PrefaultMethod // resolved: PrefaultTouch or PrefaultPopulate
	// stripe = 0: one contiguous part per thread. Otherwise parts of stripe
	// bytes (a multiple of align) that the threads take in turn from a
	// shared counter until none is left.
	stripe int64
	// nice is added to each prefault thread's nice value (0: none).
	nice int
	// stop, when closed, ends the prefault at the next piece (nil: never).
	stop <-chan struct{}
}

// prefaultPiece is the most one madvise(MADV_POPULATE_WRITE) call (or one
// run of touches between two checks of the plan's stop channel) covers,
// unless a huge page is larger (a piece is a whole number of the plan's
// align).
// The kernel holds the process's mmap_lock for reading through a whole
// populate call, and a thread that needs it for writing (any mmap, munmap,
// mprotect or MADV_HUGEPAGE in the process: the Go runtime growing its
// heap, the engine mapping its next region) waits for the call to end,
// while every page fault and madvise queued behind that writer waits too.
// Populating a part of gigabytes in one call can stop a serving loop on a
// small machine for seconds; 8 MiB pieces keep its stalls short and cost
// the prefault no measurable time.
const prefaultPiece int64 = 8 << 20

// errPrefaultStopped means a prefault ended early because Options.PrefaultStop
// was closed: the pages of the range may be only partly resident.
var errPrefaultStopped = errors.New("mmapmem: prefault stopped")

// prefault faults in every page of mem for writing on p.threads OS threads,
// each in pieces of at most prefaultPiece bytes. Each worker is locked to
// its thread so the work really runs in parallel and, without a NUMA
// binding, lands on that thread's local node. With p.nice the thread's
// nice value is raised first; a thread cannot lower it again without
// privilege, so the worker never unlocks it and the runtime ends the
// thread with the worker, rather than handing a lowered thread to other
// goroutines.
func prefault(mem []byte, p prefaultPlan) error {
	n := int64(len(mem))
	units := (n + p.align - 1) / p.align
	workers := min(int64(p.threads), units)
	per := (units + workers - 1) / workers * p.align
	var next atomic.Int64 // striped: index of the next stripe to take
	var wg sync.WaitGroup
	errs := make([]error, workers)
	for w := range workers {
		wg.Go(func() {
			runtime.LockOSThread()
			if p.nice == 0 {
				defer runtime.UnlockOSThread()
			} else {
				lowerPriority(p.nice)
			}
			if p.stripe == 0 {
				lo, hi := w*per, min((w+1)*per, n)
				if lo < hi {
					errs[w] = p.fault(mem, lo, hi)
				}
				return
			}
			for {
				lo := next.Add(1) - 1
				lo *= p.stripe
				if lo >= n {
					return
				}
				if err := p.fault(mem, lo, min(lo+p.stripe, n)); err != nil {
					errs[w] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// lowerPriority adds inc to the calling thread's nice value (on Linux,
// setpriority(PRIO_PROCESS, 0) applies to the calling thread only). A
// failure leaves the priority as it was: prefaulting at the caller's
// priority is slower for others, not wrong.
func lowerPriority(inc int) {
	cur, err := unix.Getpriority(unix.PRIO_PROCESS, 0)
	if err != nil {
		return
	}
	// The raw syscall returns 20 - nice (1 for nice 19, 40 for nice -20).
	_ = unix.Setpriority(unix.PRIO_PROCESS, 0, min(20-cur+inc, 19))
}

// fault faults in mem[lo:hi] with the plan's method, in pieces of at most
// prefaultPiece bytes, and returns errPrefaultStopped, wrapped, when p.stop
// is closed before a piece.
func (p prefaultPlan) fault(mem []byte, lo, hi int64) error {
	piece := alignUp(prefaultPiece, p.align)
	for off := lo; off < hi; off += piece {
		select {
		case <-p.stop:
			return fmt.Errorf("%w: at byte %d of [%d, %d)", errPrefaultStopped, off, lo, hi)
		default:
		}
		if err := p.faultPiece(mem, off, min(off+piece, hi)); err != nil {
			return err
		}
	}
	return nil
}

// faultPiece faults in mem[lo:hi] with the plan's method.
func (p prefaultPlan) faultPiece(mem []byte, lo, hi int64) error {
	chunk := mem[lo:hi]
	if p.method == PrefaultPopulate && !populateUnsupported.Load() {
		err := unix.Madvise(chunk, unix.MADV_POPULATE_WRITE)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("bytes [%d, %d): madvise(MADV_POPULATE_WRITE): %w", lo, hi, err)
		}
		populateUnsupported.Store(true)
	}
	touch(chunk, p.page)
	return nil
}

// touch adds zero atomically to the first word of every page of chunk: a
// write fault per page that never changes the contents, not even of a page
// another goroutine writes at the same time. chunk starts on a page
// boundary and is a whole number of pages long.
func touch(chunk []byte, page int64) {
	for off := int64(0); off < int64(len(chunk)); off += page {
		atomic.AddUint32((*uint32)(unsafe.Pointer(&chunk[off])), 0)
	}
}
