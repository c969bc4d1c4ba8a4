package cudafake

import (
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

type itemKind uint8

const (
	itemCopy itemKind = iota
	itemBatch
	itemKernel
	itemRecord
	itemWait
	itemHost // runs fn (LaunchHostFunc)
)

// item is one unit of queued work. Items recorded by a capture are
// templates: GraphLaunch enqueues copies, and enqueueLocked fills in the
// event generation.
type item struct {
	kind   itemKind
	dst    uint64
	src    uint64
	n      uint64
	batch  []cuda.BatchCopy
	fn     *function
	host   func()
	args   [][]byte
	ev     *event
	gen    uint64      // record: the generation it completes; wait: the one it waits for
	hang   bool        // record: never completes
	fault  cuda.Result // fails with this (sticky) code when run
	extern bool        // record or wait made with the external flag
}

type stream struct {
	h         cuda.Stream
	queue     []*item
	enq, done uint64 // items enqueued and finished, ever
	capture   *capture
	destroyed bool
}

type capture struct {
	mode        cuda.CaptureMode
	tid         int
	items       []item
	invalidated bool
}

// event tracks generations: every record bumps recorded, and completion of
// that record raises completed to it. The event is complete when they meet
// (so a never-recorded event is complete, as in CUDA).
type event struct {
	flags      uint32
	recorded   uint64
	completed  uint64
	at         time.Time
	inCapture  *capture // last recorded, capture-internally, in this capture
	everTimed  bool
	everRecord bool
}

func (e *event) done() bool { return e.completed >= e.recorded }

// startStreamLocked creates a stream with handle h and starts its goroutine.
func (d *Driver) startStreamLocked(h cuda.Stream) *stream {
	s := &stream{h: h}
	d.streams[h] = s
	d.running[s] = struct{}{}
	d.wg.Add(1)
	go d.serve(s)
	return s
}

// serve runs a stream's items in order until the stream is destroyed and
// drained, or the driver is closed.
func (d *Driver) serve(s *stream) {
	defer d.wg.Done()
	d.mu.Lock()
	defer d.mu.Unlock()
	defer delete(d.running, s) // under mu (deferred after Unlock's defer: runs first)
	for {
		for len(s.queue) == 0 && !s.destroyed && !d.closed {
			d.cond.Wait()
		}
		if d.closed || len(s.queue) == 0 {
			return
		}
		it := s.queue[0]
		if it.kind == itemWait {
			for it.ev.completed < it.gen && !d.closed && d.stickyCode == cuda.Success {
				d.cond.Wait()
			}
			if d.closed {
				return
			}
		}
		delay := d.delayLocked() + d.copyDelayLocked(it)
		poisoned := d.stickyCode != cuda.Success
		d.mu.Unlock()
		res := cuda.Success
		if !poisoned {
			time.Sleep(delay)
			res = d.exec(it)
		}
		d.mu.Lock()
		if res != cuda.Success && d.stickyCode == cuda.Success {
			d.stickyCode = res
		}
		if it.kind == itemRecord && !it.hang && it.gen > it.ev.completed {
			it.ev.completed = it.gen
			it.ev.at = time.Now()
			it.ev.everTimed = true
		}
		s.queue[0] = nil
		s.queue = s.queue[1:]
		s.done++
		d.cond.Broadcast()
	}
}

// exec performs an item's memory effects; a non-success result is the
// sticky error it raises.
func (d *Driver) exec(it *item) cuda.Result {
	if it.fault != cuda.Success {
		return it.fault
	}
	switch it.kind {
	case itemCopy:
		if !d.mem.copyBytes(it.dst, it.src, it.n) {
			return cuda.ErrorIllegalAddress
		}
	case itemBatch:
		for _, c := range it.batch {
			if !d.mem.copyBytes(uint64(c.Dst), uint64(c.Src), c.Size) {
				return cuda.ErrorIllegalAddress
			}
		}
	case itemKernel:
		return d.runKernel(it.fn.name, it.args)
	case itemHost:
		it.host()
	}
	return cuda.Success
}

func (d *Driver) streamLocked(op string, h cuda.Stream) (*stream, error) {
	s, ok := d.streams[h]
	if !ok {
		return nil, cuda.NewError(op, cuda.ErrorInvalidHandle)
	}
	return s, nil
}

func (d *Driver) eventLocked(op string, h cuda.Event) (*event, error) {
	e, ok := d.events[h]
	if !ok {
		return nil, cuda.NewError(op, cuda.ErrorInvalidHandle)
	}
	return e, nil
}

// enqueueLocked queues it on s, or appends it to s's capture. call is the
// index of the call that enqueues it, for StickyAt and HangAt.
func (d *Driver) enqueueLocked(op string, call int, s *stream, it item) error {
	if code := d.stickyAt[opCall{op, call}]; code != cuda.Success {
		it.fault = code
	}
	if d.hangAt[opCall{op, call}] && it.kind == itemRecord {
		it.hang = true
	}
	if c := s.capture; c != nil {
		if c.invalidated {
			return cuda.NewError(op, cuda.ErrorStreamCaptureInvalidated)
		}
		switch {
		case it.kind == itemRecord && !it.extern:
			it.ev.inCapture = c
			return nil
		case it.kind == itemWait && it.ev.inCapture == c:
			return nil
		}
		c.items = append(c.items, it)
		return nil
	}
	switch it.kind {
	case itemRecord:
		it.ev.recorded++
		it.gen = it.ev.recorded
		it.ev.inCapture = nil
		it.ev.everRecord = true
	case itemWait:
		if it.ev.inCapture != nil {
			return cuda.NewError(op, cuda.ErrorNotSupported)
		}
		it.gen = it.ev.recorded
	}
	s.queue = append(s.queue, &it)
	s.enq++
	d.cond.Broadcast()
	return nil
}

// waitStreamLocked waits until s has finished its first target items.
func (d *Driver) waitStreamLocked(op string, s *stream, target uint64) error {
	for s.done < target && !d.closed && d.stickyCode == cuda.Success {
		d.cond.Wait()
	}
	switch {
	case d.closed:
		return cuda.NewError(op, cuda.ErrorDeinitialized)
	case d.stickyCode != cuda.Success:
		return cuda.NewError(op, d.stickyCode)
	}
	return nil
}

// MemcpyAsync implements cuda.Driver.
func (d *Driver) MemcpyAsync(dst, src cuda.DevicePtr, n uint64, s cuda.Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	call, err := d.beginLocked(cuda.OpMemcpyAsync, needCtx)
	if err != nil {
		return err
	}
	if !d.mem.valid(uint64(dst), n) || !d.mem.valid(uint64(src), n) {
		return cuda.NewError(cuda.OpMemcpyAsync, cuda.ErrorInvalidValue)
	}
	st, err := d.streamLocked(cuda.OpMemcpyAsync, s)
	if err != nil {
		return err
	}
	return d.enqueueLocked(cuda.OpMemcpyAsync, call, st, item{kind: itemCopy, dst: uint64(dst), src: uint64(src), n: n})
}

// Memcpy2DAsync implements cuda.Driver: the rows are copied in order when
// the stream reaches the copy, as one item. Like the driver it refuses an
// empty copy, a pitch below the width and rows outside known memory.
func (d *Driver) Memcpy2DAsync(p cuda.Memcpy2D, s cuda.Stream) error {
	const op = cuda.OpMemcpy2DAsync
	d.mu.Lock()
	defer d.mu.Unlock()
	call, err := d.beginLocked(op, needCtx)
	if err != nil {
		return err
	}
	if p.Width == 0 || p.Height == 0 || p.SrcPitch < p.Width || p.DstPitch < p.Width {
		return cuda.NewError(op, cuda.ErrorInvalidValue)
	}
	rows := make([]cuda.BatchCopy, p.Height)
	for r := range rows {
		c := cuda.BatchCopy{Dst: p.Dst + cuda.DevicePtr(uint64(r)*p.DstPitch), Src: p.Src + cuda.DevicePtr(uint64(r)*p.SrcPitch), Size: p.Width}
		if !d.mem.valid(uint64(c.Dst), c.Size) || !d.mem.valid(uint64(c.Src), c.Size) {
			return cuda.NewError(op, cuda.ErrorInvalidValue)
		}
		rows[r] = c
	}
	st, err := d.streamLocked(op, s)
	if err != nil {
		return err
	}
	return d.enqueueLocked(op, call, st, item{kind: itemBatch, batch: rows})
}

// HasMemcpyBatch implements cuda.Driver (Options.NoMemcpyBatch, SetMemcpyBatch).
func (d *Driver) HasMemcpyBatch() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.hasBatch
}

// MemcpyBatchAsync implements cuda.Driver. Like the driver it refuses an
// empty batch and the legacy stream; a copy of zero bytes or outside known
// memory fails the call with a *cuda.BatchError naming it.
func (d *Driver) MemcpyBatchAsync(copies []cuda.BatchCopy, s cuda.Stream) error {
	const op = cuda.OpMemcpyBatchAsync
	d.mu.Lock()
	defer d.mu.Unlock()
	call, err := d.beginLocked(op, needCtx)
	if err != nil {
		return err
	}
	if !d.hasBatch {
		return cuda.NewError(op, cuda.ErrorNotSupported)
	}
	if len(copies) == 0 || s == 0 {
		return &cuda.BatchError{Index: -1, Err: cuda.NewError(op, cuda.ErrorInvalidValue)}
	}
	for i, c := range copies {
		if c.Size == 0 || !d.mem.valid(uint64(c.Dst), c.Size) || !d.mem.valid(uint64(c.Src), c.Size) {
			return &cuda.BatchError{Index: i, Copy: c, Err: cuda.NewError(op, cuda.ErrorInvalidValue)}
		}
	}
	st, err := d.streamLocked(op, s)
	if err != nil {
		return err
	}
	return d.enqueueLocked(op, call, st, item{kind: itemBatch, batch: append([]cuda.BatchCopy(nil), copies...)})
}

// StreamCreate implements cuda.Driver; priorities are clamped to the range
// StreamPriorityRange reports, as the driver does.
func (d *Driver) StreamCreate(flags uint32, priority int) (cuda.Stream, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpStreamCreate, needCtx); err != nil {
		return 0, err
	}
	if flags&^cuda.StreamNonBlocking != 0 {
		return 0, cuda.NewError(cuda.OpStreamCreate, cuda.ErrorInvalidValue)
	}
	return d.startStreamLocked(cuda.Stream(d.handleLocked())).h, nil
}

// StreamDestroy implements cuda.Driver: like the driver it returns at once;
// work already queued still runs.
func (d *Driver) StreamDestroy(h cuda.Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpStreamDestroy, needCtx); err != nil {
		return err
	}
	if h == 0 {
		return cuda.NewError(cuda.OpStreamDestroy, cuda.ErrorInvalidHandle)
	}
	s, err := d.streamLocked(cuda.OpStreamDestroy, h)
	if err != nil {
		return err
	}
	s.destroyed = true
	delete(d.streams, h)
	d.cond.Broadcast()
	return nil
}

// capturingLocked fails a synchronising call on a capturing stream and
// invalidates its capture, as the driver does.
func capturingLocked(op string, s *stream) error {
	if s.capture != nil {
		s.capture.invalidated = true
		return cuda.NewError(op, cuda.ErrorStreamCaptureUnsupported)
	}
	return nil
}

// StreamSynchronize implements cuda.Driver.
func (d *Driver) StreamSynchronize(h cuda.Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpStreamSynchronize, needCtx|unsafeInCapture); err != nil {
		return err
	}
	s, err := d.streamLocked(cuda.OpStreamSynchronize, h)
	if err != nil {
		return err
	}
	if err := capturingLocked(cuda.OpStreamSynchronize, s); err != nil {
		return err
	}
	return d.waitStreamLocked(cuda.OpStreamSynchronize, s, s.enq)
}

// StreamQuery implements cuda.Driver.
func (d *Driver) StreamQuery(h cuda.Stream) (bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpStreamQuery, needCtx|unsafeInCapture); err != nil {
		return false, err
	}
	s, err := d.streamLocked(cuda.OpStreamQuery, h)
	if err != nil {
		return false, err
	}
	if err := capturingLocked(cuda.OpStreamQuery, s); err != nil {
		return false, err
	}
	return s.done == s.enq, nil
}

// StreamWaitEvent implements cuda.Driver: s waits for e's latest record as
// of this call.
func (d *Driver) StreamWaitEvent(h cuda.Stream, e cuda.Event, flags uint32) error {
	return d.eventItem(cuda.OpStreamWaitEvent, itemWait, h, e, flags, cuda.EventWaitExternal)
}

// StreamIsCapturing implements cuda.Driver.
func (d *Driver) StreamIsCapturing(h cuda.Stream) (cuda.CaptureStatus, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpStreamIsCapturing, needCtx); err != nil {
		return 0, err
	}
	s, err := d.streamLocked(cuda.OpStreamIsCapturing, h)
	if err != nil {
		return 0, err
	}
	switch {
	case s.capture == nil:
		return cuda.CaptureStatusNone, nil
	case s.capture.invalidated:
		return cuda.CaptureStatusInvalidated, nil
	}
	return cuda.CaptureStatusActive, nil
}

// StreamBeginCapture implements cuda.Driver for the calling OS thread. The
// legacy stream cannot capture.
func (d *Driver) StreamBeginCapture(h cuda.Stream, mode cuda.CaptureMode) error {
	const op = cuda.OpStreamBeginCapture
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(op, needCtx); err != nil {
		return err
	}
	if mode > cuda.CaptureModeRelaxed {
		return cuda.NewError(op, cuda.ErrorInvalidValue)
	}
	if h == 0 {
		return cuda.NewError(op, cuda.ErrorStreamCaptureUnsupported)
	}
	s, err := d.streamLocked(op, h)
	if err != nil {
		return err
	}
	if s.capture != nil {
		return cuda.NewError(op, cuda.ErrorIllegalState)
	}
	s.capture = &capture{mode: mode, tid: unix.Gettid()}
	return nil
}

// StreamEndCapture implements cuda.Driver. Ending a capture that is not
// relaxed from another thread ends it with
// CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD; an invalidated capture ends with
// CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. Either way no graph is made.
func (d *Driver) StreamEndCapture(h cuda.Stream) (cuda.Graph, error) {
	const op = cuda.OpStreamEndCapture
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(op, needCtx); err != nil {
		return 0, err
	}
	s, err := d.streamLocked(op, h)
	if err != nil {
		return 0, err
	}
	c := s.capture
	if c == nil {
		return 0, cuda.NewError(op, cuda.ErrorIllegalState)
	}
	s.capture = nil
	for _, ev := range d.events {
		if ev.inCapture == c {
			ev.inCapture = nil
		}
	}
	switch {
	case c.mode != cuda.CaptureModeRelaxed && c.tid != unix.Gettid():
		return 0, cuda.NewError(op, cuda.ErrorStreamCaptureWrongThread)
	case c.invalidated:
		return 0, cuda.NewError(op, cuda.ErrorStreamCaptureInvalidated)
	}
	g := cuda.Graph(d.handleLocked())
	d.graphs[g] = c.items
	return g, nil
}

// EventCreate implements cuda.Driver.
func (d *Driver) EventCreate(flags uint32) (cuda.Event, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpEventCreate, needCtx); err != nil {
		return 0, err
	}
	if flags&^(cuda.EventBlockingSync|cuda.EventDisableTiming|cuda.EventInterprocess) != 0 ||
		(flags&cuda.EventInterprocess != 0 && flags&cuda.EventDisableTiming == 0) {
		return 0, cuda.NewError(cuda.OpEventCreate, cuda.ErrorInvalidValue)
	}
	h := cuda.Event(d.handleLocked())
	d.events[h] = &event{flags: flags}
	return h, nil
}

// EventDestroy implements cuda.Driver; queued work that uses the event is
// unaffected.
func (d *Driver) EventDestroy(h cuda.Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpEventDestroy, needCtx); err != nil {
		return err
	}
	if _, err := d.eventLocked(cuda.OpEventDestroy, h); err != nil {
		return err
	}
	delete(d.events, h)
	return nil
}

// eventItem queues on stream h an item of kind (a record or a wait) on
// event e, for op: ext is the one flag op accepts, marking the item
// external.
func (d *Driver) eventItem(op string, kind itemKind, h cuda.Stream, e cuda.Event, flags, ext uint32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	call, err := d.beginLocked(op, needCtx)
	if err != nil {
		return err
	}
	if flags&^ext != 0 {
		return cuda.NewError(op, cuda.ErrorInvalidValue)
	}
	ev, err := d.eventLocked(op, e)
	if err != nil {
		return err
	}
	s, err := d.streamLocked(op, h)
	if err != nil {
		return err
	}
	return d.enqueueLocked(op, call, s, item{kind: kind, ev: ev, extern: flags&ext != 0})
}

// EventRecord implements cuda.Driver.
func (d *Driver) EventRecord(e cuda.Event, s cuda.Stream) error {
	return d.eventItem(cuda.OpEventRecord, itemRecord, s, e, cuda.EventRecordDefault, cuda.EventRecordExternal)
}

// EventRecordWithFlags implements cuda.Driver.
func (d *Driver) EventRecordWithFlags(e cuda.Event, s cuda.Stream, flags uint32) error {
	return d.eventItem(cuda.OpEventRecordWithFlags, itemRecord, s, e, flags, cuda.EventRecordExternal)
}

// EventQuery implements cuda.Driver.
func (d *Driver) EventQuery(e cuda.Event) (bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpEventQuery, needCtx|unsafeInCapture); err != nil {
		return false, err
	}
	ev, err := d.eventLocked(cuda.OpEventQuery, e)
	if err != nil {
		return false, err
	}
	if ev.inCapture != nil {
		return false, cuda.NewError(cuda.OpEventQuery, cuda.ErrorCapturedEvent)
	}
	return ev.done(), nil
}

// EventSynchronize implements cuda.Driver. Waiting on an event that HangAt
// made hang blocks until the driver is closed.
func (d *Driver) EventSynchronize(e cuda.Event) error {
	const op = cuda.OpEventSynchronize
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(op, needCtx|unsafeInCapture); err != nil {
		return err
	}
	ev, err := d.eventLocked(op, e)
	if err != nil {
		return err
	}
	if ev.inCapture != nil {
		return cuda.NewError(op, cuda.ErrorCapturedEvent)
	}
	for !ev.done() && !d.closed && d.stickyCode == cuda.Success {
		d.cond.Wait()
	}
	switch {
	case d.closed:
		return cuda.NewError(op, cuda.ErrorDeinitialized)
	case d.stickyCode != cuda.Success:
		return cuda.NewError(op, d.stickyCode)
	}
	return nil
}

// EventElapsedTime implements cuda.Driver.
func (d *Driver) EventElapsedTime(start, end cuda.Event) (float32, error) {
	const op = cuda.OpEventElapsedTime
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(op, needCtx); err != nil {
		return 0, err
	}
	a, err := d.eventLocked(op, start)
	if err != nil {
		return 0, err
	}
	b, err := d.eventLocked(op, end)
	if err != nil {
		return 0, err
	}
	if (a.flags|b.flags)&cuda.EventDisableTiming != 0 || !a.everRecord || !b.everRecord {
		return 0, cuda.NewError(op, cuda.ErrorInvalidHandle)
	}
	if !a.done() || !b.done() || !a.everTimed || !b.everTimed {
		return 0, cuda.NewError(op, cuda.ErrorNotReady)
	}
	return float32(b.at.Sub(a.at).Seconds() * 1e3), nil
}

// GraphInstantiate implements cuda.Driver.
func (d *Driver) GraphInstantiate(g cuda.Graph) (cuda.GraphExec, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpGraphInstantiate, needCtx); err != nil {
		return 0, err
	}
	items, ok := d.graphs[g]
	if !ok {
		return 0, cuda.NewError(cuda.OpGraphInstantiate, cuda.ErrorInvalidHandle)
	}
	ge := cuda.GraphExec(d.handleLocked())
	d.execs[ge] = append([]item(nil), items...)
	return ge, nil
}

// GraphLaunch implements cuda.Driver: the graph's work is enqueued on s in
// capture order.
func (d *Driver) GraphLaunch(ge cuda.GraphExec, h cuda.Stream) error {
	const op = cuda.OpGraphLaunch
	d.mu.Lock()
	defer d.mu.Unlock()
	call, err := d.beginLocked(op, needCtx)
	if err != nil {
		return err
	}
	items, ok := d.execs[ge]
	if !ok {
		return cuda.NewError(op, cuda.ErrorInvalidHandle)
	}
	s, err := d.streamLocked(op, h)
	if err != nil {
		return err
	}
	for i, it := range items {
		c := call
		if i > 0 {
			c = 0 // StickyAt and HangAt apply to the first item only
		}
		if err := d.enqueueLocked(op, c, s, it); err != nil {
			return err
		}
	}
	return nil
}

// GraphDestroy implements cuda.Driver.
func (d *Driver) GraphDestroy(g cuda.Graph) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpGraphDestroy, needCtx); err != nil {
		return err
	}
	if _, ok := d.graphs[g]; !ok {
		return cuda.NewError(cuda.OpGraphDestroy, cuda.ErrorInvalidHandle)
	}
	delete(d.graphs, g)
	return nil
}

// GraphExecDestroy implements cuda.Driver.
func (d *Driver) GraphExecDestroy(ge cuda.GraphExec) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpGraphExecDestroy, needCtx); err != nil {
		return err
	}
	if _, ok := d.execs[ge]; !ok {
		return cuda.NewError(cuda.OpGraphExecDestroy, cuda.ErrorInvalidHandle)
	}
	delete(d.execs, ge)
	return nil
}
