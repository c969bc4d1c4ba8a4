package register

import (
	"errors"
	"fmt"
	"os"
	"unsafe"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/mmapmem"
)

// MaxRangeSize is the default and largest CUDA registration range: 64 GiB.
const MaxRangeSize int64 = 64 << 30

// RegisterFlags are the flags every CUDA registration uses: portable to all
// contexts, and mapped into the device address space (harmless with unified
// addressing, and what MemHostGetDevicePointer relies on).
const RegisterFlags = cuda.HostRegisterPortable | cuda.HostRegisterDeviceMap

// CUDAOptions configure a CUDA pinner.
type CUDAOptions struct {
	// RangeLimit is the largest registration range in bytes: 0 means
	// MaxRangeSize. It must be a positive multiple of the page size, at most
	// MaxRangeSize.
	RangeLimit int64
}

// RangeError is a failed registration of one range. Ranges 0..Index-1 were
// registered and have been unregistered again.
type RangeError struct {
	Region string // the region, as mmapmem.Region.String reports it
	Index  int    // the range that failed
	Count  int    // how many ranges the region has
	Range  Range
	Err    error // the driver's error (*cuda.Error)
}

func (e *RangeError) Error() string {
	return fmt.Sprintf("register: cuda: range %d of %d (offset %d, %d bytes) of %s failed, %d earlier ranges rolled back: %v",
		e.Index, e.Count, e.Range.Off, e.Range.Len, e.Region, e.Index, e.Err)
}

func (e *RangeError) Unwrap() error { return e.Err }

// CUDA pins regions with cuMemHostRegister_v2.
type CUDA struct {
	*tracker
	drv cuda.Driver
	ctx cuda.Context
}

var _ Pinner = (*CUDA)(nil)

// NewCUDA returns a CUDA pinner that registers with drv in context ctx. Each
// call locks the calling goroutine to its OS thread, makes ctx current there
// (it stays current afterwards) and sets the thread's stream capture mode to
// relaxed for the duration of the driver calls.
func NewCUDA(drv cuda.Driver, ctx cuda.Context, opts CUDAOptions) (*CUDA, error) {
	if drv == nil {
		return nil, fmt.Errorf("register: cuda: no driver: %w", cuda.ErrNoDriver)
	}
	limit := opts.RangeLimit
	if limit == 0 {
		limit = MaxRangeSize
	}
	page := int64(os.Getpagesize())
	if limit < 0 || limit > MaxRangeSize || limit%page != 0 {
		return nil, fmt.Errorf("%w: RangeLimit %d: must be a positive multiple of the page size %d, at most %d (MaxRangeSize)",
			ErrOptions, opts.RangeLimit, page, MaxRangeSize)
	}
	c := &CUDA{drv: drv, ctx: ctx}
	c.tracker = newTracker("cuda", func(*mmapmem.Region) int64 { return limit }, c.pin, c.unpin)
	return c, nil
}

func (c *CUDA) pin(r *mmapmem.Region, ranges []Range) (pinned []Range, err error) {
	err = cuda.OnThread(c.drv, c.ctx, func() error {
		for k, rg := range ranges {
			rerr := c.drv.MemHostRegister(unsafe.Add(r.Pointer(), rg.Off), uint64(rg.Len), RegisterFlags)
			if rerr == nil {
				pinned = ranges[:k+1]
				continue
			}
			fail := &RangeError{Region: r.String(), Index: k, Count: len(ranges), Range: rg, Err: rerr}
			var rollback error
			pinned, rollback = c.unpinLocked(r, pinned)
			if rollback != nil {
				return errors.Join(fail, fmt.Errorf("register: cuda: rollback left %d ranges registered: %w", len(pinned), rollback))
			}
			return fail
		}
		return nil
	})
	return pinned, err
}

func (c *CUDA) unpin(r *mmapmem.Region, ranges []Range) (left []Range, err error) {
	left = ranges
	err = cuda.OnThread(c.drv, c.ctx, func() error {
		var uerr error
		left, uerr = c.unpinLocked(r, ranges)
		return uerr
	})
	return left, err
}

// unpinLocked unregisters ranges in reverse order on a thread already set
// up by OnThread and returns those that could not be unregistered.
func (c *CUDA) unpinLocked(r *mmapmem.Region, ranges []Range) (left []Range, err error) {
	var errs []error
	for k := len(ranges) - 1; k >= 0; k-- {
		rg := ranges[k]
		if uerr := c.drv.MemHostUnregister(unsafe.Add(r.Pointer(), rg.Off)); uerr != nil {
			left = append([]Range{rg}, left...)
			errs = append(errs, fmt.Errorf("register: cuda: unregister range %d (offset %d, %d bytes) of %s: %w", k, rg.Off, rg.Len, r, uerr))
		}
	}
	return left, errors.Join(errs...)
}
