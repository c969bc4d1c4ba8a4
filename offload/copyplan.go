package offload

// The copy layer of Store and Load: copyCompletion, an op's handle on its
// transfer op, and copyPlan (with templatePlan and partStarts), which
// checks a copy's block ids and cuts the copy into the parts the scheduler
// builds. Locks: copyPlan takes memory.mu through gate (an engine of Dial
// only) and releases it before it returns; nothing else here takes a lock
// of the engine's.

import (
	"fmt"
	"slices"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/kvoffload/kvoffload/transfer"
)

// copyCompletion is an op's handle in the copy layer. On the host
// backend (events false) there are no CUDA events and a stream wait is a
// wait on the CPU; on CUDA the events are the transfer op's.
type copyCompletion struct {
	op     *transfer.Op
	done   <-chan struct{}
	events bool
	gpu    *cudadev.Context
}

func (e *Engine) newCompletion(op *transfer.Op, done <-chan struct{}) *copyCompletion {
	return &copyCompletion{op: op, done: done, events: e.events, gpu: e.gpu}
}

func (c *copyCompletion) event() (uintptr, error) {
	if !c.events {
		return 0, nil
	}
	ev, err := c.op.Event()
	if err != nil {
		return 0, fmt.Errorf("offload: the op's event: %w", err)
	}
	return uintptr(ev), nil
}

// layerEvent is layer i's event: on the host backend 0, and ok only for
// a load submitted with per-layer events (LayerEnds) and i among its
// layers; Op.LayerEvent has checked both (Op.layers) before asking. err:
// the op failed before the event was recorded.
func (c *copyCompletion) layerEvent(i int) (ev uintptr, ok bool, err error) {
	if i < 0 || i >= c.op.Layers() || c.op.Dir() != transfer.Load {
		return 0, false, nil
	}
	if !c.events {
		return 0, true, nil
	}
	tev, err := c.op.LayerEvent(i)
	if err != nil {
		return 0, true, fmt.Errorf("offload: layer %d's event: %w", i, err)
	}
	return uintptr(tev), true, nil
}

func (c *copyCompletion) streamWait(stream uintptr) error {
	if !c.events {
		<-c.done
		return nil
	}
	ev, err := c.op.Event()
	if err != nil {
		return err
	}
	if err := c.gpu.StreamWaitEvent(transfer.Stream(stream), ev); err != nil {
		return fmt.Errorf("offload: stream %#x waiting on the op's event: %w", stream, err)
	}
	return nil
}

func (c *copyCompletion) release() error { return c.op.Release() }

// partSegments is about how many segments one part of a copy that is not
// split by layer holds: the engine builds and enqueues a part at a time
// (transfer's builders build the next ones while it is enqueued), so the first
// part's copies run while the next are built.
const partSegments = 4096

// partStarts cuts n blocks into parts of per blocks, the first growth
// ones smaller (with growth 5: a 32nd, a 16th, an eighth, a quarter, a half
// of per, at least one block each), so that the first copies start after a
// small part is built (building and enqueueing a part of 4096 segments took
// about 0.2 ms on the H200 machine, the DMA of the first 2 MiB blocks 40 µs
// each); it returns the parts' first blocks and n.
func partStarts(n, per, growth int) []int {
	starts := []int{0}
	for i, k := 0, 0; i < n; k++ {
		size := per
		if k < growth {
			size = per >> (growth - k)
		}
		i = min(n, i+max(1, size))
		starts = append(starts, i)
	}
	return starts
}

// copyPlan checks the device block ids of a Store or Load and returns the
// request's Build (the segments of blocks and their host slots, built by
// the engine's scheduler when it issues the op), its number of parts,
// whether the parts are layers (perLayer and a layout with layers), and
// the bytes the parts copy.
// blockIDs and slots must not change until the op completes.
//
// The segments are layout l's: the rank's heads (Layout.Segments, which
// is kvcache's segmentsRange of the rank's head range, the range a head-range store
// was granted), 2-D where the device is token-major; a load reads just
// those heads of the slot. transfer never coalesces 2-D segments.
func (e *Engine) copyPlan(l *kvcache.Layout, blockIDs []int, slots []kvcache.Slot, perLayer bool) (transfer.Request, error) {
	for _, id := range blockIDs {
		if err := l.CheckBlock(id); err != nil {
			return transfer.Request{}, fmt.Errorf("%w: %w", ErrInvalidArgument, err)
		}
	}
	ks, err := l.Segments(blockIDs[0], nil)
	if err != nil {
		return transfer.Request{}, fmt.Errorf("%w: %w", ErrInvalidArgument, err)
	}
	var perBlock uint64
	for _, s := range ks {
		perBlock += s.Len
	}
	if err := e.gate(slots); err != nil {
		return transfer.Request{}, err // a node's region gone (Dial)
	}
	// Build may run for several parts at once (transfer's builders): each
	// call has its own scratch for a block's segments.
	perSegs := len(ks)
	add := func(dst []transfer.Segment, bs []kvcache.Segment, i int) []transfer.Segment {
		host := uint64(slots[i].Addr)
		// Field by field into dst: a Segment built by value and appended
		// stalled on store forwarding (most of this function's time).
		n := len(dst)
		dst = slices.Grow(dst, len(bs))[:n+len(bs)]
		for j := range bs {
			s, d := &bs[j], &dst[n+j]
			d.Dev, d.Host, d.Len = s.Dev, host+s.Off, s.Len
			d.Rows, d.RowLen, d.DevPitch, d.HostPitch = s.Rows, s.RowLen, s.DevPitch, s.HostPitch
		}
		return dst
	}
	req := transfer.Request{Bytes: perBlock * uint64(len(blockIDs))}
	if tp := e.templatePlan(l, ks, blockIDs, slots, perLayer); tp != nil {
		return tp(req), nil
	}
	ps := partSegments
	if e.hooks.partSegments > 0 {
		ps = e.hooks.partSegments
	}
	if perLayer && l.Kind() != kvcache.CrossLayer {
		// One part a layer, but for the first layer, whose event the
		// caller waits for first: its parts grow from a small one
		// (partStarts), so its copies start once a few blocks are built
		// rather than all of them.
		layers := l.Geometry().Layers
		first := []int{0, len(blockIDs)}
		if !e.hooks.wholeFirstLayer {
			first = partStarts(len(blockIDs), max(1, ps/max(1, perSegs/layers)), e.hooks.partGrowth)
		}
		req.Layered = true
		req.Parts = layers + len(first) - 2
		if len(first) > 2 {
			req.LayerParts = make([]int, layers)
			req.LayerParts[0] = len(first) - 1
			for i := 1; i < layers; i++ {
				req.LayerParts[i] = 1
			}
		}
		req.Build = func(p int, dst []transfer.Segment) ([]transfer.Segment, error) {
			layer, from, to := 0, 0, len(blockIDs)
			if p < len(first)-1 {
				from, to = first[p], first[p+1]
			} else {
				layer = p - (len(first) - 2)
			}
			bs := make([]kvcache.Segment, 0, perSegs)
			var err error
			for i := from; i < to; i++ {
				if bs, err = l.LayerSegments(blockIDs[i], layer, bs[:0]); err != nil {
					return dst, err
				}
				dst = add(dst, bs, i)
			}
			return dst, nil
		}
		return req, nil
	}
	starts := partStarts(len(blockIDs), max(1, ps/perSegs), e.hooks.partGrowth)
	req.Parts = len(starts) - 1
	req.Build = func(p int, dst []transfer.Segment) ([]transfer.Segment, error) {
		bs := make([]kvcache.Segment, 0, perSegs)
		var err error
		for i := starts[p]; i < starts[p+1]; i++ {
			if bs, err = l.Segments(blockIDs[i], bs[:0]); err != nil {
				return dst, err
			}
			dst = add(dst, bs, i)
		}
		return dst, nil
	}
	return req, nil
}

// strided reports whether s is a 2-D segment (kvcache.Segment: Rows > 1).
func strided(s kvcache.Segment) bool { return s.Rows > 1 }

// templatePlan returns, for a layout whose segments are strided (a TP
// rank's heads of token-major tensors) on a scheduler that copies
// templates, the function that completes req as a template request: one
// part (every block), or with perLayer one part a layer, each copied as
// one template launch (transfer.Template: the block's pieces once, then a
// slot address and block id a block), Build the same parts' segments.
// Otherwise nil: the parts are cut for Build alone. ks is a block's
// segments, as copyPlan got them.
func (e *Engine) templatePlan(l *kvcache.Layout, ks []kvcache.Segment, blockIDs []int, slots []kvcache.Slot, perLayer bool) func(transfer.Request) transfer.Request {
	if e.hooks.noTemplates || !slices.ContainsFunc(ks, strided) || l.Kind() == kvcache.CrossLayer ||
		!e.sched.Templates(transfer.Store) || !e.sched.Templates(transfer.Load) {
		return nil
	}
	base, err := l.Segments(0, nil)
	if err != nil || len(base) != len(ks) {
		return nil
	}
	layers := l.Geometry().Layers
	pieces := make([]transfer.Piece, len(base))
	var ends []int
	for i, s := range base {
		pieces[i] = transfer.Piece{Segment: transfer.Segment{
			Dev: s.Dev, Host: s.Off, Len: s.Len, Rows: s.Rows, RowLen: s.RowLen, DevPitch: s.DevPitch, HostPitch: s.HostPitch,
		}, DevStride: l.DevStride(s.Layer)}
		if perLayer && (i == len(base)-1 || base[i+1].Layer != s.Layer) {
			ends = append(ends, i+1)
		}
	}
	if perLayer && len(ends) != layers {
		return nil
	}
	return func(req transfer.Request) transfer.Request {
		blocks := func(_ int, dst []transfer.Block) ([]transfer.Block, error) {
			for i, id := range blockIDs {
				dst = append(dst, transfer.Block{Host: uint64(slots[i].Addr), ID: uint64(id)})
			}
			return dst, nil
		}
		req.Template = &transfer.Template{Pieces: pieces, LayerEnds: ends, Blocks: blocks}
		req.Parts = 1
		if perLayer {
			req.Layered, req.Parts = true, layers
		}
		req.Build = func(p int, dst []transfer.Segment) ([]transfer.Segment, error) {
			var bs []kvcache.Segment
			var err error
			for i, id := range blockIDs {
				if perLayer {
					bs, err = l.LayerSegments(id, p, bs[:0])
				} else {
					bs, err = l.Segments(id, bs[:0])
				}
				if err != nil {
					return dst, err
				}
				host := uint64(slots[i].Addr)
				for j := range bs {
					s := &bs[j]
					dst = append(dst, transfer.Segment{Dev: s.Dev, Host: host + s.Off, Len: s.Len, Rows: s.Rows, RowLen: s.RowLen, DevPitch: s.DevPitch, HostPitch: s.HostPitch})
				}
			}
			return dst, nil
		}
		return req
	}
}
