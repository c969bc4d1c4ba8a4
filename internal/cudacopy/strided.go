package cudacopy

import (
	"fmt"
	"math/bits"
	"slices"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// Segment2D is a strided copy: Rows rows of RowLen bytes, row r from
// Src + r×SrcPitch to Dst + r×DstPitch (both unified addresses, as in
// Segment). One KV head of a token-major block is one: its tokens are the
// rows, head_dim × dtype bytes each, at the stride of the rank's heads on
// the device and back to back (DstPitch = RowLen) in the host slot.
// Rows = 1 is a contiguous copy (the pitches are then ignored).
type Segment2D struct {
	Dst, Src           uint64
	Rows, RowLen       uint64
	DstPitch, SrcPitch uint64
}

// Limits of a 2-D descriptor of the copy kernels (struct Desc in
// kernels.cu with aux != 0): rows in aux's top 16 bits, each pitch in 24
// bits in units of 16 bytes. A segment beyond them is copied as more
// descriptors (rows) or one descriptor per row (pitches).
const (
	desc2DMaxRows  = 1<<16 - 1
	desc2DMaxPitch = (1<<24 - 1) * kernelAlign
	// Desc2DKernel is the marker kernel of a PTX image whose copy kernels
	// take 2-D descriptors. An image without it (built before they existed)
	// gets one descriptor per row.
	Desc2DKernel = "kvo_desc2d"
)

// encodeDesc2D is aux of a 2-D descriptor of rows rows (≥ 2) at the given
// pitches (multiples of 16, at most desc2DMaxPitch).
func encodeDesc2D(rows, srcPitch, dstPitch uint64) uint64 {
	return rows<<48 | (srcPitch/kernelAlign)<<24 | dstPitch/kernelAlign
}

// extent is the bytes a strided side spans: (rows-1)×pitch + row; ok is
// false on overflow.
func extent(rows, row, pitch uint64) (uint64, bool) {
	if rows <= 1 {
		return row, true
	}
	hi, lo := bits.Mul64(rows-1, pitch)
	if hi != 0 {
		return 0, false
	}
	n, carry := bits.Add64(lo, row, 0)
	return n, carry == 0
}

// validateSegments2D checks a strided batch before anything is enqueued:
// ErrInvalidSegment for an empty batch, zero rows or row length, a pitch
// smaller than the row (rows would overlap), a nil address or a span that
// wraps; with align > 1, ErrMisaligned unless addresses, row length and
// pitches (of segments of more than one row) are multiples of align.
func validateSegments2D(segs []Segment2D, align uint64) error {
	_, err := check2DBatch(segs, align)
	return err
}

// batch2D is what a validated strided batch weighs for the choice of
// method: its rows, bytes and whether it meets the kernel's alignment.
type batch2DStats struct {
	rows    int
	total   uint64
	aligned bool
}

// check2DBatch is validateSegments2D, also returning the batch's stats
// (one pass over the segments).
func check2DBatch(segs []Segment2D, align uint64) (batch2DStats, error) {
	if len(segs) == 0 {
		return batch2DStats{}, fmt.Errorf("%w: empty batch", ErrInvalidSegment)
	}
	var st batch2DStats
	var all uint64
	for i, s := range segs {
		if s.Rows == 0 || s.RowLen == 0 {
			return st, fmt.Errorf("%w: 2-D segment %d has %d rows of %d bytes", ErrInvalidSegment, i, s.Rows, s.RowLen)
		}
		acc := s.Src | s.Dst | s.RowLen
		if s.Rows > 1 {
			if s.SrcPitch < s.RowLen || s.DstPitch < s.RowLen {
				return st, fmt.Errorf("%w: 2-D segment %d: pitches src %d, dst %d smaller than its rows of %d bytes", ErrInvalidSegment, i, s.SrcPitch, s.DstPitch, s.RowLen)
			}
			acc |= s.SrcPitch | s.DstPitch
		}
		if err := checkSide2D(i, "src", s.Src, s.SrcPitch, s); err != nil {
			return st, err
		}
		if err := checkSide2D(i, "dst", s.Dst, s.DstPitch, s); err != nil {
			return st, err
		}
		if align > 1 && acc%align != 0 {
			return st, fmt.Errorf("%w: 2-D segment %d (src %#x, dst %#x, %d rows of %d bytes, pitches %d, %d) is not %d-byte aligned",
				ErrMisaligned, i, s.Src, s.Dst, s.Rows, s.RowLen, s.SrcPitch, s.DstPitch, align)
		}
		all |= acc
		st.rows += int(s.Rows)
		st.total += s.Rows * s.RowLen
	}
	st.aligned = all%kernelAlign == 0
	return st, nil
}

// checkSide2D checks one side (src or dst) of 2-D segment i: its rows at
// pitch from addr neither overflow nor wrap the address space.
func checkSide2D(i int, name string, addr, pitch uint64, s Segment2D) error {
	n, ok := extent(s.Rows, s.RowLen, pitch)
	if !ok {
		return fmt.Errorf("%w: 2-D segment %d %s: %d rows at pitch %d overflow 64 bits", ErrInvalidSegment, i, name, s.Rows, pitch)
	}
	return checkRange(i, name, addr, n)
}

// stats2D is what Choose weighs for a strided batch: its rows as segments.
func stats2D(segs []Segment2D) (rows int, total uint64, aligned bool) {
	var acc uint64
	for _, s := range segs {
		rows += int(s.Rows)
		total += s.Rows * s.RowLen
		acc |= s.Src | s.Dst | s.RowLen
		if s.Rows > 1 {
			acc |= s.SrcPitch | s.DstPitch
		}
	}
	return rows, total, acc%kernelAlign == 0
}

// Choose2D returns the method Submit2D would use for segs under
// MethodAuto: the DMA methods' rates read at the mean row (each row is a
// copy of theirs), the kernel's at the mean segment when it takes 2-D
// descriptors (Capabilities.Kernel2D), else at the mean row too.
func (c *Copier) Choose2D(dir Path, segs []Segment2D) Method {
	rows, total, ok := stats2D(segs)
	return c.choose2D(dir, len(segs), batch2DStats{rows, total, ok})
}

func (c *Copier) choose2D(dir Path, n int, st batch2DStats) Method {
	kernN := st.rows
	if c.caps.Kernel2D {
		kernN = n
	}
	return c.chooser.Load().choosePieces(dir, st.rows, kernN, st.total, st.aligned)
}

// Submit2D is Submit for strided segments. The kernel method takes them as
// they are when the PTX image has 2-D descriptors (Capabilities.Kernel2D:
// one warp copies up to ChunkBytes of rows; rows longer than half a chunk
// go one descriptor per row chunk), else as one descriptor per row; the
// memcpy and batch methods copy one row per cuMemcpyAsync or batch entry
// (the driver binding has no cuMemcpy2DAsync). Validation, tickets and
// errors are Submit's (a misaligned row, pitch or address is
// ErrMisaligned with MethodKernel forced; MethodAuto then picks a DMA
// method). It allocates nothing.
func (c *Copier) Submit2D(s cuda.Stream, dir Path, segs []Segment2D) (Ticket, error) {
	m, ck, l, err := c.plan2D(dir, segs)
	if err != nil {
		return Ticket{}, err
	}
	switch m {
	case MethodMemcpy:
		return Ticket{}, c.memcpy2D(s, segs)
	case MethodBatch:
		return Ticket{}, c.batch2D(s, segs)
	}
	return c.launch(s, &ck, l, 0)
}

// plan2D is Submit2D's work before the first driver call: validation, the
// method, and for the kernel its chunker (not yet translated) and launch.
func (c *Copier) plan2D(dir Path, segs []Segment2D) (Method, chunker, *launchFn, error) {
	if !dir.valid() {
		return 0, chunker{}, nil, fmt.Errorf("%w: direction %d", ErrInvalidOption, int(dir))
	}
	st, err := check2DBatch(segs, 1)
	if err != nil {
		return 0, chunker{}, nil, err
	}
	m := c.opts.Method
	if m == MethodAuto {
		m = c.choose2D(dir, len(segs), st)
	}
	if m == MethodMemcpy || m == MethodBatch {
		return m, chunker{}, nil, nil
	}
	if !st.aligned {
		if err := validateSegments2D(segs, kernelAlign); err != nil {
			return 0, chunker{}, nil, err
		}
	}
	ck := chunker{
		kind:     jobCopy2D,
		copies2d: segs,
		desc2d:   c.caps.Kernel2D,
		chunk:    uint64(c.opts.ChunkBytes),
		host:     c.hostTableForKernel(),
		hostSrc:  dir == H2D,
		hostDst:  dir == D2H,
	}
	l := &c.h2d
	if dir == D2H {
		l = &c.d2h
		fb := l.FenceBytes
		if c.opts.FenceBytes == 0 && l.Kernel == ProbeCopyKernel && fb < SmallSegmentFenceBytes && st.total/uint64(max(st.rows, 1)) < SmallSegmentFenceBytes {
			fb = SmallSegmentFenceBytes // as fenceBytes does for small segments
		}
		ck.fenceIters = uint64(fb / FenceUnit)
		ck.paceGBps = l.PaceGBps
	}
	return MethodKernel, ck, l, nil
}

// Prepared is a strided batch made ready by Prepare2D for SubmitPrepared:
// validated, its method chosen and, for the kernel, its descriptors
// encoded and host addresses translated. The zero value is ready for use;
// reuse one to keep its descriptor memory.
type Prepared struct {
	method     Method
	dir        Path
	segs       []Segment2D // the DMA methods': the caller's segments
	descs      []desc      // the kernel's, encoded
	fenceIters uint64
	paceGBps   float64
}

// Prepare2D does the host-side work of Submit2D(dir, segs) into p, so that
// SubmitPrepared(s, p) only enqueues: it makes no driver call, takes no
// lock of the Copier and may run on any goroutine, at the same time as
// other Prepare2D calls (on other Prepared values) and as the Copier's
// other methods. Its errors are Submit2D's validation errors. segs must
// stay unchanged until SubmitPrepared returns (the DMA methods read them
// then). The choice of method and the host ranges' translation are those
// of the time of the call: the host ranges segs touch must stay
// registered until the copies have completed, as for Submit2D.
func (c *Copier) Prepare2D(dir Path, segs []Segment2D, p *Prepared) error {
	p.method, p.segs, p.descs = MethodAuto, nil, p.descs[:0] // nothing to submit until it succeeds
	m, ck, _, err := c.plan2D(dir, segs)
	if err != nil {
		return err
	}
	p.method, p.dir = m, dir
	if m != MethodKernel {
		p.segs = segs
		return nil
	}
	if !c.caps.Kernel {
		return fmt.Errorf("%w: %s", ErrUnavailable, c.caps.KernelError)
	}
	if err := ck.translateAll(); err != nil {
		return err
	}
	n := ck.count()
	p.descs = slices.Grow(p.descs[:0], n)[:n]
	w, err := ck.next(p.descs)
	if err != nil {
		return err
	}
	if w != n || !ck.done() {
		return fmt.Errorf("cudacopy: encoding %d 2-D segments gave %d descriptors, counted %d", len(segs), w, n)
	}
	p.fenceIters, p.paceGBps = ck.fenceIters, ck.paceGBps
	return nil
}

// SubmitPrepared enqueues the copies p holds (Prepare2D) on s, as
// Submit2D would have: the same tickets, errors and retirement rule
// (ErrDeviceBudget with nothing enqueued when its descriptors need more
// device memory than MaxDeviceBytes allows one call). p may be prepared
// again once it returns.
func (c *Copier) SubmitPrepared(s cuda.Stream, p *Prepared) (Ticket, error) {
	switch p.method {
	case MethodMemcpy:
		return Ticket{}, c.memcpy2D(s, p.segs)
	case MethodBatch:
		return Ticket{}, c.batch2D(s, p.segs)
	case MethodKernel:
	default:
		return Ticket{}, fmt.Errorf("%w: SubmitPrepared of a batch Prepare2D did not prepare", ErrInvalidOption)
	}
	if len(p.descs) == 0 {
		return Ticket{}, fmt.Errorf("%w: SubmitPrepared of an empty batch", ErrInvalidSegment)
	}
	ck := chunker{kind: jobCopy2D, pre: p.descs, fenceIters: p.fenceIters, paceGBps: p.paceGBps}
	l := &c.h2d
	if p.dir == D2H {
		l = &c.d2h
	}
	return c.launch(s, &ck, l, 0)
}

func (c *Copier) memcpy2D(s cuda.Stream, segs []Segment2D) error {
	if err := c.checkOpen(); err != nil {
		return err
	}
	for i, g := range segs {
		for r := range g.Rows {
			if err := c.drv.MemcpyAsync(cuda.DevicePtr(g.Dst+r*g.DstPitch), cuda.DevicePtr(g.Src+r*g.SrcPitch), g.RowLen, s); err != nil {
				return fmt.Errorf("cudacopy: memcpy of row %d of 2-D segment %d of %d (%d bytes): %w", r, i, len(segs), g.RowLen, err)
			}
		}
	}
	return nil
}

func (c *Copier) batch2D(s cuda.Stream, segs []Segment2D) error {
	if !c.caps.Batch {
		return fmt.Errorf("%w: batch method without cuMemcpyBatchAsync", ErrUnavailable)
	}
	if err := c.checkOpen(); err != nil {
		return err
	}
	sp := c.batchPool.Get().(*[]cuda.BatchCopy)
	defer c.batchPool.Put(sp)
	scratch := *sp
	n := 0
	flush := func(i int) error {
		if n == 0 {
			return nil
		}
		err := c.drv.MemcpyBatchAsync(scratch[:n], s)
		n = 0
		if err != nil {
			return fmt.Errorf("cudacopy: batch copy of rows up to 2-D segment %d of %d: %w", i, len(segs), err)
		}
		return nil
	}
	for i, g := range segs {
		for r := range g.Rows {
			scratch[n] = cuda.BatchCopy{Dst: cuda.DevicePtr(g.Dst + r*g.DstPitch), Src: cuda.DevicePtr(g.Src + r*g.SrcPitch), Size: g.RowLen}
			if n++; n == len(scratch) {
				if err := flush(i); err != nil {
					return err
				}
			}
		}
	}
	return flush(len(segs) - 1)
}

// use2D reports whether the chunker sends s as 2-D descriptors: the kernel
// takes them, s has several rows, a row is at most half a chunk, and the
// pitches fit a descriptor.
func (c *chunker) use2D(s *Segment2D) bool {
	return c.desc2d && s.Rows > 1 && (c.chunk == 0 || 2*s.RowLen <= c.chunk) &&
		s.SrcPitch <= desc2DMaxPitch && s.DstPitch <= desc2DMaxPitch
}

// rowsPer is the rows of s one 2-D descriptor takes: a chunk's worth, at
// most desc2DMaxRows, and few enough that the kernel's 32-bit word count
// of the descriptor does not overflow.
func (c *chunker) rowsPer(s *Segment2D) uint64 {
	n := uint64(desc2DMaxRows)
	if c.chunk != 0 {
		n = min(n, c.chunk/s.RowLen)
	}
	return max(min(n, (1<<32-1)/max(s.RowLen/kernelAlign, 1)), 1)
}

// count2D is count for jobCopy2D.
func (c *chunker) count2D() int {
	n := 0
	for i := range c.copies2d {
		s := &c.copies2d[i]
		if c.use2D(s) {
			p := c.rowsPer(s)
			n += int((s.Rows + p - 1) / p)
		} else {
			n += int(s.Rows) * piecesOf(s.RowLen, c.chunk)
		}
	}
	return n
}

// translateAll2D is translateAll for jobCopy2D: each host side's whole span.
func (c *chunker) translateAll2D() error {
	if c.host == nil {
		return nil
	}
	hint := 0
	for i, s := range c.copies2d {
		if c.hostSrc {
			n, _ := extent(s.Rows, s.RowLen, s.SrcPitch)
			if _, ok := c.host.translateHint(s.Src, n, &hint); !ok {
				return fmt.Errorf("%w: 2-D segment %d src %#x+%d", ErrUnregisteredHost, i, s.Src, n)
			}
		}
		if c.hostDst {
			n, _ := extent(s.Rows, s.RowLen, s.DstPitch)
			if _, ok := c.host.translateHint(s.Dst, n, &hint); !ok {
				return fmt.Errorf("%w: 2-D segment %d dst %#x+%d", ErrUnregisteredHost, i, s.Dst, n)
			}
		}
	}
	return nil
}

// next2D is next for jobCopy2D: 2-D descriptors of up to rowsPer rows
// where use2D, else each row in chunks as 1-D descriptors. c.row is the
// next row of item c.i, c.off the bytes of that row already emitted.
func (c *chunker) next2D(out []desc) (int, error) {
	w := 0
	for w < len(out) && c.i < len(c.copies2d) {
		s := &c.copies2d[c.i]
		src, dst := s.Src+c.row*s.SrcPitch, s.Dst+c.row*s.DstPitch
		var d desc
		var spanS, spanD uint64
		if c.use2D(s) {
			k := min(s.Rows-c.row, c.rowsPer(s))
			d = desc{Src: src, Dst: dst, Len: s.RowLen}
			if k > 1 {
				d.Aux = encodeDesc2D(k, s.SrcPitch, s.DstPitch)
			}
			spanS, _ = extent(k, s.RowLen, s.SrcPitch)
			spanD, _ = extent(k, s.RowLen, s.DstPitch)
			c.row += k
		} else {
			n := s.RowLen - c.off
			if c.chunk != 0 && n > c.chunk {
				n = c.chunk
			}
			d = desc{Src: src + c.off, Dst: dst + c.off, Len: n}
			spanS, spanD = n, n
			if c.off += n; c.off == s.RowLen {
				c.off = 0
				c.row++
			}
		}
		if c.host != nil {
			var ok bool
			if c.hostSrc {
				if d.Src, ok = c.host.translateHint(d.Src, spanS, &c.hint); !ok {
					return w, fmt.Errorf("%w: %#x+%d", ErrUnregisteredHost, d.Src, spanS)
				}
			}
			if c.hostDst {
				if d.Dst, ok = c.host.translateHint(d.Dst, spanD, &c.hint); !ok {
					return w, fmt.Errorf("%w: %#x+%d", ErrUnregisteredHost, d.Dst, spanD)
				}
			}
		}
		out[w] = d
		w++
		if c.row == s.Rows {
			c.i++
			c.row, c.off = 0, 0
		}
	}
	return w, nil
}
