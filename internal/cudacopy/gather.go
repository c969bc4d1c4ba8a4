package cudacopy

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// Staged copies: gathered stores and scattered loads. A KV block's segments
// are scattered over the model's tensors on the device but packed back to
// back in its host slot, so a store or load of whole blocks is a few long
// host-contiguous runs. SubmitGather copies such a store without the SMs
// writing host memory: the copy kernel gathers the segments into device
// staging (device-to-device, at HBM speed, on a stream of its own), then the
// DMA engines copy each run to the host in one piece, at the link's full
// rate and without the backlog of posted host stores that slows the model's
// kernels (see DefaultLaunch). SubmitScatter is the mirror image for loads:
// one DMA per run into staging, then the kernel scatters it on the device,
// so both directions at once move with the DMA engines' large transfers.

// Defaults for the gather options.
const (
	// DefaultGatherChunk is the size of one device staging chunk.
	DefaultGatherChunk = 8 << 20
	// DefaultGatherMinRun is the mean host-contiguous run from which
	// Gatherable says yes: one DMA per run then moves at least this much,
	// which is enough for the batch API to run at link speed.
	DefaultGatherMinRun = 256 << 10
	// DefaultGatherMinRow is the shortest row of a pitched staging DMA
	// (Options.GatherMinRow): on the H200 machine one layer of 2048
	// consecutive 2 MiB slots, 64 KiB rows in chunks of 128, moved at 0.98
	// of a contiguous copy, and 32 KiB rows at 0.92, no better than the
	// copy kernel (bench/results/h200/probe-layer-dma.md,
	// probe-2d-dma.md).
	DefaultGatherMinRow = 64 << 10
	// minGatherChunk keeps a chunk larger than the largest segment the
	// kernel method is chosen for.
	minGatherChunk = 1 << 20
)

// gatherPiece is one DMA of a gathered batch: len bytes from staging chunk
// chunk to the host address host. A piece never spans two chunks: they are
// separate allocations, even where their addresses happen to be adjacent.
//
// rows > 1: a pitched DMA of rows rows of len bytes, row r at host + r ×
// pitch and back to back in staging (staging + r × len).
type gatherPiece struct {
	host, staging, len uint64
	chunk              int
	rows, pitch        uint64
}

// Gatherable reports whether SubmitGather is the better way to copy this
// D2H batch: the automatic choice would take the kernel (small segments),
// the batch meets the kernel's alignment, every segment fits a staging
// chunk, and the segments form host-contiguous runs (in batch order) of at
// least Options.GatherMinRun bytes on average. Always false with a forced
// Method or Options.NoGather, or without the kernel.
func (c *Copier) Gatherable(segs []Segment) bool { return c.stageable(D2H, segs) }

// Scatterable is Gatherable for an H2D batch and SubmitScatter (host runs
// on the Src side).
func (c *Copier) Scatterable(segs []Segment) bool { return c.stageable(H2D, segs) }

// hostSide is the host address of a segment copied in dir.
func hostSide(dir Path, g Segment) uint64 {
	if dir == D2H {
		return g.Dst
	}
	return g.Src
}

func (c *Copier) stageable(dir Path, segs []Segment) bool {
	if c.opts.NoGather || c.opts.Method != MethodAuto || !c.caps.Kernel || len(segs) < 2 {
		return false
	}
	hosts := c.hosts.Load()
	var total uint64
	// The DMAs the staged copy would make, chunks aside: staging offsets
	// are the batch's, back to back.
	rp := runPacker{minRow: c.minRow(), maxRow: uint64(c.opts.GatherMinRun)}
	for _, g := range segs {
		if g.Len > uint64(c.opts.GatherChunkBytes) {
			return false
		}
		host := hostSide(dir, g)
		rp.add(host, total, g.Len, 0, hosts.rangeOf(host, g.Len))
		total += g.Len
	}
	rp.flush()
	if total/uint64(rp.n) < uint64(c.opts.GatherMinRun) || !aligned(segs) {
		return false
	}
	return c.chooser.Load().choose(dir, len(segs), total, true) == MethodKernel
}

// minRow is the shortest row of a pitched staging DMA (0: none).
func (c *Copier) minRow() uint64 {
	if c.opts.GatherMinRow < 0 || c.noPitch.Load() {
		return 0
	}
	return uint64(c.opts.GatherMinRow)
}

// SetPitchedStaging turns pitched staging DMAs on (where
// Options.GatherMinRow allows them: the default) or off, for the calls
// that start after it; safe for concurrent use.
func (c *Copier) SetPitchedStaging(on bool) { c.noPitch.Store(!on) }

// SubmitGather copies a D2H batch (Src on the device, Dst in registered host
// memory) in two steps per staging chunk: the copy kernel gathers the
// chunk's segments, in batch order, into device staging on stream g; s
// waits for that (an event) and copies each host-contiguous run of the
// chunk to the host with the batch API (else one cuMemcpyAsync per run).
// Chunks go round a ring of at most Options.GatherRing staging buffers: g
// gathers chunk k+1 while s copies chunk k out, and waits for s's copy of
// chunk k-GatherRing before reusing its buffer, so a batch of any size uses
// at most GatherRing × GatherChunkBytes of device memory (fewer chunks
// where Options.MaxDeviceBytes leaves room for fewer). g must already be
// ordered after the work that wrote the segments' device data (the caller
// makes g wait on the same events it makes s wait on); completion is that
// of s: retire the ticket, which holds the staging, after an event recorded
// on s after this call has completed. Segments must be 16-byte aligned and
// at most Options.GatherChunkBytes long. On error what was enqueued keeps
// its buffers until Close (counted in DeviceBytes meanwhile).
func (c *Copier) SubmitGather(g, s cuda.Stream, segs []Segment) (Ticket, error) {
	return c.staged(D2H, g, s, segs, true)
}

// SubmitScatter copies an H2D batch (Src in registered host memory, Dst on
// the device) in two steps per staging chunk: s copies each host-contiguous
// run of the chunk into device staging with the batch API (else one
// cuMemcpyAsync per run), then g waits for that (an event) and the copy
// kernel scatters the chunk to the segments' device addresses; s waits for
// the last scatter before returning, so completion is that of s, and no
// scatter starts before what s was waiting for (only the upload of the
// batch's descriptors may run on g earlier). Chunks go round the ring of
// Options.GatherRing staging buffers as in SubmitGather (s waits for the
// scatter out of a buffer before loading it again). Other rules as for
// SubmitGather, except on error: s then waits for everything enqueued on g
// (or the call waits for g), so that no scatter writes the device after s's
// work has completed. For whole blocks it is faster than the copy kernel
// alone; cudadev.CUDA uses it for loads where Scatterable.
func (c *Copier) SubmitScatter(s, g cuda.Stream, segs []Segment) (Ticket, error) {
	return c.staged(H2D, g, s, segs, true)
}

// SubmitScatterOpen is SubmitScatter without its last step: s does not
// wait for the last scatter, so that what s copies next (the next batch's
// runs, into other staging chunks) starts at once instead of after the
// scatter kernel's tail. The caller joins s to g (an event recorded on g
// after this call, waited for on s) before anything that must follow the
// whole batch on s: an event whose completion means the batch is done, a
// copy on s that may write the same device memory, a host sync of s. The
// ticket's own completion (Retire) already covers the scatters. On error
// s is joined as with SubmitScatter.
func (c *Copier) SubmitScatterOpen(s, g cuda.Stream, segs []Segment) (Ticket, error) {
	return c.staged(H2D, g, s, segs, false)
}

// staged is SubmitGather (D2H) and SubmitScatter (H2D; join: s waits for
// the last scatter before the call returns).
func (c *Copier) staged(dir Path, g, s cuda.Stream, segs []Segment, join bool) (Ticket, error) {
	if err := validateSegments(segs, kernelAlign); err != nil {
		return Ticket{}, err
	}
	if c.opts.NoGather {
		return Ticket{}, fmt.Errorf("%w: staged copies are off (Options.NoGather)", ErrUnavailable)
	}
	if !c.caps.Kernel {
		return Ticket{}, fmt.Errorf("%w: %s", ErrUnavailable, c.caps.KernelError)
	}
	chunk := uint64(c.opts.GatherChunkBytes)
	for i, sg := range segs {
		if sg.Len > chunk {
			return Ticket{}, fmt.Errorf("%w: segment %d of %d bytes is larger than a staging chunk of %d bytes", ErrInvalidSegment, i, sg.Len, chunk)
		}
	}
	parts := chunkParts(segs, chunk)
	// One chunker per chunk, so that each chunk's kernel work ends a launch;
	// the chunks' descriptors share the ticket's buffers back to back. The
	// count depends only on the lengths, so it is known before the staging.
	ndesc := 0
	for _, p := range parts {
		ck := chunker{kind: jobCopy, copies: segs[p.lo:p.hi], chunk: uint64(c.opts.ChunkBytes)}
		ndesc += ck.count()
	}
	nbuf := (ndesc + c.opts.DescCapacity - 1) / c.opts.DescCapacity
	// The ring takes fewer chunks where MaxDeviceBytes leaves room for
	// fewer beside the descriptor tables (at least one).
	fit := (c.opts.MaxDeviceBytes - int64(nbuf)*c.descBytes()) / int64(chunk)
	ring := int(min(int64(len(parts)), int64(c.opts.GatherRing), max(fit, 1)))
	t, gr, err := c.acquire(need{bufs: nbuf, staging: ring, events: 2 * ring})
	if err != nil {
		return Ticket{}, err
	}
	staging, evs := gr.staging, gr.events
	// The kernel's segments live until the descriptors are written, all
	// before this call returns: from a pool (a store of 2048 8B-class
	// blocks otherwise allocated 3 MiB of them, garbage that paced the
	// GC whose pauses landed in the engine's calls).
	kp, _ := kernSegs.Get().(*[]Segment)
	if kp == nil {
		kp = new([]Segment)
	}
	kern, pieces := packStaged(dir, segs, parts, staging, c.hosts.Load(), c.minRow(), uint64(c.opts.GatherMinRun), *kp)
	defer func() {
		*kp = kern[:0]
		kernSegs.Put(kp)
	}()
	cks := make([]chunker, len(parts))
	for k, p := range parts {
		cks[k] = chunker{kind: jobCopy, copies: kern[p.lo:p.hi], chunk: uint64(c.opts.ChunkBytes)}
	}
	// Every chunk's descriptors are written first and uploaded on g ahead
	// of the pipeline, one copy per buffer: an upload per chunk, after the
	// wait for the chunk's load, queued behind the next chunks' loads on
	// the host-to-device copy engine and held the scatter back, well below
	// the rate of the DMAs alone.
	// A scatter's kernels read their descriptors straight from the pinned
	// tables where the device takes host pointers as they are: an upload
	// on g sits on the host-to-device copy engine behind every run the
	// load stream has queued (SubmitScatterOpen lets that stream run on
	// into the next batch), and held the scatters back for over a
	// millisecond; a warp reads its 32-byte descriptor over the link once
	// per chunk instead.
	// Those read from the pinned tables are written chunk by chunk instead,
	// each after its chunk's DMA is enqueued, so that the first DMA does not
	// wait for the whole batch's descriptors (about 0.1 ms for 512 segments
	// on the H200 machine).
	bufs := &descCursor{bufs: gr.bufs, fromHost: dir == H2D && c.caps.HostPointerIdentity}
	launches := make([][]launchRange, len(parts))
	if !bufs.fromHost {
		for k := range parts {
			if launches[k], err = bufs.fill(&cks[k]); err != nil {
				// Nothing is enqueued yet: everything goes back to the pools.
				c.abandon(t, 0)
				return Ticket{}, err
			}
		}
	}
	// fail ends the ticket after an error once work may be enqueued; a
	// scatter already launched on g must not outlive s's completion.
	fail := func(err error) (Ticket, error) {
		if dir == H2D {
			err = errors.Join(err, c.joinAfterFailure(s, g, evs[0]))
		}
		c.abandonAll(t)
		return Ticket{}, err
	}
	if !bufs.fromHost {
		if err := c.uploadDescs(g, bufs); err != nil {
			return fail(err)
		}
	}
	// D2H: a = gathered (on g), b = copied out (on s).
	// H2D: a = loaded into staging (on s), b = scattered (on g).
	a, b := evs[:ring], evs[ring:]
	pi := 0
	chunkPieces := func(k int) []gatherPiece {
		end := pi
		for end < len(pieces) && pieces[end].chunk == k {
			end++
		}
		ps := pieces[pi:end]
		pi = end
		return ps
	}
	for k := range parts {
		slot, reuse := k%ring, k >= ring
		if dir == D2H {
			err = c.gatherChunk(g, s, launches[k], bufs, reuse, a[slot], b[slot])
			if err == nil {
				err = c.stagingDMA(dir, s, chunkPieces(k))
			}
			if err == nil {
				err = c.drv.EventRecord(b[slot], s)
			}
		} else {
			fill := func() ([]launchRange, error) {
				if launches[k] == nil {
					return bufs.fill(&cks[k])
				}
				return launches[k], nil
			}
			err = c.scatterChunk(g, s, fill, bufs, reuse, chunkPieces(k), a[slot], b[slot])
		}
		if err != nil {
			return fail(err)
		}
	}
	if dir == H2D && join {
		if err := c.drv.StreamWaitEvent(s, b[(len(parts)-1)%ring], cuda.EventWaitDefault); err != nil {
			return fail(fmt.Errorf("cudacopy: joining the last scatter: %w", err))
		}
	}
	// b[last] is recorded after everything: D2H on s after the last copy
	// out (s joined every gather), H2D on g after the last scatter (g
	// joined every load).
	c.setDone(t, b[(len(parts)-1)%ring])
	c.gathers.Add(1)
	return t, nil
}

// kernSegs holds *[]Segment, staged's kernel segments between calls.
var kernSegs sync.Pool

// DefaultGatherRing is the number of staging chunks one SubmitGather
// cycles through (Options.GatherRing).
const DefaultGatherRing = 4

// Gathers is the number of batches SubmitGather and SubmitScatter have
// enqueued.
func (c *Copier) Gathers() uint64 { return c.gathers.Load() }

// part is the index range [lo, hi) of the segments packed into one chunk.
type part struct{ lo, hi int }

// chunkParts splits segs into staging chunks of at most chunk bytes, in
// order: a segment that does not fit the rest of a chunk starts the next.
func chunkParts(segs []Segment, chunk uint64) []part {
	var parts []part
	lo, off := 0, uint64(0)
	for i, sg := range segs {
		if off+sg.Len > chunk {
			parts = append(parts, part{lo, i})
			lo, off = i, 0
		}
		off += sg.Len
	}
	return append(parts, part{lo, len(segs)})
}

// gatherChunk enqueues one chunk's gather on g (after s's copy out of the
// same staging buffer, if reuse), then joins s to it.
func (c *Copier) gatherChunk(g, s cuda.Stream, launches []launchRange, bufs *descCursor, reuse bool, gathered, copied cuda.Event) error {
	if reuse {
		if err := c.drv.StreamWaitEvent(g, copied, cuda.EventWaitDefault); err != nil {
			return fmt.Errorf("cudacopy: waiting to reuse a gather chunk: %w", err)
		}
	}
	if err := c.launchRanges(g, bufs, launches); err != nil {
		return err
	}
	if err := c.drv.EventRecord(gathered, g); err != nil {
		return fmt.Errorf("cudacopy: recording a gather's event: %w", err)
	}
	if err := c.drv.StreamWaitEvent(s, gathered, cuda.EventWaitDefault); err != nil {
		return fmt.Errorf("cudacopy: joining a gather: %w", err)
	}
	return nil
}

// scatterChunk loads one chunk's host runs into staging on s (after g's
// scatter out of the same staging buffer, if reuse), then scatters it on g
// with the launches fill returns (writing the chunk's descriptors, where
// they were not written ahead, once its DMA is enqueued).
func (c *Copier) scatterChunk(g, s cuda.Stream, fill func() ([]launchRange, error), bufs *descCursor, reuse bool, pieces []gatherPiece, loaded, scattered cuda.Event) error {
	if reuse {
		if err := c.drv.StreamWaitEvent(s, scattered, cuda.EventWaitDefault); err != nil {
			return fmt.Errorf("cudacopy: waiting to reuse a scatter chunk: %w", err)
		}
	}
	if err := c.stagingDMA(H2D, s, pieces); err != nil {
		return err
	}
	if err := c.drv.EventRecord(loaded, s); err != nil {
		return fmt.Errorf("cudacopy: recording a staged load's event: %w", err)
	}
	if err := c.drv.StreamWaitEvent(g, loaded, cuda.EventWaitDefault); err != nil {
		return fmt.Errorf("cudacopy: joining a staged load: %w", err)
	}
	launches, err := fill()
	if err != nil {
		return err
	}
	if err := c.launchRanges(g, bufs, launches); err != nil {
		return err
	}
	if err := c.drv.EventRecord(scattered, g); err != nil {
		return fmt.Errorf("cudacopy: recording a scatter's event: %w", err)
	}
	return nil
}

// descCursor walks a ticket's descriptor buffers: the next free
// descriptor is table[off] of bufs[i].
type descCursor struct {
	bufs   []*descBuf
	i, off int
	// fromHost: the kernels read the descriptors from the pinned host
	// tables (a registered host pointer is a device pointer, see
	// Capabilities.HostPointerIdentity) and nothing is uploaded.
	fromHost bool
}

// launchRange is one launch of a staged chunk: n descriptors from
// table[off] of the ticket's buffer buf.
type launchRange struct{ buf, off, n int }

// fill writes one chunk's descriptors into the ticket's next free
// descriptors and returns its launches (a chunk may end one buffer and
// start the next: two launches).
func (cur *descCursor) fill(ck *chunker) ([]launchRange, error) {
	var rs []launchRange
	for !ck.done() {
		if cur.off == len(cur.bufs[cur.i].table) {
			cur.i, cur.off = cur.i+1, 0
		}
		n, err := ck.next(cur.bufs[cur.i].table[cur.off:])
		if err != nil {
			return nil, err
		}
		rs = append(rs, launchRange{cur.i, cur.off, n})
		cur.off += n
	}
	return rs, nil
}

// uploadDescs copies the descriptors fill wrote to the device on g, one
// copy per buffer.
func (c *Copier) uploadDescs(g cuda.Stream, cur *descCursor) error {
	for i := 0; i <= cur.i && i < len(cur.bufs); i++ {
		b, n := cur.bufs[i], len(cur.bufs[i].table)
		if i == cur.i {
			n = cur.off
		}
		if n == 0 {
			continue
		}
		if err := c.drv.MemcpyAsync(b.dev, cuda.DevicePtr(uintptr(b.host)), uint64(n)*descSize, g); err != nil {
			return fmt.Errorf("cudacopy: uploading %d staged descriptors: %w", n, err)
		}
	}
	return nil
}

// launchRanges launches the copy kernel on g over uploaded descriptors
// (or, fromHost, the pinned tables themselves).
func (c *Copier) launchRanges(g cuda.Stream, cur *descCursor, rs []launchRange) error {
	l := &c.stg
	warps := l.Threads / 32
	for _, r := range rs {
		dev := cur.bufs[r.buf].dev + cuda.DevicePtr(uint64(r.off)*descSize)
		if cur.fromHost {
			dev = cuda.DevicePtr(uintptr(cur.bufs[r.buf].host)) + cuda.DevicePtr(uint64(r.off)*descSize)
		}
		// The launch copies its parameters: the buffer's own stay as they
		// are for later use of the buffer by enqueue.
		grid := uint32(min(l.CTAs, (r.n+warps-1)/warps))
		args := [][]byte{cuda.Arg(uint64(dev)), cuda.Arg(uint32(r.n)), cuda.Arg(uint64(0)), cuda.Arg(uint64(0))}
		if !l.Throttled() {
			args = args[:2] // the unthrottled kernels: (descs, n)
		}
		if err := c.drv.LaunchKernel(l.fn, cuda.Dim3{X: grid, Y: 1, Z: 1}, cuda.Dim3{X: uint32(l.Threads), Y: 1, Z: 1}, 0, g, args...); err != nil {
			return fmt.Errorf("cudacopy: launching %d staged descriptors on %d CTAs: %w", r.n, grid, err)
		}
	}
	return nil
}

// packStaged places segs into the chunks parts gives (chunkParts: in
// order, a segment that does not fit the rest of a chunk starts the next;
// chunk k lives in staging[k % len(staging)]) and returns the kernel's copies (D2H: device → staging;
// H2D: staging → device) and the DMAs, one per host-contiguous run within a
// chunk and within one of hosts' registered ranges (a copy may not span two
// registrations; segments in no known range get a DMA each), runs of equal
// length in [minRow, maxRow) (minRow 0: none) at a constant host pitch and
// back to back in staging merged into one pitched DMA (runPacker).
// The kernel's segments go into kern's memory (grown as needed; nil: a
// new slice).
func packStaged(dir Path, segs []Segment, parts []part, staging []cuda.DevicePtr, hosts *hostTable, minRow, maxRow uint64, kern []Segment) ([]Segment, []gatherPiece) {
	kern = slices.Grow(kern[:0], len(segs))[:len(segs)]
	rp := runPacker{minRow: minRow, maxRow: maxRow, keep: true, pieces: make([]gatherPiece, 0, 8)}
	for k, p := range parts {
		off := uint64(0)
		for i := p.lo; i < p.hi; i++ {
			sg := segs[i]
			stg, host := uint64(staging[k%len(staging)])+off, hostSide(dir, sg)
			if dir == D2H {
				kern[i] = Segment{Dst: stg, Src: sg.Src, Len: sg.Len}
			} else {
				kern[i] = Segment{Dst: sg.Dst, Src: stg, Len: sg.Len}
			}
			rp.add(host, stg, sg.Len, k, hosts.rangeOf(host, sg.Len))
			off += sg.Len
		}
	}
	rp.flush()
	return kern, rp.pieces
}

// maxStagingPitch bounds the host pitch of a pitched staging DMA (the
// driver's limit, CU_DEVICE_ATTRIBUTE_MAX_PITCH, is 2^31 - 1 on current
// GPUs).
const maxStagingPitch = 1 << 30

// runPacker turns a staged batch's segments, added in order, into its
// DMAs: a segment that continues the current run (host and staging
// contiguous, the same chunk and registered range, a range known) extends
// it; a run that ends becomes a row of the last DMA where that one is a
// run (or pitched rows) of the same length, in [minRow, maxRow) (a longer
// run already moves at the link's rate alone: whole blocks keep their
// DMAs), in the same chunk and range, its staging right after the last
// row's and its host address one pitch on (the first two rows set the
// pitch, larger than the row); otherwise a DMA of its own. keep: the DMAs
// are kept in pieces; else only n counts them (stageable).
type runPacker struct {
	minRow, maxRow uint64
	keep           bool
	pieces         []gatherPiece
	n              int
	// cur is the open run (have), in range curR; last the last DMA, in
	// range lastR.
	cur, last   gatherPiece
	curR, lastR int
	have        bool
}

func (rp *runPacker) add(host, stg, n uint64, chunk, r int) {
	c := &rp.cur
	if rp.have && r >= 0 && r == rp.curR && c.chunk == chunk && c.host+c.len == host && c.staging+c.len == stg {
		c.len += n
		return
	}
	rp.flush()
	rp.cur, rp.curR, rp.have = gatherPiece{host: host, staging: stg, len: n, chunk: chunk}, r, true
}

// flush ends the open run.
func (rp *runPacker) flush() {
	if !rp.have {
		return
	}
	rp.have = false
	if rp.n > 0 && rp.curR >= 0 && rp.curR == rp.lastR && rp.last.addRow(rp.cur, rp.minRow, rp.maxRow) {
		if rp.keep {
			rp.pieces[len(rp.pieces)-1] = rp.last
		}
		return
	}
	rp.last, rp.lastR = rp.cur, rp.curR
	rp.n++
	if rp.keep {
		rp.pieces = append(rp.pieces, rp.cur)
	}
}

// addRow makes run q the next row of p (a run or pitched rows in the same
// registered range) where it can be one: see runPacker.
func (p *gatherPiece) addRow(q gatherPiece, minRow, maxRow uint64) bool {
	if minRow == 0 || p.chunk != q.chunk || p.len != q.len || p.len < minRow || p.len >= maxRow {
		return false
	}
	rows := max(p.rows, 1)
	if p.staging+rows*p.len != q.staging {
		return false
	}
	lastHost := p.host + (rows-1)*p.pitch
	if q.host <= lastHost {
		return false
	}
	step := q.host - lastHost
	switch {
	case rows == 1 && step > p.len && step <= maxStagingPitch:
		p.pitch = step
	case rows == 1 || step != p.pitch:
		return false
	}
	p.rows = rows + 1
	return true
}

// stagingDMA enqueues one chunk's copies between staging and the host on s
// (D2H: staging → host; H2D: host → staging): the batch API where the
// driver has it, else one cuMemcpyAsync per run.
func (c *Copier) stagingDMA(dir Path, s cuda.Stream, pieces []gatherPiece) error {
	segs := make([]Segment, 0, len(pieces))
	for _, p := range pieces {
		if p.rows > 1 {
			cp := cuda.Memcpy2D{Dst: cuda.DevicePtr(p.staging), DstPitch: p.len, Src: cuda.DevicePtr(p.host), SrcPitch: p.pitch, Width: p.len, Height: p.rows}
			if dir == D2H {
				cp = cuda.Memcpy2D{Dst: cuda.DevicePtr(p.host), DstPitch: p.pitch, Src: cuda.DevicePtr(p.staging), SrcPitch: p.len, Width: p.len, Height: p.rows}
			}
			if err := c.drv.Memcpy2DAsync(cp, s); err != nil {
				return fmt.Errorf("cudacopy: a pitched staging copy of %d rows of %d bytes (host pitch %d): %w", p.rows, p.len, p.pitch, err)
			}
			c.pitched.Add(1)
			continue
		}
		if dir == H2D {
			segs = append(segs, Segment{Dst: p.staging, Src: p.host, Len: p.len})
		} else {
			segs = append(segs, Segment{Dst: p.host, Src: p.staging, Len: p.len})
		}
	}
	switch {
	case len(segs) == 0:
		return nil
	case c.caps.Batch:
		return c.batch(s, segs)
	}
	return c.memcpy(s, segs)
}

// PitchedCopies is the number of pitched DMAs (cuMemcpy2DAsync) staged
// copies have enqueued: runs of one length at a constant host pitch, such
// as one layer of consecutive slots in a per-layer load.
func (c *Copier) PitchedCopies() uint64 { return c.pitched.Load() }

// joinAfterFailure makes s wait for everything enqueued on g so far (e
// re-recorded on g: earlier waits on e keep the record they saw), or, if
// that fails, waits for g on the CPU: after a failed staged load, s's
// completion then covers every scatter already launched.
func (c *Copier) joinAfterFailure(s, g cuda.Stream, e cuda.Event) error {
	err := c.drv.EventRecord(e, g)
	if err == nil {
		if err = c.drv.StreamWaitEvent(s, e, cuda.EventWaitDefault); err == nil {
			return nil
		}
	}
	if serr := c.drv.StreamSynchronize(g); serr != nil {
		return fmt.Errorf("cudacopy: joining the scatters of a failed load: %w", errors.Join(err, serr))
	}
	return nil
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
		errs = append(errs, c.devFreeLocked(p, uint64(c.opts.GatherChunkBytes)))
	}
	for _, e := range c.eventsAll {
		errs = append(errs, c.drv.EventDestroy(e))
	}
	c.stagingAll, c.stagingFree, c.eventsAll, c.eventsFree = nil, nil, nil, nil
	return errors.Join(errs...)
}
