package cudadev

import (
	"errors"
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	"github.com/kvoffload/kvoffload/transfer"
)

// CUDA is the Device over the CUDA driver: two non-blocking streams of its
// own (loads at the greatest priority, stores at the least), copies through a
// cudacopy.Copier. Copies of whole blocks whose host runs are long
// (Gatherable, Scatterable) are bounced through device memory so that the
// DMA engines move them: stores are gathered on a stream of their own
// (cudacopy.SubmitGather) and copied out on the store stream; loads are
// copied in on the load stream and scattered on another stream
// (cudacopy.SubmitScatterOpen). Every Wait on a direction's stream is also made
// on its bounce stream, so a gather reads, and a scatter writes, the device
// only after what the copy waits for; the direction's stream joins each
// bounce kernel (the store stream before its DMA; the load stream after
// the last scatter, lazily: consecutive scattered copies keep the DMA
// engine busy, and the load stream joins the scatter stream before
// anything that must follow them there, an event, a counter write, a sync
// or another copy), so events recorded on it cover both. Bounced copies of
// whole blocks are faster than the copy kernels each way, and much faster
// both ways at once, because the DMA engines do the host side.
type CUDA struct {
	drv     cuda.Driver
	ctx     cuda.Context
	streams [2]cuda.Stream
	bounce  [2]cuda.Stream // per direction: the scatter (Load) and gather (Store) kernels' streams
	copier  *cudacopy.Copier
	// counted is the copier, kept after Close clears copier: its counters
	// stay readable (PitchedCopies) from any goroutine.
	counted *cudacopy.Copier
	scratch []cudacopy.Segment   // Copy is called only by the submitting thread
	scr2D   []cudacopy.Segment2D // Copy's, for batches holding strided segments
	tickets []cudacopy.Ticket    // Copy's, likewise
	// joinEv is recorded on the load bounce stream and waited for on the
	// load stream when open (a scattered copy's last scatter not yet
	// joined; see join). Both belong to the submitting thread.
	joinEv  cuda.Event
	open    bool
	bounced atomic.Int64 // copies submitted bounced (BounceCopies)
	splits  atomic.Int64 // BudgetSplits
	prepped atomic.Int64 // copies enqueued as prepared (PreparedCopies)
	// templated counts template copies (CopyTemplate).
	templated atomic.Int64
	// meter is the copier, kept after Close for its device memory counters.
	meter *cudacopy.Copier
	// calibrateLater: Calibrate has the copy methods to measure (set by
	// Context.NewCUDA before the device is used; read and cleared by the
	// one goroutine that calibrates).
	calibrateLater bool
	// keepIdle: the copier keeps its device memory (KeepIdle, set by
	// newCUDA; false when MaxDeviceBytes is too small to split).
	keepIdle bool
}

// What newCUDA has the copier allocate ahead (cudacopy.Copier.Prewarm):
// tables for a per-layer load of 32 layers (the first in up to six parts:
// the engine's copyPlan) and then some, two rings of
// staging chunks; once the calibration has freed its buffer (warmStaging),
// as many more rings as the staging share holds (it stops there).
const prewarmTables, prewarmRings, prewarmRingsMax = 40, 2, 64

// prewarmCopyEvents is how many events newCUDA has the copier create
// ahead (cudacopy.Copier.PrewarmEvents): on the fake driver the first
// gathered store of 128 8B-class blocks took 36 and a per-layer load of
// 32 layers (a launch each) up to 66 while earlier ones were in flight.
const prewarmCopyEvents = 128

// warmStaging fills the copier's staging share of MaxDeviceBytes with idle
// chunks (with KeepIdle only: otherwise Prewarm would free idle tables to
// make room). A store's parts each take a ring of chunks while in flight:
// with two rings ready, the first store of an engine allocated the rest
// on the submitting thread, a millisecond per part (cuMemAlloc), and ran at
// 0.69-0.72 of the link against 0.93 for the next ones (BenchmarkGPUPagedReload
// traced, 128 blocks, H200). Called on the context's thread after the
// calibration, or in NewCUDA when none is pending; short of memory, the
// copies allocate as before.
func (c *CUDA) warmStaging() {
	if c.keepIdle {
		_ = c.copier.Prewarm(0, prewarmRingsMax)
	}
}

// descCapacity is the descriptor table size the engine's copier gets
// unless its options set one (cudacopy's default is 65536): 512 KiB, one
// part of a lazy op (about 4096 segments, up to 4 descriptors each at the
// default 64 KiB chunk) per table, so that the tables' share of the
// default MaxDeviceBytes under KeepIdle (an eighth, 32 MiB) holds 64 of
// them: a per-layer load keeps a table per layer in flight without
// waiting, where 2 MiB tables left it 16 and the submitting thread waited
// for earlier layers.
const descCapacity = 1 << 14

// NewOn is newCUDA for tests and benchmarks that hold the driver, the
// device and its current context themselves (no calibration pending, no
// warm staging: what opts give).
func NewOn(drv cuda.Driver, dev cuda.Device, ctx cuda.Context, opts CopyOptions) (*CUDA, error) {
	return newCUDA(drv, dev, ctx, opts)
}

// newCUDA creates the engine's streams and copier on dev. The copier's
// device memory (descriptor tables, bounce chunks) stays within
// opts.MaxDeviceBytes (default cudacopy.DefaultMaxDeviceBytes): a Copy
// short of it waits, on the submitting thread, for the oldest earlier copy
// to complete, and a copy no single copier call could hold is split in
// halves (BudgetSplits). The calling OS
// thread must have ctx (dev's context) current; the engine threads make it
// current on theirs.
func newCUDA(drv cuda.Driver, dev cuda.Device, ctx cuda.Context, opts cudacopy.Options) (*CUDA, error) {
	least, greatest, err := drv.StreamPriorityRange()
	if err != nil {
		return nil, fmt.Errorf("transfer: stream priorities: %w", err)
	}
	c := &CUDA{drv: drv, ctx: ctx}
	prio := [2]int{transfer.Load: greatest, transfer.Store: least}
	for _, d := range []transfer.Direction{transfer.Load, transfer.Store} {
		s, err := drv.StreamCreate(cuda.StreamNonBlocking, prio[d])
		if err != nil {
			return nil, errors.Join(fmt.Errorf("transfer: creating the %v stream: %w", d, err), c.destroyStreams())
		}
		c.streams[d] = s
	}
	// Each bounce stream at its direction's priority. Beside the model's
	// kernels, gathers of large blocks keep their rate even at the least
	// priority; gathers of small blocks of small segments would starve, but
	// the engine does not gather those (Gatherable).
	for _, d := range []transfer.Direction{transfer.Load, transfer.Store} {
		s, err := drv.StreamCreate(cuda.StreamNonBlocking, prio[d])
		if err != nil {
			return nil, errors.Join(fmt.Errorf("transfer: creating the %v bounce stream: %w", d, err), c.destroyStreams())
		}
		c.bounce[d] = s
	}
	if c.joinEv, err = drv.EventCreate(cuda.EventDisableTiming); err != nil {
		return nil, errors.Join(fmt.Errorf("transfer: creating the scatter join event: %w", err), c.destroyStreams())
	}
	if opts.DescCapacity == 0 {
		opts.DescCapacity = descCapacity
	}
	c.copier, err = cudacopy.New(drv, dev, opts)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("transfer: copier: %w", err), c.destroyStreams())
	}
	c.counted = c.copier
	// Pitched staging DMAs: a per-layer load's layers of consecutive
	// slots go through device staging by DMA instead of the copy kernel.
	// Their enqueueing waits for staging to free up, on the submitting
	// thread only: a Submit returns before it, and a layer's event is
	// recorded once its copies are enqueued.
	c.copier.SetPitchedStaging(true)
	c.meter = c.copier
	// The copier keeps its device memory pooled, tables and staging each
	// within a share of the bound, instead of freeing one kind's idle
	// memory for the other on the submitting thread: a store's staging
	// chunks then a per-layer load's tables made every op free and
	// allocate again (cuMemFree, cuMemHostAlloc: milliseconds each, and
	// cuMemFree may wait for the device to go idle). Too small a bound to
	// split: as before.
	c.keepIdle = c.copier.KeepIdle()
	// Warm start: the first copies find their descriptor tables and two
	// rings of staging chunks ready instead of allocating them on the
	// submitting thread. Short of memory, the copies allocate as before.
	_ = c.copier.Prewarm(prewarmTables, prewarmRings)
	_ = c.copier.PrewarmEvents(prewarmCopyEvents)
	// The automatic choice of method is calibrated on this device before
	// anything is queued (a fraction of a second, see
	// cudacopy.CalibrationConfig), unless the method is forced or a saved
	// calibration was given.
	if opts.Method == cudacopy.MethodAuto && opts.Calibration == nil {
		if _, err := c.copier.Calibrate(c.streams[transfer.Store]); err != nil {
			return nil, errors.Join(fmt.Errorf("transfer: calibrating copy methods: %w", err), c.copier.Close(), c.destroyStreams())
		}
	}
	return c, nil
}

// destroyStreams destroys the streams and the scatter join event.
func (c *CUDA) destroyStreams() error {
	var err error
	if c.joinEv != 0 {
		err = c.drv.EventDestroy(c.joinEv)
		c.joinEv = 0
	}
	for _, ss := range []*[2]cuda.Stream{&c.streams, &c.bounce} {
		for d, s := range ss {
			if s != 0 {
				err = errors.Join(err, c.drv.StreamDestroy(s))
				ss[d] = 0
			}
		}
	}
	return err
}

// BounceCopies is the number of copies Copy submitted bounced through device
// memory (stores gathered, loads scattered); safe to call at any time, also
// after Close.
func (c *CUDA) BounceCopies() int64 { return c.bounced.Load() }

// PitchedCopies is the number of pitched DMAs the bounced copies made
// (cudacopy.Copier.PitchedCopies): host runs of one length at one pitch,
// such as a layer of consecutive slots; safe to call at any time, also
// after Close.
func (c *CUDA) PitchedCopies() int64 { return int64(c.counted.PitchedCopies()) }

// BudgetWaits is how many times a copy waited for earlier copies to free
// device memory (cudacopy.Copier.BudgetWaits); safe to call at any time,
// also after Close.
func (c *CUDA) BudgetWaits() int64 { return c.counted.BudgetWaits() }

// Copier is the copy method the device uses (for its Fill and Checksum
// kernels, calibration, and capabilities).
func (c *CUDA) Copier() *cudacopy.Copier { return c.copier }

// Stream is the engine's stream for dir.
func (c *CUDA) Stream(dir transfer.Direction) transfer.Stream { return transfer.Stream(c.streams[dir]) }

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
//
// A batch holding a strided segment (Segment.Rows > 1) goes whole to
// cudacopy's Submit2D (its contiguous segments as one-row ones): never
// gathered or scattered, which move whole contiguous blocks.
func (c *CUDA) Copy(dir transfer.Direction, segs []transfer.Segment) (func(), error) {
	strided := slices.ContainsFunc(segs, transfer.Segment.Strided)
	ts := c.tickets[:0]
	defer func() { c.tickets = ts[:0] }()
	var err error
	if strided {
		c.scr2D = to2D(dir, segs, c.scr2D[:0])
		err = c.submit2D(dir, c.scr2D, &ts)
	} else {
		c.scratch = c.scratch[:0]
		for _, g := range segs {
			if dir == transfer.Load {
				c.scratch = append(c.scratch, cudacopy.Segment{Dst: g.Dev, Src: g.Host, Len: g.Len})
			} else {
				c.scratch = append(c.scratch, cudacopy.Segment{Dst: g.Host, Src: g.Dev, Len: g.Len})
			}
		}
		err = c.submit(dir, c.scratch, &ts)
	}
	return c.retirer(dir, ts, err)
}

// retirer ends a copy submitted as the tickets ts (several where it was
// split): on err, the pieces already enqueued are waited for (their memory
// is reused only once they are known finished) and retired; otherwise the
// function that retires them all.
func (c *CUDA) retirer(dir transfer.Direction, ts []cudacopy.Ticket, err error) (func(), error) {
	if err != nil {
		if len(ts) > 0 {
			err = errors.Join(err, c.join(dir), c.drv.StreamSynchronize(c.streams[dir]))
			for _, t := range ts {
				_ = c.copier.Retire(t)
			}
		}
		return nil, err
	}
	if len(ts) == 1 {
		t := ts[0]
		return func() { _ = c.copier.Retire(t) }, nil
	}
	split := slices.Clone(ts)
	return func() {
		for _, t := range split {
			_ = c.copier.Retire(t)
		}
	}, nil
}

// devPrep is a part's copy prepared on a builder goroutine (Prepare):
// its strided segments as the copier takes them, and the copier's
// prepared batch.
type devPrep struct {
	segs2D []cudacopy.Segment2D
	p      cudacopy.Prepared
}

// errNotPrepared: Prepare leaves the copy to Copy (1-D segments, whose
// method may bounce them through device memory).
var errNotPrepared = errors.New("transfer: copy not prepared")

// Prepare does a strided Copy's host-side work (conversion, validation,
// the method's choice, descriptor encoding) into p without a driver call
// (preparer); other copies are left to Copy.
func (c *CUDA) Prepare(dir transfer.Direction, segs []transfer.Segment, prep *any) error {
	if !slices.ContainsFunc(segs, transfer.Segment.Strided) {
		return errNotPrepared
	}
	p, _ := (*prep).(*devPrep)
	if p == nil {
		p = &devPrep{}
		*prep = p
	}
	p.segs2D = to2D(dir, segs, p.segs2D[:0])
	return c.copier.Prepare2D(copyDir(dir), p.segs2D, &p.p)
}

// copyDir is dir as the copier names it.
func copyDir(dir transfer.Direction) cudacopy.Path {
	if dir == transfer.Store {
		return cudacopy.D2H
	}
	return cudacopy.H2D
}

// CopyPrepared is Copy(dir, segs) for a p Prepare filled from segs: it
// only enqueues; a batch that needs more descriptor memory than one
// submission may have goes through Copy, which splits it.
func (c *CUDA) CopyPrepared(dir transfer.Direction, segs []transfer.Segment, prep *any) (func(), error) {
	p, ok := (*prep).(*devPrep)
	if !ok {
		return nil, errNotPrepared
	}
	if err := c.join(dir); err != nil {
		return nil, err
	}
	t, err := c.copier.SubmitPrepared(c.streams[dir], &p.p)
	if errors.Is(err, cudacopy.ErrDeviceBudget) {
		return c.Copy(dir, segs)
	}
	if err != nil {
		return nil, err
	}
	c.prepped.Add(1)
	return func() { _ = c.copier.Retire(t) }, nil
}

// to2D appends segs as the copier's strided segments for dir.
func to2D(dir transfer.Direction, segs []transfer.Segment, out []cudacopy.Segment2D) []cudacopy.Segment2D {
	for _, g := range segs {
		rows, row := g.Rows, g.RowLen
		if rows <= 1 {
			rows, row = 1, g.Len
		}
		if dir == transfer.Load {
			out = append(out, cudacopy.Segment2D{Dst: g.Dev, Src: g.Host, Rows: rows, RowLen: row, DstPitch: g.DevPitch, SrcPitch: g.HostPitch})
		} else {
			out = append(out, cudacopy.Segment2D{Dst: g.Host, Src: g.Dev, Rows: rows, RowLen: row, DstPitch: g.HostPitch, SrcPitch: g.DevPitch})
		}
	}
	return out
}

// submit submits segs in one copier call, or, where that needs more device
// memory than the copier's MaxDeviceBytes can ever give one call
// (cudacopy.ErrDeviceBudget), in halves (a lone segment by its length),
// appending each call's ticket to ts in stream order.
func (c *CUDA) submit(dir transfer.Direction, segs []cudacopy.Segment, ts *[]cudacopy.Ticket) error {
	var t cudacopy.Ticket
	var err error
	bounced := false
	switch {
	case dir == transfer.Store && c.copier.Gatherable(segs):
		bounced = true
		t, err = c.copier.SubmitGather(c.bounce[transfer.Store], c.streams[transfer.Store], segs)
	case dir == transfer.Load && c.copier.Scatterable(segs):
		// Left open: the next scattered copy's runs start on the load
		// stream without waiting for this one's last scatter (on error
		// the copier has joined it).
		bounced = true
		t, err = c.copier.SubmitScatterOpen(c.streams[transfer.Load], c.bounce[transfer.Load], segs)
		c.open = c.open || err == nil
	case dir == transfer.Store:
		t, err = c.copier.Submit(c.streams[dir], cudacopy.D2H, segs)
	default:
		if err = c.join(dir); err == nil {
			t, err = c.copier.Submit(c.streams[dir], cudacopy.H2D, segs)
		}
	}
	if err == nil {
		if bounced {
			c.bounced.Add(1)
		}
		*ts = append(*ts, t)
		return nil
	}
	if !errors.Is(err, cudacopy.ErrDeviceBudget) {
		return err
	}
	if len(segs) == 1 {
		g := segs[0]
		half := g.Len / 2 &^ 15 // the kernel's alignment kept
		if half == 0 {
			return err
		}
		c.splits.Add(1)
		if err := c.submit(dir, []cudacopy.Segment{{Dst: g.Dst, Src: g.Src, Len: half}}, ts); err != nil {
			return err
		}
		return c.submit(dir, []cudacopy.Segment{{Dst: g.Dst + half, Src: g.Src + half, Len: g.Len - half}}, ts)
	}
	c.splits.Add(1)
	if err := c.submit(dir, segs[:len(segs)/2], ts); err != nil {
		return err
	}
	return c.submit(dir, segs[len(segs)/2:], ts)
}

// submit2D is submit for a batch of strided segments (cudacopy.Submit2D,
// never bounced): split in halves where one call could never get the
// device memory it needs, a lone segment by its rows.
func (c *CUDA) submit2D(dir transfer.Direction, segs []cudacopy.Segment2D, ts *[]cudacopy.Ticket) error {
	if err := c.join(dir); err != nil {
		return err
	}
	t, err := c.copier.Submit2D(c.streams[dir], copyDir(dir), segs)
	if err == nil {
		*ts = append(*ts, t)
		return nil
	}
	if !errors.Is(err, cudacopy.ErrDeviceBudget) {
		return err
	}
	if len(segs) == 1 {
		g := segs[0]
		if g.Rows < 2 {
			return err
		}
		c.splits.Add(1)
		half := g.Rows / 2
		a, b := g, g
		a.Rows = half
		b.Rows = g.Rows - half
		b.Dst += half * g.DstPitch
		b.Src += half * g.SrcPitch
		if err := c.submit2D(dir, []cudacopy.Segment2D{a}, ts); err != nil {
			return err
		}
		return c.submit2D(dir, []cudacopy.Segment2D{b}, ts)
	}
	c.splits.Add(1)
	if err := c.submit2D(dir, segs[:len(segs)/2], ts); err != nil {
		return err
	}
	return c.submit2D(dir, segs[len(segs)/2:], ts)
}

// DeviceBytes is the device memory the copier has allocated now
// (descriptor tables, bounce chunks, a calibration buffer); 0 after
// Close. PeakDeviceBytes is the most it has had at once, MaxDeviceBytes
// its bound (cudacopy.Options.MaxDeviceBytes). Safe at any time.
func (c *CUDA) DeviceBytes() int64 { return c.meter.DeviceBytes() }

// PeakDeviceBytes: see DeviceBytes.
func (c *CUDA) PeakDeviceBytes() int64 { return c.meter.PeakDeviceBytes() }

// MaxDeviceBytes: see DeviceBytes.
func (c *CUDA) MaxDeviceBytes() int64 { return c.meter.MaxDeviceBytes() }

// PreparedCopies is the number of copies enqueued as prepared
// (CopyPrepared): tests check that a part's copy was prepared on a builder.
func (c *CUDA) PreparedCopies() int64 { return c.prepped.Load() }

// BudgetSplits is the number of times Copy split a copy in two because one
// copier call could never hold it within MaxDeviceBytes.
func (c *CUDA) BudgetSplits() int64 { return c.splits.Load() }

// join makes the load stream wait for the scatters of the scattered
// copies submitted since the last join (nothing for the store stream, or
// when none is open): the load stream's later work, and events recorded
// on it, then follow them. Submitting thread.
func (c *CUDA) join(dir transfer.Direction) error {
	if dir != transfer.Load || !c.open {
		return nil
	}
	if err := c.drv.EventRecord(c.joinEv, c.bounce[transfer.Load]); err != nil {
		return fmt.Errorf("transfer: recording the scatter join event: %w", err)
	}
	if err := c.drv.StreamWaitEvent(c.streams[transfer.Load], c.joinEv, cuda.EventWaitDefault); err != nil {
		return fmt.Errorf("transfer: joining the scatters: %w", err)
	}
	c.open = false
	return nil
}

// tail is the stream on which work enqueued now follows every copy of
// dir submitted so far: while scattered loads are open (see join), the
// load bounce stream, whose last scatter follows its chunk's DMA and
// every earlier scatter, and so everything the load stream held before
// that DMA (a copy that is not scattered joins first, so the load stream
// holds nothing after the open scatters' DMAs but more of their DMAs);
// otherwise dir's stream. Recording an op's event or writing its counter
// there leaves the load stream free to run on into the next part's DMAs:
// a join before each per-layer load's layer event held the DMAs back for
// a scatter at every layer.
func (c *CUDA) tail(dir transfer.Direction) cuda.Stream {
	if dir == transfer.Load && c.open {
		return c.bounce[transfer.Load]
	}
	return c.streams[dir]
}

// Record implements Device (after the scatters of the direction's copies,
// see tail).
func (c *CUDA) Record(dir transfer.Direction, e transfer.Event) error {
	return c.drv.EventRecord(cuda.Event(e), c.tail(dir))
}

// Wait implements Device. It holds the direction's bounce kernel (a
// store's gathers, a load's scatters) too.
func (c *CUDA) Wait(dir transfer.Direction, e transfer.Event) error {
	if err := c.drv.StreamWaitEvent(c.bounce[dir], cuda.Event(e), cuda.EventWaitDefault); err != nil {
		return err
	}
	return c.drv.StreamWaitEvent(c.streams[dir], cuda.Event(e), cuda.EventWaitDefault)
}

// SyncStream implements Device.
func (c *CUDA) SyncStream(dir transfer.Direction) error {
	if err := c.join(dir); err != nil {
		return err
	}
	return c.drv.StreamSynchronize(c.streams[dir])
}

// CreateEvent implements Device.
func (c *CUDA) CreateEvent(blockingSync bool) (transfer.Event, error) {
	flags := cuda.EventDisableTiming
	if blockingSync {
		flags |= cuda.EventBlockingSync
	}
	e, err := c.drv.EventCreate(flags)
	return transfer.Event(e), err
}

// DestroyEvent implements Device.
func (c *CUDA) DestroyEvent(e transfer.Event) error { return c.drv.EventDestroy(cuda.Event(e)) }

// Query implements Device.
func (c *CUDA) Query(e transfer.Event) (bool, error) { return c.drv.EventQuery(cuda.Event(e)) }

// Sync implements Device.
func (c *CUDA) Sync(e transfer.Event) error { return c.drv.EventSynchronize(cuda.Event(e)) }

// IsCapturing implements Device: an active or invalidated capture counts.
func (c *CUDA) IsCapturing(s transfer.Stream) (bool, error) {
	st, err := c.drv.StreamIsCapturing(cuda.Stream(s))
	return st != cuda.CaptureStatusNone, err
}

// Close implements Device: the copier and the streams. The calling thread
// must have the context current and the Scheduler must be closed.
func (c *CUDA) Close() error {
	if c.copier != nil {
		err := c.copier.Close()
		if errors.Is(err, cudacopy.ErrInFlight) {
			// Copies still hold descriptor buffers or bounce chunks: keep the
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
