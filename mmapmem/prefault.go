package mmapmem

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// populateUnsupported is set once MADV_POPULATE_WRITE (Linux ≥ 5.14) was
// refused with EINVAL; prefaulting then touches one byte per page.
var populateUnsupported atomic.Bool

// prefault faults in every page of mem for writing, splitting it into
// chunks that are multiples of align, one per OS thread (at most threads).
// Each worker is locked to its thread so the work really runs in parallel
// and, without a NUMA binding, lands on that thread's local node.
func prefault(mem []byte, page, align int64, threads int) error {
	n := int64(len(mem))
	units := (n + align - 1) / align
	workers := min(int64(threads), units)
	per := (units + workers - 1) / workers * align
	var wg sync.WaitGroup
	errs := make([]error, workers)
	for w := range workers {
		lo := w * per
		hi := min(lo+per, n)
		if lo >= hi {
			continue
		}
		wg.Go(func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			if err := populate(mem[lo:hi], page); err != nil {
				errs[w] = fmt.Errorf("bytes [%d, %d): %w", lo, hi, err)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// populate faults in chunk for writing with MADV_POPULATE_WRITE, or by
// writing one byte per page where the kernel lacks it.
func populate(chunk []byte, page int64) error {
	if !populateUnsupported.Load() {
		err := unix.Madvise(chunk, unix.MADV_POPULATE_WRITE)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("madvise(MADV_POPULATE_WRITE): %w", err)
		}
		populateUnsupported.Store(true)
	}
	touch(chunk, page)
	return nil
}

// touch writes a zero into the first byte of every page of chunk (fresh
// pages are zero, so contents do not change).
func touch(chunk []byte, page int64) {
	for off := int64(0); off < int64(len(chunk)); off += page {
		chunk[off] = 0
	}
}
