package transfer

import (
	"fmt"
	"math/bits"
)

// Template requests. A lazy request whose blocks all have one shape (a TP
// rank's heads of a token-major block: 2 × layers × heads strided pieces a
// block) may give that shape once (Template.Pieces) and, per part, just
// its blocks (Template.Blocks: a host address and a device block id each).
// A device that copies templates (the CUDA device with a PTX image that
// has kvo_copy_tmpl) then copies a part as one launch whose table is the
// template and 16 bytes a block, built in microseconds where the
// segments of the same part take milliseconds to build, validate and
// encode. Any other device, and a template its device refuses, copies the
// parts' segments from Build as before: Build stays required, and its
// segments are what the template must copy (tests compare the two).

// Piece is one piece of every block of a template request. Block id's
// piece is Segment's with Dev + id × DevStride for Dev and the block's
// host address + Host for Host (Host is an offset from the block's).
type Piece struct {
	Segment
	DevStride uint64
}

// Block is one block of a template request's part: the address of its
// host buffer (Host) and its device block id (ID). The copier's
// TemplateBlock is this type, so that a part's blocks go to it as they are.
type Block struct {
	Host, ID uint64
}

// Template is a lazy request's parts as blocks of one shape (see the
// section above). For a Layered request part l copies the pieces of layer
// l, Pieces[LayerEnds[l-1]:LayerEnds[l]], of each block Blocks gives for
// it (LayerEnds has one entry per part; LayerParts is not allowed); for
// any other request every part copies every piece of its blocks.
// Blocks(p, dst) appends part p's blocks to dst and returns it, under
// Build's rules (the same goroutines and concurrency); the bytes it
// makes the part copy must be those of Build's segments for that part.
type Template struct {
	Pieces    []Piece
	LayerEnds []int
	Blocks    func(part int, dst []Block) ([]Block, error)
}

// templater is a Device that copies templates: PrepareTemplate encodes
// pieces for dir (no driver call; any goroutine), or fails when the device
// copies them as segments instead; CopyTemplate enqueues the prepared
// template over blocks, as Copy does its segments.
type templater interface {
	// CanTemplate reports whether dir's copies may go as templates.
	CanTemplate(dir Direction) bool
	PrepareTemplate(dir Direction, pieces []Piece) (any, error)
	CopyTemplate(dir Direction, prepared any, blocks []Block) (retire func(), err error)
}

// opTemplate is one template of an op (per layer for a Layered request):
// its pieces, the device's encoding, the host bytes a block's pieces span
// and the bytes a block copies.
type opTemplate struct {
	pieces []Piece
	prep   any
	span   uint64
	bytes  uint64
}

// checkTemplate checks req.Template's shape against the request.
func checkTemplate(req *Request) error {
	t := req.Template
	switch {
	case t.Blocks == nil:
		return fmt.Errorf("%w: %v: a Template without Blocks", ErrInvalidRequest, req.Dir)
	case len(t.Pieces) == 0:
		return fmt.Errorf("%w: %v: a Template of no pieces", ErrInvalidRequest, req.Dir)
	case len(req.LayerParts) > 0:
		return fmt.Errorf("%w: %v: a Template with LayerParts: a template's layer is one part", ErrInvalidRequest, req.Dir)
	case req.Layered && len(t.LayerEnds) != req.Parts:
		return fmt.Errorf("%w: %v: a Template of %d LayerEnds for %d layers", ErrInvalidRequest, req.Dir, len(t.LayerEnds), req.Parts)
	case !req.Layered && len(t.LayerEnds) > 0:
		return fmt.Errorf("%w: %v: a Template with LayerEnds on a request that is not Layered", ErrInvalidRequest, req.Dir)
	}
	prev := 0
	for i, e := range t.LayerEnds {
		if e <= prev || e > len(t.Pieces) {
			return fmt.Errorf("%w: Template.LayerEnds[%d] = %d, want > %d and ≤ %d pieces", ErrInvalidRequest, i, e, prev, len(t.Pieces))
		}
		prev = e
	}
	if len(t.LayerEnds) > 0 && prev != len(t.Pieces) {
		return fmt.Errorf("%w: Template.LayerEnds ends at %d, want %d (every piece in a layer)", ErrInvalidRequest, prev, len(t.Pieces))
	}
	return nil
}

// prepareTemplates has dev encode op's templates (one per layer of a
// Layered request, else one). It leaves op.tmpl nil, so that the parts
// are copied from Build, when dev is no templater or refuses a template
// (a PTX image without template launches, a forced DMA method, pieces it
// cannot take): Build's segments are then validated as ever.
func (s *Scheduler) prepareTemplates(op *Op) {
	tp, ok := s.dev.(templater)
	if !ok || op.req.Template == nil {
		return
	}
	t := op.req.Template
	ends := t.LayerEnds
	if len(ends) == 0 {
		ends = []int{len(t.Pieces)}
	}
	out := make([]opTemplate, len(ends))
	from := 0
	for i, to := range ends {
		o := &out[i]
		o.pieces = t.Pieces[from:to]
		from = to
		for j := range o.pieces {
			p := &o.pieces[j]
			if checkPiece(j, p, s.cfg.Align) != nil {
				return // Build's segments report it
			}
			end, c1 := bits.Add64(p.Host, p.hostExtent(), 0)
			sum, c2 := bits.Add64(o.bytes, p.Len, 0)
			if c1 != 0 || c2 != 0 {
				return // Build's segments report it
			}
			o.span, o.bytes = max(o.span, end), sum
		}
		var err error
		if o.prep, err = tp.PrepareTemplate(op.dir, o.pieces); err != nil {
			return
		}
	}
	op.tmpl = out
}

// templateOf is the template part p of op copies.
func (op *Op) templateOf(p int) *opTemplate {
	if len(op.tmpl) == 1 {
		return &op.tmpl[0]
	}
	return &op.tmpl[p]
}

// buildTemplatePart builds part p of a template op into pb: its blocks,
// checked (each block's host span in a registered host range, each
// piece's device span over the part's ids in a known allocation, the
// alignment), and the bytes they copy. With invariants and a Tracker the
// part's segments are built too (Build), for the Tracker's checks.
func (s *Scheduler) buildTemplatePart(op *Op, p int, pb *partBuf) {
	t := op.templateOf(p)
	blocks, err := op.req.Template.Blocks(p, pb.blocks[:0])
	pb.blocks = blocks[:0]
	if err != nil {
		pb.err = fmt.Errorf("transfer: building part %d of %d of a %v: %w", p, op.req.Parts, op.dir, err)
		return
	}
	if err := s.checkBlocks(t, blocks); err != nil {
		pb.err = fmt.Errorf("transfer: part %d of %d of a %v: %w", p, op.req.Parts, op.dir, err)
		return
	}
	pb.blocks, pb.tmpl = blocks, true
	hi, lo := bits.Mul64(uint64(len(blocks)), t.bytes)
	if hi != 0 {
		pb.err = fmt.Errorf("%w: part %d of a %v copies more than 2^64 bytes", ErrInvalidSegment, p, op.dir)
		return
	}
	pb.tbytes = lo
	if invariantsEnabled && s.cfg.Tracker != nil {
		segs, err := op.req.Build(p, pb.segs[:0])
		if err == nil {
			pb.segs = segs[:0]
			pb.placed, err = validate(segs, s.cfg.Align, &s.host, &s.devR, pb.placed[:0])
		}
		if err != nil {
			pb.err = fmt.Errorf("transfer: part %d of %d of a %v, built as segments for the tracker: %w", p, op.req.Parts, op.dir, err)
			return
		}
		var n uint64
		for _, g := range pb.placed {
			n += g.Len
		}
		if n != pb.tbytes {
			pb.err = fmt.Errorf("%w: part %d of a %v: its template blocks copy %d bytes, its segments %d", ErrInvalidRequest, p, op.dir, pb.tbytes, n)
		}
	}
}

// checkBlocks checks a template part's blocks before anything is
// enqueued: every block's host span [Host, Host+span) inside a registered
// host range, aligned to Config.Align; every piece's device bytes over
// the part's smallest to largest id inside one known device allocation.
func (s *Scheduler) checkBlocks(t *opTemplate, blocks []Block) error {
	if len(blocks) == 0 {
		return fmt.Errorf("%w: a template part of no blocks", ErrInvalidSegment)
	}
	align := s.cfg.Align
	s.host.mu.RLock()
	defer s.host.mu.RUnlock()
	s.devR.mu.RLock()
	defer s.devR.mu.RUnlock()
	var last memRange
	at := -1
	lo, hi := ^uint64(0), uint64(0)
	for i, b := range blocks {
		if b.Host+t.span < b.Host {
			return fmt.Errorf("%w: template block %d (host %#x, %d bytes) overflows the address space", ErrInvalidSegment, i, b.Host, t.span)
		}
		if align > 1 && b.Host%align != 0 {
			return fmt.Errorf("%w: template block %d host %#x is not aligned to %d bytes", ErrInvalidSegment, i, b.Host, align)
		}
		if !last.holds(b.Host, t.span) {
			r, a, ok := s.host.lookupNear(b.Host, t.span, at)
			if !ok {
				return fmt.Errorf("%w: template block %d host [%#x,%#x) is not inside a registered host range", ErrOutOfRange, i, b.Host, b.Host+t.span)
			}
			last, at = r, a
		}
		lo, hi = min(lo, b.ID), max(hi, b.ID)
	}
	for j := range t.pieces {
		p := &t.pieces[j]
		h1, first := bits.Mul64(lo, p.DevStride)
		h2, lastAt := bits.Mul64(hi, p.DevStride)
		from, c1 := bits.Add64(p.Dev, first, 0)
		at, c2 := bits.Add64(p.Dev, lastAt, 0)
		n := p.devExtent()
		end, c3 := bits.Add64(at, n, 0)
		if h1|h2|c1|c2|c3 != 0 {
			return fmt.Errorf("%w: template piece %d (dev %#x, stride %d) at block ids %d to %d overflows the address space", ErrInvalidSegment, j, p.Dev, p.DevStride, lo, hi)
		}
		if align > 1 && (p.Dev%align != 0 || p.DevStride%align != 0) {
			return fmt.Errorf("%w: template piece %d (dev %#x, stride %d) is not aligned to %d bytes", ErrInvalidSegment, j, p.Dev, p.DevStride, align)
		}
		if _, _, ok := s.devR.lookupNear(from, end-from, -1); !ok {
			return fmt.Errorf("%w: template piece %d device [%#x,%#x) over block ids %d to %d is not inside a known device allocation", ErrOutOfRange, j, from, end, lo, hi)
		}
	}
	return nil
}

// checkPiece holds a template piece to what validate asks of a segment
// that does not depend on its block (a length, rows that make it up,
// alignment to align: its host side as an offset into the slot, whose
// address checkBlocks holds to align), so that a template is taken only
// where Build's segments would pass too.
func checkPiece(i int, p *Piece, align uint64) error {
	s := p.Segment
	if s.Len == 0 {
		return fmt.Errorf("%w: template piece %d has zero length", ErrInvalidSegment, i)
	}
	if align > 1 && (s.Dev%align != 0 || s.Host%align != 0 || s.Len%align != 0) {
		return fmt.Errorf("%w: template piece %d (dev %#x, host offset %d, len %d) is not aligned to %d bytes", ErrInvalidSegment, i, s.Dev, s.Host, s.Len, align)
	}
	if s.Rows > 1 {
		return check2D(i, s, align)
	}
	return nil
}

// copyTemplatePart copies a built template part (issuing thread).
func (s *Scheduler) copyTemplatePart(b *batch, op *Op, pb *partBuf) error {
	d := op.dir
	op.built += pb.tbytes
	if op.built > op.bytes {
		return fmt.Errorf("%w: a %v's parts copy more than the %d bytes it declared", ErrInvalidRequest, d, op.bytes)
	}
	if invariantsEnabled && s.cfg.Tracker != nil {
		op.gens = append(op.gens, s.cfg.Tracker.gens("at submission", d, pb.placed, nil)...)
		op.segs = append(op.segs, pb.placed...)
	}
	s.trace("copy", pb.p)
	retire, err := s.dev.(templater).CopyTemplate(d, op.templateOf(pb.p).prep, pb.blocks)
	s.trace("copied", pb.p)
	if err != nil {
		return fmt.Errorf("transfer: %v copy of template part %d of %d (%d blocks): %w", d, pb.p, op.req.Parts, len(pb.blocks), err)
	}
	b.retires = append(b.retires, retire)
	return nil
}

// Templates reports whether dir's template requests (Request.Template)
// are copied as templates on this scheduler's device (the CUDA device with
// template launches for dir), so that a caller can cut its parts for them
// (one part, or one a layer); otherwise their parts are copied from Build.
func (s *Scheduler) Templates(dir Direction) bool {
	tp, ok := s.dev.(templater)
	return ok && tp.CanTemplate(dir)
}
