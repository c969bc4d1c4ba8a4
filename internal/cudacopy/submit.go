package cudacopy

// Submitting batches on a caller's stream: Submit with the forced or
// chosen method (one cuMemcpyAsync per segment, the batch API, or kernel
// launches over uploaded descriptor tables), Fill and Checksum, and the end
// of a ticket (Retire, or abandon after a failed launch). Locks: Copier.mu,
// taken by checkOpen, abandon and Retire (endRec runs with it held);
// launch takes it through acquire and setDone (budget.go) and abandon, and
// enqueues on the stream without it.

import (
	"encoding/binary"
	"fmt"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// Submit validates the batch and enqueues its copies on s with the forced
// or chosen method: one cuMemcpyAsync per segment, cuMemcpyBatchAsync calls
// of at most BatchMax copies, or per descriptor buffer an upload of the
// descriptor table and a kvo_copy launch. Nothing is enqueued when
// validation fails.
//
// The caller records an event on s after Submit and calls Retire(ticket)
// once that event has completed; until then the ticket's descriptor buffers
// are not reused. On a driver error Submit returns the zero Ticket: work
// enqueued before the failing call may still run, so its descriptor buffers
// are withdrawn from reuse (and freed only by Close).
//
// Rules for bad input: an empty batch, a zero length, a nil address or a
// wrapping range is ErrInvalidSegment. With MethodKernel forced, a segment
// whose addresses or length are not multiples of 16 is ErrMisaligned;
// MethodAuto never sends such a batch to the kernel.
func (c *Copier) Submit(s cuda.Stream, dir Path, segs []Segment) (Ticket, error) {
	if !dir.valid() {
		return Ticket{}, fmt.Errorf("%w: direction %d", ErrInvalidOption, int(dir))
	}
	if err := validateSegments(segs, 1); err != nil {
		return Ticket{}, err
	}
	m := c.opts.Method
	if m == MethodAuto {
		m = c.Choose(dir, segs)
	}
	return c.submitWith(s, dir, segs, m)
}

func (c *Copier) submitWith(s cuda.Stream, dir Path, segs []Segment, m Method) (Ticket, error) {
	switch m {
	case MethodMemcpy:
		return Ticket{}, c.memcpy(s, segs)
	case MethodBatch:
		return Ticket{}, c.batch(s, segs)
	}
	if err := validateSegments(segs, kernelAlign); err != nil {
		return Ticket{}, err
	}
	ck := chunker{
		kind:    jobCopy,
		copies:  segs,
		chunk:   uint64(c.opts.ChunkBytes),
		host:    c.hostTableForKernel(),
		hostSrc: dir == H2D,
		hostDst: dir == D2H,
	}
	l := &c.h2d
	if dir == D2H {
		l = &c.d2h
		ck.fenceIters = uint64(c.fenceBytes(l.Launch, segs) / FenceUnit)
		ck.paceGBps = l.PaceGBps
	}
	return c.launch(s, &ck, l, 0)
}

func (c *Copier) checkOpen() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	return nil
}

func (c *Copier) memcpy(s cuda.Stream, segs []Segment) error {
	if err := c.checkOpen(); err != nil {
		return err
	}
	for i, g := range segs {
		if err := c.drv.MemcpyAsync(cuda.DevicePtr(g.Dst), cuda.DevicePtr(g.Src), g.Len, s); err != nil {
			return fmt.Errorf("cudacopy: memcpy of segment %d of %d (%d bytes): %w", i, len(segs), g.Len, err)
		}
	}
	return nil
}

func (c *Copier) batch(s cuda.Stream, segs []Segment) error {
	if !c.caps.Batch {
		return fmt.Errorf("%w: batch method without cuMemcpyBatchAsync", ErrUnavailable)
	}
	if err := c.checkOpen(); err != nil {
		return err
	}
	sp := c.batchPool.Get().(*[]cuda.BatchCopy)
	defer c.batchPool.Put(sp)
	scratch := *sp
	for base := 0; base < len(segs); base += len(scratch) {
		part := segs[base:min(base+len(scratch), len(segs))]
		for i, g := range part {
			scratch[i] = cuda.BatchCopy{Dst: cuda.DevicePtr(g.Dst), Src: cuda.DevicePtr(g.Src), Size: g.Len}
		}
		if err := c.drv.MemcpyBatchAsync(scratch[:len(part)], s); err != nil {
			return fmt.Errorf("cudacopy: batch copy of segments [%d, %d) of %d: %w", base, base+len(part), len(segs), err)
		}
	}
	return nil
}

// abandon ends a ticket whose launch failed: the first used buffers may
// still be read by enqueued work and are withdrawn; the rest are returned.
func (c *Copier) abandon(t Ticket, used int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r := &c.recs[t.idx-1]
	c.free = append(c.free, r.bufs[used:]...)
	if used == 0 {
		c.stagingFree = append(c.stagingFree, r.staging...)
		c.eventsFree = append(c.eventsFree, r.events...)
	}
	c.endRec(t.idx - 1)
}

func (c *Copier) endRec(i int32) {
	r := &c.recs[i]
	clear(r.bufs)
	r.bufs = r.bufs[:0]
	r.staging = r.staging[:0]
	r.events = r.events[:0]
	r.done = 0
	r.live = false
	c.cond.Broadcast()
	r.gen++
	c.freeRecs = append(c.freeRecs, i)
	c.outstanding--
}

// launch enqueues, per descriptor buffer, the table upload and one launch of
// fn. For kvo_fill extra is the spin count; for kvo_checksum the output
// array's address (advanced by 8 bytes per descriptor of earlier launches);
// the throttled kernels also get the chunker's fence interval and pace.
func (c *Copier) launch(s cuda.Stream, ck *chunker, l *launchFn, extra uint64) (Ticket, error) {
	if !c.caps.Kernel {
		return Ticket{}, fmt.Errorf("%w: %s", ErrUnavailable, c.caps.KernelError)
	}
	if err := ck.translateAll(); err != nil {
		return Ticket{}, err
	}
	total := ck.count()
	nbuf := (total + c.opts.DescCapacity - 1) / c.opts.DescCapacity
	// The tables go up on c.up unless s is capturing a graph.
	side, err := c.sideUpload(s)
	if err != nil {
		return Ticket{}, err
	}
	events := 1
	if side {
		events += nbuf // one per table: its upload's completion
	}
	t, gr, err := c.acquire(need{bufs: nbuf, events: events})
	if err != nil {
		return Ticket{}, err
	}
	warpsPerCTA := l.Threads / 32
	done := 0
	for i, b := range gr.bufs {
		n, err := ck.next(b.table)
		if err == nil {
			var uploaded cuda.Event
			if side {
				uploaded = gr.events[1+i]
			}
			err = c.enqueue(s, b, l, ck, n, extra, done, warpsPerCTA, uploaded)
		}
		if err != nil {
			// Buffer i's upload may have been enqueued: withdraw it too.
			c.abandon(t, i+1)
			return Ticket{}, err
		}
		done += n
	}
	if err := c.drv.EventRecord(gr.events[0], s); err != nil {
		c.abandon(t, len(gr.bufs))
		return Ticket{}, fmt.Errorf("cudacopy: recording a launch's completion event: %w", err)
	}
	c.setDone(t, gr.events[0])
	return t, nil
}

// enqueue uploads b's first n descriptors (upload: on s, or with an
// uploaded event on the upload stream) and launches l over them on s.
func (c *Copier) enqueue(s cuda.Stream, b *descBuf, l *launchFn, ck *chunker, n int, extra uint64, done, warpsPerCTA int, uploaded cuda.Event) error {
	if err := c.upload(s, b, n*descSize, uploaded); err != nil {
		return err
	}
	binary.LittleEndian.PutUint32(b.args[1], uint32(n))
	args := b.args[:2]
	grid := uint32(min(l.CTAs, (n+warpsPerCTA-1)/warpsPerCTA))
	switch ck.kind {
	case jobFill:
		binary.LittleEndian.PutUint64(b.args[2], extra)
		args = b.args[:3]
	case jobChecksum:
		binary.LittleEndian.PutUint64(b.args[2], extra+uint64(done)*8)
		args = b.args[:3]
	case jobCopy, jobCopy2D:
		if l.Throttled() {
			binary.LittleEndian.PutUint64(b.args[2], ck.fenceIters)
			binary.LittleEndian.PutUint64(b.args[3], paceNs(ck.paceGBps, min(int(grid)*warpsPerCTA, n)))
			args = b.args[:4]
		}
	}
	err := c.drv.LaunchKernel(l.fn, cuda.Dim3{X: grid, Y: 1, Z: 1}, cuda.Dim3{X: uint32(l.Threads), Y: 1, Z: 1}, 0, s, args...)
	if err != nil {
		return fmt.Errorf("cudacopy: launching %d descriptors on %d CTAs: %w", n, grid, err)
	}
	return nil
}

// Retire returns the ticket's descriptor buffers for reuse. Call it only
// after an event recorded on the stream after the Submit has completed.
// Retiring the zero Ticket is a no-op; retiring a ticket twice, or one from
// another Copier, is ErrStaleTicket.
func (c *Copier) Retire(t Ticket) error {
	if !t.Holds() {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	i := t.idx - 1
	if i < 0 || int(i) >= len(c.recs) || !c.recs[i].live || c.recs[i].gen != t.gen {
		return fmt.Errorf("%w: ticket %d/%d", ErrStaleTicket, t.idx, t.gen)
	}
	r := &c.recs[i]
	c.free = append(c.free, r.bufs...)
	c.stagingFree = append(c.stagingFree, r.staging...)
	c.eventsFree = append(c.eventsFree, r.events...)
	c.endRec(i)
	return nil
}

// Fill writes FillPattern(seed) into each segment with kvo_fill, after the
// kernel spins for spinCycles GPU clock cycles (per launch: a batch larger
// than one descriptor buffer spins once per buffer). Addresses and lengths
// must be multiples of 8. Host addresses inside ranges given to AddHostRange
// are translated; others are used as they are. Retire the ticket as for
// Submit.
func (c *Copier) Fill(s cuda.Stream, segs []FillSegment, spinCycles uint64) (Ticket, error) {
	if len(segs) == 0 {
		return Ticket{}, fmt.Errorf("%w: empty batch", ErrInvalidSegment)
	}
	for i, f := range segs {
		if err := checkRange(i, "dst", f.Dst, f.Len); err != nil {
			return Ticket{}, err
		}
		if (f.Dst|f.Len)%wordAlign != 0 {
			return Ticket{}, fmt.Errorf("%w: fill segment %d (dst %#x, len %d) is not %d-byte aligned", ErrMisaligned, i, f.Dst, f.Len, wordAlign)
		}
	}
	ck := chunker{kind: jobFill, fills: segs, chunk: uint64(c.opts.ChunkBytes), host: c.hostTableForKernel()}
	return c.launch(s, &ck, &c.fill, spinCycles)
}

// Checksum writes the checksum of span i (HostChecksum of its bytes) into
// the uint64 at out + 8*i, with kvo_checksum (one warp per span). Addresses
// and lengths must be multiples of 8. Retire the ticket as for Submit.
func (c *Copier) Checksum(s cuda.Stream, spans []Span, out cuda.DevicePtr) (Ticket, error) {
	if len(spans) == 0 {
		return Ticket{}, fmt.Errorf("%w: empty batch", ErrInvalidSegment)
	}
	if out == 0 || out%wordAlign != 0 {
		return Ticket{}, fmt.Errorf("%w: checksum output %#x is nil or not %d-byte aligned", ErrMisaligned, uint64(out), wordAlign)
	}
	for i, sp := range spans {
		if err := checkRange(i, "src", sp.Addr, sp.Len); err != nil {
			return Ticket{}, err
		}
		if (sp.Addr|sp.Len)%wordAlign != 0 {
			return Ticket{}, fmt.Errorf("%w: checksum span %d (addr %#x, len %d) is not %d-byte aligned", ErrMisaligned, i, sp.Addr, sp.Len, wordAlign)
		}
	}
	ck := chunker{kind: jobChecksum, spans: spans, host: c.hostTableForKernel()}
	if h := ck.host; h != nil {
		if d, ok := h.translate(uint64(out), uint64(len(spans))*8); ok {
			out = cuda.DevicePtr(d)
		}
	}
	return c.launch(s, &ck, &c.csum, uint64(out))
}
