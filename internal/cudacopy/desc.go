package cudacopy

import (
	"fmt"
	"sort"
)

// desc is one entry of a descriptor table, laid out as struct Desc in
// kernels.cu: 32 bytes, little-endian. One warp handles one desc. For the
// copy kernels Aux = 0 is a contiguous copy of Len bytes; Aux != 0 (only
// to a PTX image with Desc2DKernel) a 2-D copy of rows of Len bytes, see
// encodeDesc2D.
type desc struct {
	Src, Dst, Len, Aux uint64
}

// descSize is sizeof(struct Desc).
const descSize = 32

// jobKind says which kernel a descriptor table feeds.
type jobKind int

const (
	jobCopy     jobKind = iota // kvo_copy: Src → Dst
	jobFill                    // kvo_fill: Dst, Aux = seed of the chunk
	jobChecksum                // kvo_checksum: Src, one table entry per span
	jobCopy2D                  // kvo_copy and its kin: strided Src → Dst (Segment2D)
)

// chunker turns a batch into descriptors, splitting every item into pieces
// of at most chunk bytes (chunk = 0: no splitting), and translating host
// addresses through the host table. It writes into caller-provided tables so
// that building a batch allocates nothing. Piece boundaries fall at multiples
// of chunk from the item's start, so a chunk that is a multiple of 16 keeps
// each piece as aligned as its item.
type chunker struct {
	kind   jobKind
	copies []Segment
	fills  []FillSegment
	spans  []Span
	// copies2d: the strided segments of jobCopy2D; desc2d says whether the
	// kernel takes 2-D descriptors (else one descriptor per row).
	copies2d []Segment2D
	desc2d   bool
	chunk    uint64
	// host translates host addresses; nil means identity. For jobCopy only
	// the sides named by hostSrc/hostDst are host memory; for fills and
	// checksums every address found in the table is translated.
	host             *hostTable
	hostSrc, hostDst bool
	// fenceIters and paceGBps throttle kvo_copy_sys and kvo_copy_probe (D2H only).
	fenceIters uint64
	paceGBps   float64

	// pre: descriptors already encoded and translated (Prepare2D), sent
	// as they are; the fields above are then unused.
	pre []desc

	i    int    // current item
	off  uint64 // bytes of item i already emitted (jobCopy2D: of its current row)
	row  uint64 // jobCopy2D: item i's next row
	hint int    // index+1 of the host range that translated last (0: none)
}

func (c *chunker) items() int {
	switch c.kind {
	case jobCopy:
		return len(c.copies)
	case jobFill:
		return len(c.fills)
	case jobCopy2D:
		return len(c.copies2d)
	}
	return len(c.spans)
}

// item returns item i as (src, dst, len, aux).
func (c *chunker) item(i int) (src, dst, n, aux uint64) {
	switch c.kind {
	case jobCopy:
		s := c.copies[i]
		return s.Src, s.Dst, s.Len, 0
	case jobFill:
		f := c.fills[i]
		return 0, f.Dst, f.Len, f.Seed
	}
	s := c.spans[i]
	return s.Addr, 0, s.Len, 0
}

// done reports whether every item has been emitted.
func (c *chunker) done() bool {
	if c.pre != nil {
		return c.i >= len(c.pre)
	}
	return c.i >= c.items()
}

// count returns the number of descriptors the whole batch needs.
func (c *chunker) count() int {
	if c.pre != nil {
		return len(c.pre)
	}
	if c.kind == jobCopy2D {
		return c.count2D()
	}
	n := 0
	for i := range c.items() {
		_, _, l, _ := c.item(i)
		n += piecesOf(l, c.chunk)
	}
	return n
}

// piecesOf is the number of pieces of at most chunk bytes covering l bytes.
func piecesOf(l, chunk uint64) int {
	if chunk == 0 {
		return 1
	}
	return int((l + chunk - 1) / chunk)
}

// next writes up to len(out) descriptors and returns how many it wrote. The
// batch must have been checked with translateAll first: an address the host
// table cannot translate here is a programming error reported as
// ErrUnregisteredHost.
func (c *chunker) next(out []desc) (int, error) {
	if c.pre != nil {
		n := copy(out, c.pre[c.i:])
		c.i += n
		return n, nil
	}
	switch c.kind {
	case jobCopy:
		return c.nextCopy(out)
	case jobCopy2D:
		return c.next2D(out)
	}
	w := 0
	for w < len(out) && !c.done() {
		src, dst, l, aux := c.item(c.i)
		n := l - c.off
		if c.chunk != 0 && n > c.chunk {
			n = c.chunk
		}
		d := desc{Len: n}
		var err error
		if d.Src, err = c.translate(src, c.off, n, c.hostSrc); err != nil {
			return w, err
		}
		if d.Dst, err = c.translate(dst, c.off, n, c.hostDst); err != nil {
			return w, err
		}
		if c.kind == jobFill {
			d.Aux = aux + c.off/8
		}
		out[w] = d
		w++
		c.off += n
		if c.off == l {
			c.i++
			c.off = 0
		}
	}
	return w, nil
}

// nextCopy is next for jobCopy: the hot loop of Submit, one 32-byte store
// per descriptor, with the last host range tried before a search (scattered
// slots of one batch nearly always lie in the same range).
func (c *chunker) nextCopy(out []desc) (int, error) {
	w := 0
	for w < len(out) && c.i < len(c.copies) {
		s := &c.copies[c.i]
		n := s.Len - c.off
		if c.chunk != 0 && n > c.chunk {
			n = c.chunk
		}
		src, dst := s.Src+c.off, s.Dst+c.off
		if c.host != nil {
			var ok bool
			if c.hostSrc {
				if src, ok = c.host.translateHint(src, n, &c.hint); !ok {
					return w, fmt.Errorf("%w: %#x+%d", ErrUnregisteredHost, s.Src+c.off, n)
				}
			}
			if c.hostDst {
				if dst, ok = c.host.translateHint(dst, n, &c.hint); !ok {
					return w, fmt.Errorf("%w: %#x+%d", ErrUnregisteredHost, s.Dst+c.off, n)
				}
			}
		}
		out[w] = desc{Src: src, Dst: dst, Len: n}
		w++
		c.off += n
		if c.off == s.Len {
			c.i++
			c.off = 0
		}
	}
	return w, nil
}

// translate maps base+off (n bytes) to the address the kernel uses.
func (c *chunker) translate(base, off, n uint64, hostSide bool) (uint64, error) {
	if base == 0 {
		return 0, nil
	}
	a := base + off
	if c.host == nil {
		return a, nil
	}
	if c.kind == jobCopy && !hostSide {
		return a, nil
	}
	t, ok := c.host.translate(a, n)
	if ok {
		return t, nil
	}
	if c.kind == jobCopy {
		return 0, fmt.Errorf("%w: %#x+%d", ErrUnregisteredHost, a, n)
	}
	return a, nil
}

// translateAll checks that every host-side address of the batch translates,
// so that next cannot fail after something was enqueued.
func (c *chunker) translateAll() error {
	if c.pre != nil {
		return nil
	}
	if c.kind == jobCopy2D {
		return c.translateAll2D()
	}
	if c.host == nil || c.kind != jobCopy {
		return nil
	}
	hint := 0
	for i, s := range c.copies {
		if c.hostSrc {
			if _, ok := c.host.translateHint(s.Src, s.Len, &hint); !ok {
				return fmt.Errorf("%w: segment %d src %#x+%d", ErrUnregisteredHost, i, s.Src, s.Len)
			}
		}
		if c.hostDst {
			if _, ok := c.host.translateHint(s.Dst, s.Len, &hint); !ok {
				return fmt.Errorf("%w: segment %d dst %#x+%d", ErrUnregisteredHost, i, s.Dst, s.Len)
			}
		}
	}
	return nil
}

// hostRange is a registered host range and the device pointer of its base.
type hostRange struct {
	base, size, dev uint64
}

// hostTable is a sorted set of disjoint registered host ranges.
type hostTable struct {
	ranges []hostRange
}

func (t *hostTable) add(r hostRange) error {
	if r.size == 0 || r.base == 0 {
		return fmt.Errorf("%w: host range %#x+%d: nil base or zero size", ErrInvalidOption, r.base, r.size)
	}
	if r.base+r.size < r.base {
		return fmt.Errorf("%w: host range %#x+%d wraps the address space", ErrInvalidOption, r.base, r.size)
	}
	i := sort.Search(len(t.ranges), func(i int) bool { return t.ranges[i].base >= r.base })
	if i > 0 && t.ranges[i-1].base+t.ranges[i-1].size > r.base {
		p := t.ranges[i-1]
		return fmt.Errorf("%w: host range [%#x,%#x) overlaps [%#x,%#x)", ErrInvalidOption, r.base, r.base+r.size, p.base, p.base+p.size)
	}
	if i < len(t.ranges) && t.ranges[i].base < r.base+r.size {
		p := t.ranges[i]
		return fmt.Errorf("%w: host range [%#x,%#x) overlaps [%#x,%#x)", ErrInvalidOption, r.base, r.base+r.size, p.base, p.base+p.size)
	}
	t.ranges = append(t.ranges, hostRange{})
	copy(t.ranges[i+1:], t.ranges[i:])
	t.ranges[i] = r
	return nil
}

func (t *hostTable) remove(base uint64) error {
	i := sort.Search(len(t.ranges), func(i int) bool { return t.ranges[i].base >= base })
	if i == len(t.ranges) || t.ranges[i].base != base {
		return fmt.Errorf("%w: no host range starts at %#x", ErrInvalidOption, base)
	}
	t.ranges = append(t.ranges[:i], t.ranges[i+1:]...)
	return nil
}

// translateHint is translate trying range *hint-1 first; on a search it
// stores the index+1 of the range found in *hint.
func (t *hostTable) translateHint(addr, n uint64, hint *int) (uint64, bool) {
	if h := *hint - 1; h >= 0 && h < len(t.ranges) {
		r := &t.ranges[h]
		if off := addr - r.base; addr >= r.base && off < r.size && n <= r.size-off {
			return r.dev + off, true
		}
	}
	i, d, ok := t.find(addr, n)
	if ok {
		*hint = i + 1
	}
	return d, ok
}

// rangeOf is the index of the range holding [addr, addr+n), or -1.
func (t *hostTable) rangeOf(addr, n uint64) int {
	if i, _, ok := t.find(addr, n); ok {
		return i
	}
	return -1
}

// translate maps [addr, addr+n) inside one range to its device address.
func (t *hostTable) translate(addr, n uint64) (uint64, bool) {
	_, d, ok := t.find(addr, n)
	return d, ok
}

// find searches for the range holding [addr, addr+n): its index and the
// device address of addr.
func (t *hostTable) find(addr, n uint64) (int, uint64, bool) {
	i := sort.Search(len(t.ranges), func(i int) bool { return t.ranges[i].base > addr }) - 1
	if i < 0 {
		return 0, 0, false
	}
	r := t.ranges[i]
	off := addr - r.base
	if off >= r.size || n > r.size-off {
		return 0, 0, false
	}
	return i, r.dev + off, true
}
