package transfer

import (
	"errors"
	"fmt"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// Early events on CUDA: stream memory operations (cuStreamWaitValue64_v2
// and cuStreamWriteValue64_v2, bound when the driver exports them, CUDA
// ≥ 11.7; the _v2 forms need no nvidia module parameter). Each direction
// has a 64-bit counter in device memory, written only by its engine
// stream, with values that only grow; a signal stream per direction
// records an op's events behind waits for the counter to reach the op's
// values (Promise), and a snapshot stream per direction captures a
// caller's After event at Submit time (Snapshot). So an op's events are
// valid when Submit returns while its copies are still being built: each
// completes only after the engine stream has written its value, which it
// does after the op's copies (Fulfil).

// earlyState is the CUDA device's early-event machinery (zero when the
// driver lacks stream memory operations or they failed their check).
type earlyState struct {
	on      bool
	counter cuda.DevicePtr // two 64-bit words: Load's, Store's
	signal  [2]cuda.Stream // where promised events are recorded
	snap    [2]cuda.Stream // where After snapshots are taken
	why     string         // why early events are off
}

// setupEarly prepares early events if the driver has stream memory
// operations; on any failure they are off (the reason kept) and the
// scheduler falls back to issuing an op with events before Submit
// returns. Called by newCUDA on a thread with the context current.
func (c *CUDA) setupEarly() {
	if !c.drv.HasStreamMemOps() {
		c.early.why = "the driver does not export cuStreamWaitValue64_v2 and cuStreamWriteValue64_v2"
		return
	}
	err := func() error {
		p, err := c.drv.MemAlloc(16)
		if err != nil {
			return fmt.Errorf("allocating the counters: %w", err)
		}
		c.early.counter = p
		if err := c.drv.MemsetD8(p, 0, 16); err != nil {
			return fmt.Errorf("zeroing the counters: %w", err)
		}
		_, greatest, err := c.drv.StreamPriorityRange()
		if err != nil {
			return err
		}
		for _, d := range []Direction{Load, Store} {
			if c.early.signal[d], err = c.drv.StreamCreate(cuda.StreamNonBlocking, greatest); err != nil {
				return fmt.Errorf("creating the %v signal stream: %w", d, err)
			}
			if c.early.snap[d], err = c.drv.StreamCreate(cuda.StreamNonBlocking, greatest); err != nil {
				return fmt.Errorf("creating the %v snapshot stream: %w", d, err)
			}
			// A wait already satisfied and a write of the current value:
			// both calls must work here before the scheduler relies on them.
			if err := c.drv.StreamWaitValue64(c.early.signal[d], c.word(d), 0, cuda.StreamWaitValueGEQ); err != nil {
				return err
			}
			if err := c.drv.StreamWriteValue64(c.streams[d], c.word(d), 0, cuda.StreamWriteValueDefault); err != nil {
				return err
			}
			if err := errors.Join(c.drv.StreamSynchronize(c.early.signal[d]), c.drv.StreamSynchronize(c.streams[d])); err != nil {
				return err
			}
		}
		return nil
	}()
	if err != nil {
		c.early.why = err.Error()
		_ = c.closeEarly()
		return
	}
	c.early.on = true
}

func (c *CUDA) word(d Direction) cuda.DevicePtr { return c.early.counter + cuda.DevicePtr(8*int(d)) }

// closeEarly releases the early-event streams and counters.
func (c *CUDA) closeEarly() error {
	var err error
	for _, ss := range []*[2]cuda.Stream{&c.early.signal, &c.early.snap} {
		for d, s := range ss {
			if s != 0 {
				err = errors.Join(err, c.drv.StreamDestroy(s))
				ss[d] = 0
			}
		}
	}
	if c.early.counter != 0 {
		err = errors.Join(err, c.drv.MemFree(c.early.counter))
		c.early.counter = 0
	}
	c.early.on = false
	return err
}

// EarlyEvents reports whether the device gives early events (see the
// package doc); EarlyEventsOff says why not when it does not.
func (c *CUDA) EarlyEvents() bool { return c.early.on }

// EarlyEventsOff is why early events are off ("" when they are on).
func (c *CUDA) EarlyEventsOff() string { return c.early.why }

// StartEarly reports whether early events can start: they need the copier
// to keep its device memory instead of freeing it on the submitting thread
// (cudacopy.Copier.KeepIdle, which newCUDA asked for): cuMemFree can wait
// for the device to go idle, which it never does while a signal stream
// waits for a value that thread has yet to write.
//
// Early events also turn the copier's pitched staging DMAs on (off until
// then, see newCUDA): a per-layer load's layers of consecutive slots go
// through device staging by DMA instead of the copy kernel.
func (c *CUDA) StartEarly() bool {
	if !c.early.on || !c.keepIdle {
		return false
	}
	c.copier.SetPitchedStaging(true)
	return true
}

// SetSyncGuard has the copier's calibration run its frees (calls that may
// wait for the device to go idle) through g: with early events the
// scheduler's Quiesce (cudacopy.Copier.SetSyncGuard).
func (c *CUDA) SetSyncGuard(g func(func() error) error) { c.copier.SetSyncGuard(g) }

// Promise records evs on dir's signal stream behind a wait for dir's
// counter to reach v.
func (c *CUDA) Promise(dir Direction, v uint64, evs []Event) error {
	s := c.early.signal[dir]
	if err := c.drv.StreamWaitValue64(s, c.word(dir), v, cuda.StreamWaitValueGEQ); err != nil {
		return err
	}
	for _, e := range evs {
		if err := c.drv.EventRecord(cuda.Event(e), s); err != nil {
			return err
		}
	}
	return nil
}

// Fulfil has dir's engine stream write v to dir's counter after the work
// of dir enqueued so far (on the stream tail gives: the values are written
// in order, since the load stream joins the bounce stream before anything
// it does after the bounce stream's writes).
func (c *CUDA) Fulfil(dir Direction, v uint64) error {
	return c.drv.StreamWriteValue64(c.tail(dir), c.word(dir), v, cuda.StreamWriteValueDefault)
}

// Snapshot records snap on dir's snapshot stream behind a wait for the
// caller's event as it is now.
func (c *CUDA) Snapshot(dir Direction, caller, snap Event) error {
	s := c.early.snap[dir]
	if err := c.drv.StreamWaitEvent(s, cuda.Event(caller), cuda.EventWaitDefault); err != nil {
		return err
	}
	return c.drv.EventRecord(cuda.Event(snap), s)
}

// OnThread runs f on the calling goroutine's thread with the context
// current and capture mode relaxed, both restored afterwards (a caller's
// thread keeps its own).
func (c *CUDA) OnThread(f func() error) error { return cuda.OnThread(c.drv, c.ctx, f) }
