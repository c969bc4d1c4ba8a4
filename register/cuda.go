package register

import (
	"errors"
	"fmt"
	"os"
	"unsafe"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudahook"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/transfer"
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
	// PipelineChunk is the registration range, at most RangeLimit, for
	// regions mapped with mmapmem.Options.DeferPrefault: Register
	// prefaults each range just before registering it, overlapping the
	// prefault of range k+1 with the registration of range k. 0 means
	// DefaultPipelineChunk. It must be a positive multiple of the page
	// size; above RangeLimit it is cut to RangeLimit. Regions prefaulted
	// by mmapmem.New, or whole by Region.Prefault, are registered in
	// ranges of RangeLimit.
	PipelineChunk int64
}

// RangeError is a failed registration of one range: its prefault (for a
// region mapped with mmapmem.Options.DeferPrefault) or its pinning. Ranges
// 0..Index-1 were pinned and have been unpinned again.
type RangeError struct {
	Pinner string // the pinner's Kind
	Region string // the region, as mmapmem.Region.String reports it
	Index  int    // the range that failed
	Count  int    // how many ranges the region has
	Range  Range
	Err    error // the driver's (*cuda.Error) or the prefault's error
}

func (e *RangeError) Error() string {
	return fmt.Sprintf("register: %s: range %d of %d (offset %d, %d bytes) of %s failed, %d earlier ranges rolled back: %v",
		e.Pinner, e.Index, e.Count, e.Range.Off, e.Range.Len, e.Region, e.Index, e.Err)
}

func (e *RangeError) Unwrap() error { return e.Err }

// CUDA pins regions with cuMemHostRegister_v2.
type CUDA struct {
	*tracker
	drv cuda.Driver
	ctx cuda.Context
}

var _ Pinner = (*CUDA)(nil)

// NewCUDAFor returns a CUDA pinner that registers in c's context (see
// NewCUDA): the way packages above transfer, which never see the driver,
// pin for the context their copies run in.
func NewCUDAFor(c *transfer.Context, opts CUDAOptions) (*CUDA, error) {
	drv, ctx, ok := cudahook.ContextOf(c)
	if !ok {
		return nil, fmt.Errorf("register: cuda: no context: %w", cuda.ErrNoDriver)
	}
	return NewCUDA(drv, ctx, opts)
}

// NewCUDA returns a CUDA pinner that registers with drv in context ctx. Each
// call locks the calling goroutine to its OS thread, makes ctx current there
// and sets the thread's stream capture mode to relaxed for the duration of
// the driver calls (cuda.OnThread): the thread's previous context and
// capture mode are restored afterwards.
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
	chunk, err := pipelineChunk(opts.PipelineChunk, page)
	if err != nil {
		return nil, err
	}
	c := &CUDA{drv: drv, ctx: ctx}
	c.tracker = newTracker("cuda", rangeLimit(limit, min(chunk, limit)), c.pin, c.unpin)
	return c, nil
}

// pipelineChunk validates a PipelineChunk option (0: DefaultPipelineChunk).
func pipelineChunk(chunk, page int64) (int64, error) {
	if chunk == 0 {
		return DefaultPipelineChunk, nil
	}
	if chunk < 0 || chunk%page != 0 {
		return 0, fmt.Errorf("%w: PipelineChunk %d: must be a positive multiple of the page size %d", ErrOptions, chunk, page)
	}
	return chunk, nil
}

// rangeLimit is a tracker's range limit: chunk for regions whose prefault
// was deferred to Register, limit for the others (0: one range).
func rangeLimit(limit, chunk int64) func(*mmapmem.Region) int64 {
	return func(r *mmapmem.Region) int64 {
		if r.Deferred() {
			return chunk
		}
		return limit
	}
}

// pin registers ranges in order, each prefaulted first when r's prefault
// was deferred (see eachPrefaulted), and on a failure at range k
// unregisters ranges 0..k-1 again.
func (c *CUDA) pin(r *mmapmem.Region, ranges []Range) (pinned []Range, err error) {
	err = cuda.OnThread(c.drv, c.ctx, func() error {
		k, perr := eachPrefaulted(r, ranges, func(k int, rg Range) error {
			if err := c.drv.MemHostRegister(unsafe.Add(r.Pointer(), rg.Off), uint64(rg.Len), RegisterFlags); err != nil {
				return err
			}
			pinned = ranges[:k+1]
			return nil
		})
		if perr == nil {
			return nil
		}
		fail := &RangeError{Pinner: c.kind, Region: r.String(), Index: k, Count: len(ranges), Range: ranges[k], Err: perr}
		var rollback error
		pinned, rollback = c.unpinLocked(r, pinned)
		if rollback != nil {
			return errors.Join(fail, fmt.Errorf("register: cuda: rollback left %d ranges registered: %w", len(pinned), rollback))
		}
		return fail
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
