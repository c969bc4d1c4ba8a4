package cudacopy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"unsafe"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/transfer"
)

// Template launches (kvo_copy_tmpl and kvo_copy_tmpl_probe in kernels.cu)
// copy many blocks of one shape: a block's copy is a list of pieces
// relative to the block (a TemplatePiece: its device address in block id 0
// and the stride between ids, its offset from the block's host address),
// and a launch's table is that template once, then one 16-byte entry per
// block (its host address and id). Each warp computes its descriptor from
// a piece and a block. A TP rank's head-sliced copy of a token-major block
// is 2 × layers × heads pieces: as descriptors it takes 32 bytes a piece
// and block built, uploaded and launched in parts; as a template, 16 bytes
// a block and one launch.

// TemplatePiece is one piece of every block of a template copy. Block id's
// piece lies at Dev + id × DevStride on the device and at the block's host
// address + HostOff; it is Rows rows of RowLen bytes at DevPitch and
// HostPitch (Rows ≤ 1: RowLen contiguous bytes, pitches ignored).
type TemplatePiece struct {
	Dev, DevStride                    uint64
	HostOff                           uint64
	Rows, RowLen, DevPitch, HostPitch uint64
}

// TemplateBlock is one block of a template copy: its host address (a
// registered host range must hold the template's span from it) and its id.
// It is transfer's Block, so that a request's blocks come as they are.
type TemplateBlock = transfer.Block

// Template is a template's pieces encoded for one direction's launches
// (NewTemplate), immutable and safe to share between SubmitTemplate calls.
type Template struct {
	c     *Copier // the Copier whose options (table size, chunks) encoded it
	dir   Path
	enc   []tmplPiece
	span  uint64 // host bytes from a block's address its pieces reach
	bytes uint64 // bytes a block copies
	rows  uint64 // rows a block copies (contiguous pieces count one each)
	maxID uint64 // the largest id whose pieces do not overflow 64 bits
}

// Bytes is how many bytes each block of the template copies.
func (t *Template) Bytes() uint64 { return t.bytes }

// HostSpan is how many bytes from a block's host address its pieces reach.
func (t *Template) HostSpan() uint64 { return t.span }

// tmplPiece is struct TDesc of kernels.cu: 64 bytes, little-endian.
type tmplPiece struct {
	Dev, Stride, HostOff, Len, Aux uint64
	_                              [3]uint64
}

const (
	tmplPieceSize = 64
	tmplBlockSize = 16
	// TemplateKernel and TemplateProbeKernel are the template launches'
	// kernels: kvo_copy's and kvo_copy_probe's loops over a template.
	TemplateKernel      = "kvo_copy_tmpl"
	TemplateProbeKernel = "kvo_copy_tmpl_probe"
)

// tmplLaunch returns dir's template launch, or why there is none: the PTX
// image has no template kernels, the method is forced to a DMA one, or
// dir's copy kernel has no template counterpart (kvo_copy for H2D and
// kvo_copy_probe for D2H have).
func (c *Copier) tmplLaunch(dir Path) (*launchFn, error) {
	switch {
	case !c.caps.Kernel:
		return nil, fmt.Errorf("%w: template copies need the copy kernels: %s", ErrUnavailable, c.caps.KernelError)
	case !c.caps.Template:
		return nil, fmt.Errorf("%w: the PTX image has no %s (built before template launches)", ErrUnavailable, TemplateKernel)
	case c.opts.Method == MethodMemcpy || c.opts.Method == MethodBatch:
		return nil, fmt.Errorf("%w: template copies are the kernel's, and the method is forced to %v", ErrUnavailable, c.opts.Method)
	}
	switch dir {
	case H2D:
		if c.h2d.Kernel != DefaultCopyKernel {
			return nil, fmt.Errorf("%w: the H2D copy kernel is %s; template copies have kvo_copy's loop only", ErrUnavailable, c.h2d.Kernel)
		}
		return &c.tmplH2D, nil
	case D2H:
		if c.d2h.Kernel != ProbeCopyKernel {
			return nil, fmt.Errorf("%w: the D2H copy kernel is %s; template copies have kvo_copy_probe's loop only", ErrUnavailable, c.d2h.Kernel)
		}
		return &c.tmplD2H, nil
	}
	return nil, fmt.Errorf("%w: template copies go between host and device, not %v", ErrInvalidOption, dir)
}

// TemplateAvailable is nil when NewTemplate may succeed for dir, else why
// it cannot (ErrUnavailable, or ErrInvalidOption for a direction that is
// not H2D or D2H).
func (c *Copier) TemplateAvailable(dir Path) error {
	_, err := c.tmplLaunch(dir)
	return err
}

// maxTemplatePieces is the most encoded pieces a template may have: its
// table and one block fit one descriptor table.
func (c *Copier) maxTemplatePieces() uint64 {
	return (uint64(c.opts.DescCapacity)*descSize - tmplBlockSize) / tmplPieceSize
}

// NewTemplate checks pieces and encodes them for dir (H2D or D2H): pieces
// longer than a chunk (Options.ChunkBytes) become several, as Submit2D
// cuts segments. Errors: ErrUnavailable when this Copier has no template
// launch for dir (see Capabilities.Template; the caller copies the
// expanded segments instead), ErrInvalidSegment for an empty template, a
// piece of no bytes, pitches smaller than its rows, sizes that overflow,
// or more encoded pieces than a descriptor table holds beside one block,
// ErrMisaligned for an address, stride, offset, row or pitch that is not a
// multiple of 16. Nothing is allocated before the pieces are checked.
func (c *Copier) NewTemplate(dir Path, pieces []TemplatePiece) (*Template, error) {
	if _, err := c.tmplLaunch(dir); err != nil {
		return nil, err
	}
	if len(pieces) == 0 {
		return nil, fmt.Errorf("%w: a template of no pieces", ErrInvalidSegment)
	}
	t := &Template{c: c, dir: dir, maxID: ^uint64(0)}
	var n uint64
	for i := range pieces {
		p := &pieces[i]
		rows := max(p.Rows, 1)
		if p.RowLen == 0 {
			return nil, fmt.Errorf("%w: template piece %d has rows of 0 bytes", ErrInvalidSegment, i)
		}
		if rows > 1 && (p.DevPitch < p.RowLen || p.HostPitch < p.RowLen) {
			return nil, fmt.Errorf("%w: template piece %d: pitches dev %d, host %d smaller than its rows of %d bytes", ErrInvalidSegment, i, p.DevPitch, p.HostPitch, p.RowLen)
		}
		acc := p.Dev | p.DevStride | p.HostOff | p.RowLen
		if rows > 1 {
			acc |= p.DevPitch | p.HostPitch
		}
		if acc%kernelAlign != 0 {
			return nil, fmt.Errorf("%w: template piece %d (dev %#x, stride %d, host offset %d, %d rows of %d bytes, pitches %d, %d) is not %d-byte aligned",
				ErrMisaligned, i, p.Dev, p.DevStride, p.HostOff, rows, p.RowLen, p.DevPitch, p.HostPitch, kernelAlign)
		}
		hostN, ok1 := extent(rows, p.RowLen, p.HostPitch)
		devN, ok2 := extent(rows, p.RowLen, p.DevPitch)
		hostEnd, c1 := bits.Add64(p.HostOff, hostN, 0)
		devEnd, c2 := bits.Add64(p.Dev, devN, 0)
		hi, bytes := bits.Mul64(rows, p.RowLen)
		if !ok1 || !ok2 || c1 != 0 || c2 != 0 || hi != 0 || p.Dev == 0 {
			return nil, fmt.Errorf("%w: template piece %d (dev %#x, host offset %d, %d rows of %d bytes, pitches %d, %d) is nil or overflows 64 bits",
				ErrInvalidSegment, i, p.Dev, p.HostOff, rows, p.RowLen, p.DevPitch, p.HostPitch)
		}
		t.span = max(t.span, hostEnd)
		var c3 uint64
		if t.bytes, c3 = bits.Add64(t.bytes, bytes, 0); c3 != 0 {
			return nil, fmt.Errorf("%w: template pieces up to %d copy more than 2^64 bytes a block", ErrInvalidSegment, i)
		}
		t.rows += rows
		if p.DevStride > 0 {
			t.maxID = min(t.maxID, (^uint64(0)-devEnd)/p.DevStride)
		}
		if n += c.tmplCount(p); n > c.maxTemplatePieces() {
			return nil, fmt.Errorf("%w: template pieces up to %d encode as %d, more than the %d a descriptor table of %d descriptors holds beside a block",
				ErrInvalidSegment, i, n, c.maxTemplatePieces(), c.opts.DescCapacity)
		}
	}
	t.enc = make([]tmplPiece, 0, n)
	for i := range pieces {
		t.enc = c.encodePiece(t.enc, dir, &pieces[i])
	}
	return t, nil
}

// tmplUse2D reports whether piece p goes as 2-D descriptors (as
// chunker.use2D decides for a strided segment).
func (c *Copier) tmplUse2D(p *TemplatePiece) bool {
	ck := chunker{desc2d: true, chunk: uint64(c.opts.ChunkBytes)}
	s := Segment2D{Rows: p.Rows, RowLen: p.RowLen, SrcPitch: p.HostPitch, DstPitch: p.DevPitch}
	return ck.use2D(&s)
}

// tmplRowsPer is the rows one encoded 2-D piece of p takes.
func (c *Copier) tmplRowsPer(p *TemplatePiece) uint64 {
	ck := chunker{chunk: uint64(c.opts.ChunkBytes)}
	return ck.rowsPer(&Segment2D{Rows: p.Rows, RowLen: p.RowLen})
}

// tmplCount is how many encoded pieces p becomes.
func (c *Copier) tmplCount(p *TemplatePiece) uint64 {
	if c.tmplUse2D(p) {
		per := c.tmplRowsPer(p)
		return (p.Rows + per - 1) / per
	}
	return max(p.Rows, 1) * uint64(piecesOf(p.RowLen, uint64(c.opts.ChunkBytes)))
}

// encodePiece appends p's encoded pieces for dir.
func (c *Copier) encodePiece(out []tmplPiece, dir Path, p *TemplatePiece) []tmplPiece {
	if c.tmplUse2D(p) {
		per := c.tmplRowsPer(p)
		for r := uint64(0); r < p.Rows; r += per {
			k := min(p.Rows-r, per)
			e := tmplPiece{Dev: p.Dev + r*p.DevPitch, Stride: p.DevStride, HostOff: p.HostOff + r*p.HostPitch, Len: p.RowLen}
			if k > 1 {
				if dir == H2D {
					e.Aux = encodeDesc2D(k, p.HostPitch, p.DevPitch)
				} else {
					e.Aux = encodeDesc2D(k, p.DevPitch, p.HostPitch)
				}
			}
			out = append(out, e)
		}
		return out
	}
	chunk := uint64(c.opts.ChunkBytes)
	for r := range max(p.Rows, 1) {
		dev, host := p.Dev+r*p.DevPitch, p.HostOff+r*p.HostPitch
		for off := uint64(0); off < p.RowLen; {
			n := p.RowLen - off
			if chunk != 0 {
				n = min(n, chunk)
			}
			out = append(out, tmplPiece{Dev: dev + off, Stride: p.DevStride, HostOff: host + off, Len: n})
			off += n
		}
	}
	return out
}

// SubmitTemplate copies every block's pieces of t, in t's direction, on s
// with template launches: the template and as many blocks as one
// descriptor table holds per launch. Blocks are checked first (ErrInvalidSegment
// for a nil host address, one whose span wraps, or an id past the
// template's devices addresses; ErrMisaligned for a host address not a
// multiple of 16; ErrUnregisteredHost where host addresses need
// translating and a block's span is not in a registered range) and nothing
// is enqueued then; ErrInvalidOption for a template another Copier made.
// Tickets, retirement and errors after the checks are Submit's. It
// allocates nothing.
func (c *Copier) SubmitTemplate(s cuda.Stream, t *Template, blocks []TemplateBlock) (Ticket, error) {
	if t == nil || len(t.enc) == 0 {
		return Ticket{}, fmt.Errorf("%w: SubmitTemplate without a template (NewTemplate)", ErrInvalidOption)
	}
	if t.c != c {
		// Its encoding and its size follow another Copier's options: a
		// table of this one might not hold it beside a block.
		return Ticket{}, fmt.Errorf("%w: SubmitTemplate of a template another Copier made", ErrInvalidOption)
	}
	l, err := c.tmplLaunch(t.dir)
	if err != nil {
		return Ticket{}, err
	}
	if len(blocks) == 0 {
		return Ticket{}, fmt.Errorf("%w: empty batch", ErrInvalidSegment)
	}
	host := c.hostTableForKernel()
	hint := 0
	for i, b := range blocks {
		switch {
		case b.Host == 0 || b.Host+t.span < b.Host:
			return Ticket{}, fmt.Errorf("%w: template block %d: host %#x + %d is nil or wraps", ErrInvalidSegment, i, b.Host, t.span)
		case b.Host%kernelAlign != 0:
			return Ticket{}, fmt.Errorf("%w: template block %d: host %#x is not %d-byte aligned", ErrMisaligned, i, b.Host, kernelAlign)
		case b.ID > t.maxID:
			return Ticket{}, fmt.Errorf("%w: template block %d: id %d overflows its pieces' device addresses (at most %d)", ErrInvalidSegment, i, b.ID, t.maxID)
		}
		if host != nil {
			if _, ok := host.translateHint(b.Host, t.span, &hint); !ok {
				return Ticket{}, fmt.Errorf("%w: template block %d: %#x+%d", ErrUnregisteredHost, i, b.Host, t.span)
			}
		}
	}
	nt := len(t.enc)
	perLaunch := min((int(c.opts.DescCapacity)*descSize-nt*tmplPieceSize)/tmplBlockSize, int(uint64(1<<32-1)/uint64(nt)))
	nbuf := (len(blocks) + perLaunch - 1) / perLaunch
	side, err := c.sideUpload(s)
	if err != nil {
		return Ticket{}, err
	}
	events := 1
	if side {
		events += nbuf
	}
	tk, gr, err := c.acquire(need{bufs: nbuf, events: events})
	if err != nil {
		return Ticket{}, err
	}
	fenceIters, pace := c.tmplThrottle(l, t)
	warpsPerCTA := l.Threads / 32
	for i, buf := range gr.bufs {
		part := blocks[i*perLaunch : min(len(blocks), (i+1)*perLaunch)]
		n := writeTemplate(buf, t, part, host)
		var uploaded cuda.Event
		if side {
			uploaded = gr.events[1+i]
		}
		err := c.upload(s, buf, n, uploaded)
		if err == nil {
			items := nt * len(part)
			grid := uint32(min(l.CTAs, (items+warpsPerCTA-1)/warpsPerCTA))
			a := &buf.targs
			binary.LittleEndian.PutUint32(a[1], uint32(nt))
			binary.LittleEndian.PutUint32(a[2], uint32(len(part)))
			h2d := uint32(0)
			if t.dir == H2D {
				h2d = 1
			}
			binary.LittleEndian.PutUint32(a[3], h2d)
			args := a[:4]
			if t.dir == D2H { // kvo_copy_tmpl_probe
				binary.LittleEndian.PutUint64(a[4], fenceIters)
				binary.LittleEndian.PutUint64(a[5], paceNs(pace, min(int(grid)*warpsPerCTA, items)))
				args = a[:6]
			}
			if err = c.drv.LaunchKernel(l.fn, cuda.Dim3{X: grid, Y: 1, Z: 1}, cuda.Dim3{X: uint32(l.Threads), Y: 1, Z: 1}, 0, s, args...); err != nil {
				err = fmt.Errorf("cudacopy: launching a template of %d pieces over %d blocks on %d CTAs: %w", nt, len(part), grid, err)
			}
		}
		if err != nil {
			c.abandon(tk, i+1)
			return Ticket{}, err
		}
	}
	if err := c.drv.EventRecord(gr.events[0], s); err != nil {
		c.abandon(tk, len(gr.bufs))
		return Ticket{}, fmt.Errorf("cudacopy: recording a launch's completion event: %w", err)
	}
	c.setDone(tk, gr.events[0])
	return tk, nil
}

// tmplThrottle is a template launch's fence interval and pace: dir's, with
// the read-back every SmallSegmentFenceBytes where its rows are short, as
// Submit2D does.
func (c *Copier) tmplThrottle(l *launchFn, t *Template) (uint64, float64) {
	if t.dir != D2H {
		return 0, 0
	}
	fb := l.FenceBytes
	if c.opts.FenceBytes == 0 && fb < SmallSegmentFenceBytes && t.bytes/max(t.rows, 1) < SmallSegmentFenceBytes {
		fb = SmallSegmentFenceBytes
	}
	return uint64(fb / FenceUnit), l.PaceGBps
}

// writeTemplate writes t's pieces, then blocks (host addresses translated
// through host when it is not nil; SubmitTemplate has checked they are),
// into buf's staging table and returns the bytes written.
func writeTemplate(buf *descBuf, t *Template, blocks []TemplateBlock, host *hostTable) int {
	nt := len(t.enc)
	pieces := unsafe.Slice((*tmplPiece)(buf.host), nt)
	copy(pieces, t.enc)
	out := unsafe.Slice((*TemplateBlock)(unsafe.Add(buf.host, nt*tmplPieceSize)), len(blocks))
	copy(out, blocks)
	if host != nil {
		hint := 0
		for i := range out {
			out[i].Host, _ = host.translateHint(out[i].Host, t.span, &hint)
		}
	}
	return nt*tmplPieceSize + len(blocks)*tmplBlockSize
}

// sideUpload reports whether a launch on s uploads its tables on the
// upload stream: there is one, and s is not capturing a graph (a captured
// launch may not wait on uncaptured work in another stream).
func (c *Copier) sideUpload(s cuda.Stream) (bool, error) {
	if c.up == 0 {
		return false, nil
	}
	st, err := c.drv.StreamIsCapturing(s)
	if err != nil {
		return false, fmt.Errorf("cudacopy: checking the launch stream for a capture: %w", err)
	}
	return st == cuda.CaptureStatusNone, nil
}

// upload copies the first n bytes of b's staging table to its device
// table: on s itself, or, with an uploaded event, on the upload stream,
// s waiting for the event. (A table is reused only after its ticket's
// done event, recorded on s after the launch, has completed, so an upload
// on c.up never overwrites a table a launch still reads.)
func (c *Copier) upload(s cuda.Stream, b *descBuf, n int, uploaded cuda.Event) error {
	up := s
	if uploaded != 0 {
		up = c.up
	}
	if err := c.drv.MemcpyAsync(b.dev, cuda.DevicePtr(uintptr(b.host)), uint64(n), up); err != nil {
		return fmt.Errorf("cudacopy: uploading a descriptor table of %d bytes: %w", n, err)
	}
	if uploaded != 0 {
		if err := c.drv.EventRecord(uploaded, up); err != nil {
			return fmt.Errorf("cudacopy: recording a descriptor upload: %w", err)
		}
		if err := c.drv.StreamWaitEvent(s, uploaded, cuda.EventWaitDefault); err != nil {
			return fmt.Errorf("cudacopy: ordering a launch after its descriptor upload: %w", err)
		}
	}
	return nil
}

// errNoTemplate is what loadTemplates records when the image lacks them.
var errNoTemplate = errors.New("no template kernels")

// loadTemplates looks up the template kernels in the loaded module;
// Capabilities.Template says whether both were found.
func (c *Copier) loadTemplates() error {
	c.tmplH2D.Launch = Launch{CTAs: c.h2d.CTAs, Threads: c.h2d.Threads, Kernel: TemplateKernel}
	c.tmplD2H.Launch = Launch{CTAs: c.d2h.CTAs, Threads: c.d2h.Threads, Kernel: TemplateProbeKernel, FenceBytes: c.d2h.FenceBytes, PaceGBps: c.d2h.PaceGBps}
	var err1, err2 error
	c.tmplH2D.fn, err1 = c.drv.ModuleGetFunction(c.mod, TemplateKernel)
	c.tmplD2H.fn, err2 = c.drv.ModuleGetFunction(c.mod, TemplateProbeKernel)
	if err1 != nil || err2 != nil {
		return errNoTemplate
	}
	c.caps.Template = true
	return nil
}
