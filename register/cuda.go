package register

import (
	"errors"
	"fmt"
	"os"
	"unsafe"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/mmapmem"
)

// maxRangeSize is the default and largest CUDA registration range: 64 GiB.
const maxRangeSize int64 = 64 << 30

// Context is the CUDA context a CUDA pinner registers in: the module's
// device context (the offload engine's) implements it over the driver.
type Context interface {
	// Do runs f on the calling goroutine's OS thread, locked, with the
	// context current and the stream capture mode relaxed, the thread's
	// previous context and capture mode restored afterwards.
	Do(f func() error) error
	// HostRegister pins [p, p+n) (cuMemHostRegister_v2, portable to all
	// contexts and mapped into the device address space) and
	// HostUnregister unpins the registration at p; both on a thread Do
	// prepared.
	HostRegister(p unsafe.Pointer, n uint64) error
	HostUnregister(p unsafe.Pointer) error
}

// CUDAOptions configure a CUDA pinner.
type CUDAOptions struct {
	// RangeLimit is the largest registration range in bytes: 0 means
	// the default and largest, 64 GiB. It must be a positive multiple of
	// the page size, at most 64 GiB.
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

// rangeError is a failed registration of one range: its prefault (for a
// region mapped with mmapmem.Options.DeferPrefault) or its pinning. Ranges
// 0..Index-1 were pinned and have been unpinned again.
type rangeError struct {
	Pinner string // the pinner's Kind
	Region string // the region, as mmapmem.Region.String reports it
	Index  int    // the range that failed
	Count  int    // how many ranges the region has
	Range  Range
	Err    error // the driver's (*cuda.Error) or the prefault's error
}

func (e *rangeError) Error() string {
	return fmt.Sprintf("register: %s: range %d of %d (offset %d, %d bytes) of %s failed, %d earlier ranges rolled back: %v",
		e.Pinner, e.Index, e.Count, e.Range.Off, e.Range.Len, e.Region, e.Index, e.Err)
}

func (e *rangeError) Unwrap() error { return e.Err }

// cudaPinner pins regions with cuMemHostRegister_v2 (NewCUDA).
type cudaPinner struct {
	*tracker
	ctx Context
}

var _ Pinner = (*cudaPinner)(nil)

// NewCUDA returns a CUDA pinner that registers in ctx (of Kind "cuda").
// Each call runs the driver calls through ctx.Do: on the calling
// goroutine's OS thread, locked, with the context current and the stream
// capture mode relaxed, both restored afterwards. A nil ctx is an error
// wrapping ErrNoDriver (the module's, offload.ErrNoDriver).
func NewCUDA(ctx Context, opts CUDAOptions) (Pinner, error) {
	if ctx == nil {
		return nil, fmt.Errorf("register: cuda: no driver: %w", cuda.ErrNoDriver)
	}
	limit := opts.RangeLimit
	if limit == 0 {
		limit = maxRangeSize
	}
	page := int64(os.Getpagesize())
	if limit < 0 || limit > maxRangeSize || limit%page != 0 {
		return nil, fmt.Errorf("%w: RangeLimit %d: must be a positive multiple of the page size %d, at most %d (MaxRangeSize)",
			ErrOptions, opts.RangeLimit, page, maxRangeSize)
	}
	chunk, err := pipelineChunk(opts.PipelineChunk, page)
	if err != nil {
		return nil, err
	}
	c := &cudaPinner{ctx: ctx}
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
func (c *cudaPinner) pin(r *mmapmem.Region, ranges []Range) (pinned []Range, err error) {
	err = c.ctx.Do(func() error {
		k, perr := eachPrefaulted(r, ranges, func(k int, rg Range) error {
			if err := c.ctx.HostRegister(unsafe.Add(r.Pointer(), rg.Off), uint64(rg.Len)); err != nil {
				return err
			}
			pinned = ranges[:k+1]
			return nil
		})
		if perr == nil {
			return nil
		}
		fail := &rangeError{Pinner: c.kind, Region: r.String(), Index: k, Count: len(ranges), Range: ranges[k], Err: perr}
		var rollback error
		pinned, rollback = c.unpinLocked(r, pinned)
		if rollback != nil {
			return errors.Join(fail, fmt.Errorf("register: cuda: rollback left %d ranges registered: %w", len(pinned), rollback))
		}
		return fail
	})
	return pinned, err
}

func (c *cudaPinner) unpin(r *mmapmem.Region, ranges []Range) (left []Range, err error) {
	left = ranges
	err = c.ctx.Do(func() error {
		var uerr error
		left, uerr = c.unpinLocked(r, ranges)
		return uerr
	})
	return left, err
}

// unpinLocked unregisters ranges in reverse order on a thread already set
// up by Do and returns those that could not be unregistered.
func (c *cudaPinner) unpinLocked(r *mmapmem.Region, ranges []Range) (left []Range, err error) {
	var errs []error
	for k := len(ranges) - 1; k >= 0; k-- {
		rg := ranges[k]
		if uerr := c.ctx.HostUnregister(unsafe.Add(r.Pointer(), rg.Off)); uerr != nil {
			left = append([]Range{rg}, left...)
			errs = append(errs, fmt.Errorf("register: cuda: unregister range %d (offset %d, %d bytes) of %s: %w", k, rg.Off, rg.Len, r, uerr))
		}
	}
	return left, errors.Join(errs...)
}
