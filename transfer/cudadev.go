package transfer

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/transfer/cudacopy"
)

// CUDA is the Device over the CUDA driver: two non-blocking streams of its
// own (loads at the greatest priority, stores at the least), copies through a
// cudacopy.Copier. Copies of whole blocks whose host runs are long
// (Gatherable, Scatterable) are staged through device memory so that the
// DMA engines move them: stores are gathered on a stream of their own
// (cudacopy.SubmitGather) and copied out on the store stream; loads are
// copied in on the load stream and scattered on another stream
// (cudacopy.SubmitScatter). Every Wait on a direction's stream is also made
// on its staging stream, so a gather reads, and a scatter writes, the device
// only after what the copy waits for; the direction's stream joins each
// staging kernel (the store stream before its DMA, the load stream after
// the last scatter), so events recorded on it cover both. On the H200,
// staged copies of 512 KiB–1 MiB blocks moved 94–97% of the link each way
// and 92–97 GB/s both ways at once, where the copy kernels move 92–93% and
// 78 GB/s (bench/results/2026-11-30-h200-s4/blocks-staged.md).
type CUDA struct {
	drv     cuda.Driver
	ctx     cuda.Context
	streams [2]cuda.Stream
	staging [2]cuda.Stream // per direction: the scatter (Load) and gather (Store) kernels' streams
	copier  *cudacopy.Copier
	scratch []cudacopy.Segment // Copy is called only by the submitting thread
	staged  atomic.Int64       // copies submitted staged (StagedCopies)
}

// NewCUDA creates the engine's streams and copier on dev. The calling OS
// thread must have ctx (dev's context) current; the engine threads make it
// current on theirs.
func NewCUDA(drv cuda.Driver, dev cuda.Device, ctx cuda.Context, opts cudacopy.Options) (*CUDA, error) {
	least, greatest, err := drv.StreamPriorityRange()
	if err != nil {
		return nil, fmt.Errorf("transfer: stream priorities: %w", err)
	}
	c := &CUDA{drv: drv, ctx: ctx}
	prio := [2]int{Load: greatest, Store: least}
	for _, d := range []Direction{Load, Store} {
		s, err := drv.StreamCreate(cuda.StreamNonBlocking, prio[d])
		if err != nil {
			return nil, errors.Join(fmt.Errorf("transfer: creating the %v stream: %w", d, err), c.destroyStreams())
		}
		c.streams[d] = s
	}
	// Each staging stream at its direction's priority. As measured on the
	// H200 (blocks.md): beside a 4096² sgemm, gathers of 512 KiB–1 MiB blocks
	// on the least priority kept 100% of their solo rate; those of 128 KiB
	// blocks of 4 KiB segments starved (17%), but the engine does not gather
	// those.
	for _, d := range []Direction{Load, Store} {
		s, err := drv.StreamCreate(cuda.StreamNonBlocking, prio[d])
		if err != nil {
			return nil, errors.Join(fmt.Errorf("transfer: creating the %v staging stream: %w", d, err), c.destroyStreams())
		}
		c.staging[d] = s
	}
	c.copier, err = cudacopy.New(drv, dev, opts)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("transfer: copier: %w", err), c.destroyStreams())
	}
	// The automatic choice of method is calibrated on this device before
	// anything is queued (about 150 ms on an H200), unless the method is
	// forced or a saved calibration was given.
	if opts.Method == cudacopy.MethodAuto && opts.Calibration == nil {
		if _, err := c.copier.Calibrate(c.streams[Store]); err != nil {
			return nil, errors.Join(fmt.Errorf("transfer: calibrating copy methods: %w", err), c.copier.Close(), c.destroyStreams())
		}
	}
	return c, nil
}

func (c *CUDA) destroyStreams() error {
	var err error
	for _, ss := range []*[2]cuda.Stream{&c.streams, &c.staging} {
		for d, s := range ss {
			if s != 0 {
				err = errors.Join(err, c.drv.StreamDestroy(s))
				ss[d] = 0
			}
		}
	}
	return err
}

// StagedCopies is the number of copies Copy submitted staged through device
// memory (stores gathered, loads scattered); safe to call at any time, also
// after Close.
func (c *CUDA) StagedCopies() int64 { return c.staged.Load() }

// Copier is the copy method the device uses (for its Fill and Checksum
// kernels, calibration, and capabilities).
func (c *CUDA) Copier() *cudacopy.Copier { return c.copier }

// Stream is the engine's stream for dir.
func (c *CUDA) Stream(dir Direction) cuda.Stream { return c.streams[dir] }

// AddHostRange tells the copier about a registered host range (the
// Scheduler forwards its own AddHostRange here). Where the device cannot
// use registered host pointers directly the copier calls
// cuMemHostGetDevicePointer on the calling thread, which must have the
// context current.
func (c *CUDA) AddHostRange(base, size uint64) error {
	return c.copier.AddHostRange(uintptr(base), size)
}

// RemoveHostRange forgets a host range.
func (c *CUDA) RemoveHostRange(base uint64) error { return c.copier.RemoveHostRange(uintptr(base)) }

// InitThread implements Device: the context current and capture mode
// relaxed, so a global-mode capture on another thread is never invalidated
// by the engine's calls.
func (c *CUDA) InitThread() error {
	if err := c.drv.CtxSetCurrent(c.ctx); err != nil {
		return err
	}
	_, err := c.drv.ThreadExchangeStreamCaptureMode(cuda.CaptureModeRelaxed)
	return err
}

// Copy implements Device.
func (c *CUDA) Copy(dir Direction, segs []Segment) (func(), error) {
	c.scratch = c.scratch[:0]
	for _, g := range segs {
		if dir == Load {
			c.scratch = append(c.scratch, cudacopy.Segment{Dst: g.Dev, Src: g.Host, Len: g.Len})
		} else {
			c.scratch = append(c.scratch, cudacopy.Segment{Dst: g.Host, Src: g.Dev, Len: g.Len})
		}
	}
	var t cudacopy.Ticket
	var err error
	staged := false
	switch {
	case dir == Store && c.copier.Gatherable(c.scratch):
		staged = true
		t, err = c.copier.SubmitGather(c.staging[Store], c.streams[Store], c.scratch)
	case dir == Load && c.copier.Scatterable(c.scratch):
		staged = true
		t, err = c.copier.SubmitScatter(c.streams[Load], c.staging[Load], c.scratch)
	case dir == Store:
		t, err = c.copier.Submit(c.streams[dir], cudacopy.D2H, c.scratch)
	default:
		t, err = c.copier.Submit(c.streams[dir], cudacopy.H2D, c.scratch)
	}
	if err != nil {
		return nil, err
	}
	if staged {
		c.staged.Add(1)
	}
	return func() { _ = c.copier.Retire(t) }, nil
}

// Record implements Device.
func (c *CUDA) Record(dir Direction, e cuda.Event) error { return c.drv.EventRecord(e, c.streams[dir]) }

// Wait implements Device. It holds the direction's staging kernels (a
// store's gathers, a load's scatters) too.
func (c *CUDA) Wait(dir Direction, e cuda.Event) error {
	if err := c.drv.StreamWaitEvent(c.staging[dir], e, cuda.EventWaitDefault); err != nil {
		return err
	}
	return c.drv.StreamWaitEvent(c.streams[dir], e, cuda.EventWaitDefault)
}

// SyncStream implements Device.
func (c *CUDA) SyncStream(dir Direction) error { return c.drv.StreamSynchronize(c.streams[dir]) }

// CreateEvent implements Device.
func (c *CUDA) CreateEvent(blockingSync bool) (cuda.Event, error) {
	flags := cuda.EventDisableTiming
	if blockingSync {
		flags |= cuda.EventBlockingSync
	}
	return c.drv.EventCreate(flags)
}

// DestroyEvent implements Device.
func (c *CUDA) DestroyEvent(e cuda.Event) error { return c.drv.EventDestroy(e) }

// Query implements Device.
func (c *CUDA) Query(e cuda.Event) (bool, error) { return c.drv.EventQuery(e) }

// Sync implements Device.
func (c *CUDA) Sync(e cuda.Event) error { return c.drv.EventSynchronize(e) }

// IsCapturing implements Device: an active or invalidated capture counts.
func (c *CUDA) IsCapturing(s cuda.Stream) (bool, error) {
	st, err := c.drv.StreamIsCapturing(s)
	return st != cuda.CaptureStatusNone, err
}

// Close implements Device: the copier and the streams. The calling thread
// must have the context current and the Scheduler must be closed.
func (c *CUDA) Close() error {
	if c.copier != nil {
		err := c.copier.Close()
		if errors.Is(err, cudacopy.ErrInFlight) {
			// Copies still hold descriptor buffers or staging: keep the
			// copier and the streams, so a Close after they are retired
			// frees everything.
			return err
		}
		c.copier = nil
		if err != nil {
			return errors.Join(err, c.destroyStreams())
		}
	}
	return c.destroyStreams()
}
