package cudacopy

import (
	"errors"
	"fmt"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// Gathered stores. A KV block's segments are scattered over the model's
// tensors on the device but packed back to back in its host slot, so a
// store of whole blocks is a few long host-contiguous runs. SubmitGather
// copies such a batch without the SMs writing host memory: the copy kernel
// gathers the segments into device staging (device-to-device, at HBM speed,
// on a stream of its own), then the DMA engines copy each run to the host
// in one piece, at the link's full rate and without the backlog of posted
// host stores that slows the model's kernels (see DefaultLaunch).

// Defaults for the gather options.
const (
	// DefaultGatherChunk is the size of one device staging chunk.
	DefaultGatherChunk = 8 << 20
	// DefaultGatherMinRun is the mean host-contiguous run from which
	// Gatherable says yes: one DMA per run then moves at least this much,
	// which the batch API does at link speed on the H200 (results.md: 98%
	// from 256 KiB).
	DefaultGatherMinRun = 256 << 10
	// minGatherChunk keeps a chunk larger than the largest segment the
	// kernel method is chosen for.
	minGatherChunk = 1 << 20
)

// gatherPiece is one DMA of a gathered batch: len bytes from staging chunk
// chunk to the host address host. A piece never spans two chunks: they are
// separate allocations, even where their addresses happen to be adjacent.
type gatherPiece struct {
	host, staging, len uint64
	chunk              int
}

// Gatherable reports whether SubmitGather is the better way to copy this
// D2H batch: the automatic choice would take the kernel (small segments),
// the batch meets the kernel's alignment, every segment fits a staging
// chunk, and the segments form host-contiguous runs (in batch order) of at
// least Options.GatherMinRun bytes on average. Always false with a forced
// Method or Options.NoGather, or without the kernel.
func (c *Copier) Gatherable(segs []Segment) bool {
	if c.opts.NoGather || c.opts.Method != MethodAuto || !c.caps.Kernel || len(segs) < 2 {
		return false
	}
	var total uint64
	runs := 0
	for i, g := range segs {
		if g.Len > uint64(c.opts.GatherChunkBytes) {
			return false
		}
		total += g.Len
		if i == 0 || segs[i-1].Dst+segs[i-1].Len != g.Dst {
			runs++
		}
	}
	if total/uint64(runs) < uint64(c.opts.GatherMinRun) || !aligned(segs) {
		return false
	}
	return c.chooser.Load().choose(D2H, len(segs), total, true) == MethodKernel
}

// SubmitGather copies a D2H batch (Src on the device, Dst in registered host
// memory) in two steps: the copy kernel gathers the segments, in batch order,
// into device staging chunks on stream g; s waits for that (an event) and
// then copies each host-contiguous run of the staging to the host with the
// batch API (else one cuMemcpyAsync per run). g must already be ordered
// after the work that wrote the segments' device data (the caller makes g
// wait on the same events it makes s wait on); completion is that of s:
// retire the ticket, which holds the staging, after an event recorded on s
// after this call has completed. Segments must be 16-byte aligned and at
// most Options.GatherChunkBytes long. On error nothing is left that a later
// call could disturb: what was enqueued keeps its staging until Close.
func (c *Copier) SubmitGather(g, s cuda.Stream, segs []Segment) (Ticket, error) {
	if err := validateSegments(segs, kernelAlign); err != nil {
		return Ticket{}, err
	}
	if c.opts.NoGather {
		return Ticket{}, fmt.Errorf("%w: gathering is off (Options.NoGather)", ErrUnavailable)
	}
	if !c.caps.Kernel {
		return Ticket{}, fmt.Errorf("%w: %s", ErrUnavailable, c.caps.KernelError)
	}
	chunk := uint64(c.opts.GatherChunkBytes)
	nchunks, off := 1, uint64(0)
	for i, sg := range segs {
		if sg.Len > chunk {
			return Ticket{}, fmt.Errorf("%w: segment %d of %d bytes is larger than a gather chunk of %d bytes", ErrInvalidSegment, i, sg.Len, chunk)
		}
		if off+sg.Len > chunk {
			nchunks, off = nchunks+1, 0
		}
		off += sg.Len
	}
	staging, ev, err := c.acquireGather(nchunks)
	if err != nil {
		return Ticket{}, err
	}
	gather, pieces := packGather(segs, chunk, staging)
	ck := chunker{kind: jobCopy, copies: gather, chunk: uint64(c.opts.ChunkBytes)}
	t, err := c.launch(g, &ck, &c.h2d, 0)
	if err != nil {
		c.releaseGather(staging, ev)
		return Ticket{}, err
	}
	c.attachGather(t, staging, ev)
	if err := c.gatherDMA(g, s, ev, pieces); err != nil {
		c.abandonAll(t)
		return Ticket{}, err
	}
	c.gathers.Add(1)
	return t, nil
}

// Gathers is the number of batches SubmitGather has enqueued.
func (c *Copier) Gathers() uint64 { return c.gathers.Load() }

// packGather places segs, in order, into the staging chunks (a segment
// that does not fit the rest of a chunk starts the next) and returns the
// gather copies (device → staging) and the DMAs (staging → host), one per
// host-contiguous run within a chunk.
func packGather(segs []Segment, chunk uint64, staging []cuda.DevicePtr) ([]Segment, []gatherPiece) {
	gather := make([]Segment, len(segs))
	pieces := make([]gatherPiece, 0, 8)
	k, off := 0, uint64(0)
	for i, sg := range segs {
		if off+sg.Len > chunk {
			k, off = k+1, 0
		}
		dst := uint64(staging[k]) + off
		gather[i] = Segment{Dst: dst, Src: sg.Src, Len: sg.Len}
		if n := len(pieces); n > 0 && pieces[n-1].chunk == k && pieces[n-1].host+pieces[n-1].len == sg.Dst && pieces[n-1].staging+pieces[n-1].len == dst {
			pieces[n-1].len += sg.Len
		} else {
			pieces = append(pieces, gatherPiece{host: sg.Dst, staging: dst, len: sg.Len, chunk: k})
		}
		off += sg.Len
	}
	return gather, pieces
}

// gatherDMA joins s to g's gather and enqueues the staging-to-host copies.
func (c *Copier) gatherDMA(g, s cuda.Stream, ev cuda.Event, pieces []gatherPiece) error {
	if err := c.drv.EventRecord(ev, g); err != nil {
		return fmt.Errorf("cudacopy: recording the gather's event: %w", err)
	}
	if err := c.drv.StreamWaitEvent(s, ev, cuda.EventWaitDefault); err != nil {
		return fmt.Errorf("cudacopy: joining the gather: %w", err)
	}
	if !c.caps.Batch {
		for i, p := range pieces {
			if err := c.drv.MemcpyAsync(cuda.DevicePtr(p.host), cuda.DevicePtr(p.staging), p.len, s); err != nil {
				return fmt.Errorf("cudacopy: gathered run %d of %d (%d bytes): %w", i, len(pieces), p.len, err)
			}
		}
		return nil
	}
	sp := c.batchPool.Get().(*[]cuda.BatchCopy)
	defer c.batchPool.Put(sp)
	scratch := *sp
	for base := 0; base < len(pieces); base += len(scratch) {
		part := pieces[base:min(base+len(scratch), len(pieces))]
		for i, p := range part {
			scratch[i] = cuda.BatchCopy{Dst: cuda.DevicePtr(p.host), Src: cuda.DevicePtr(p.staging), Size: p.len}
		}
		if err := c.drv.MemcpyBatchAsync(scratch[:len(part)], s); err != nil {
			return fmt.Errorf("cudacopy: gathered runs [%d, %d) of %d: %w", base, base+len(part), len(pieces), err)
		}
	}
	return nil
}

// acquireGather takes n staging chunks and a join event, allocating what
// the pools lack (kept until Close, like descriptor buffers).
func (c *Copier) acquireGather(n int) ([]cuda.DevicePtr, cuda.Event, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, 0, ErrClosed
	}
	for len(c.stagingFree) < n {
		p, err := c.drv.MemAlloc(uint64(c.opts.GatherChunkBytes))
		if err != nil {
			return nil, 0, fmt.Errorf("cudacopy: gather staging chunk of %d bytes (%d in use): %w", c.opts.GatherChunkBytes, len(c.stagingAll)-len(c.stagingFree), err)
		}
		c.stagingAll = append(c.stagingAll, p)
		c.stagingFree = append(c.stagingFree, p)
	}
	if len(c.eventsFree) == 0 {
		e, err := c.drv.EventCreate(cuda.EventDisableTiming)
		if err != nil {
			return nil, 0, fmt.Errorf("cudacopy: gather event: %w", err)
		}
		c.eventsAll = append(c.eventsAll, e)
		c.eventsFree = append(c.eventsFree, e)
	}
	k := len(c.stagingFree) - n
	staging := append([]cuda.DevicePtr(nil), c.stagingFree[k:]...)
	c.stagingFree = c.stagingFree[:k]
	ev := c.eventsFree[len(c.eventsFree)-1]
	c.eventsFree = c.eventsFree[:len(c.eventsFree)-1]
	return staging, ev, nil
}

// releaseGather returns staging and an event that nothing enqueued uses.
func (c *Copier) releaseGather(staging []cuda.DevicePtr, ev cuda.Event) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stagingFree = append(c.stagingFree, staging...)
	c.eventsFree = append(c.eventsFree, ev)
}

// attachGather makes the staging and event part of ticket t: Retire returns
// them, abandon withdraws them.
func (c *Copier) attachGather(t Ticket, staging []cuda.DevicePtr, ev cuda.Event) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r := &c.recs[t.idx-1]
	r.staging = append(r.staging[:0], staging...)
	r.event, r.hasEvent = ev, true
}

// abandonAll ends a ticket whose work may all have been enqueued: its
// descriptor buffers, staging and event are withdrawn until Close.
func (c *Copier) abandonAll(t Ticket) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.endRec(t.idx - 1)
}

// releaseGatherAll frees every staging chunk and event (Close).
func (c *Copier) releaseGatherAll() error {
	var errs []error
	for _, p := range c.stagingAll {
		errs = append(errs, c.drv.MemFree(p))
	}
	for _, e := range c.eventsAll {
		errs = append(errs, c.drv.EventDestroy(e))
	}
	c.stagingAll, c.stagingFree, c.eventsAll, c.eventsFree = nil, nil, nil, nil
	return errors.Join(errs...)
}
