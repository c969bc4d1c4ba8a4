package transfer

import (
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"sort"
	"sync"
)

// Direction says which way a request moves bytes.
type Direction int

// Directions. Load is listed first because loads are scheduled ahead of stores.
const (
	// Load copies host slots into device memory (H2D).
	Load Direction = iota
	// Store copies device memory into host slots (D2H).
	Store
)

func (d Direction) String() string {
	switch d {
	case Load:
		return "load"
	case Store:
		return "store"
	}
	return fmt.Sprintf("Direction(%d)", int(d))
}

func (d Direction) valid() bool { return d == Load || d == Store }

// Segment is one copy between device memory and a registered host range.
// Dev is a device (unified virtual) address, Host the registered host
// pointer. The direction comes from the request.
//
// Rows 0 or 1: a contiguous copy of Len bytes (RowLen and the pitches are
// ignored). Rows > 1: a strided (2-D) copy of Rows rows of RowLen bytes,
// row r at Dev + r×DevPitch and Host + r×HostPitch, with Len = Rows×RowLen
// (one KV head of a token-major block: its tokens at the stride of the
// rank's heads on the device, back to back in the host slot). Strided
// segments are never coalesced; the CUDA device copies them with the
// copier's Submit2D (internal/cudacopy).
type Segment struct {
	Dev, Host, Len uint64

	Rows, RowLen        uint64
	DevPitch, HostPitch uint64
}

// Strided reports whether s is a 2-D segment (Rows > 1).
func (s Segment) Strided() bool { return s.Rows > 1 }

// devExtent and hostExtent are the bytes each side of s spans: Len for a
// contiguous segment, (Rows-1)×pitch + RowLen for a strided one. validate
// has checked that they do not overflow.
// Pointer receivers: a Segment passed by value is copied through the
// stack with overlapping moves, which stalls the next read of it.
func (s *Segment) devExtent() uint64  { return s.extent(s.DevPitch) }
func (s *Segment) hostExtent() uint64 { return s.extent(s.HostPitch) }

func (s *Segment) extent(pitch uint64) uint64 {
	if s.Rows <= 1 {
		return s.Len
	}
	return (s.Rows-1)*pitch + s.RowLen
}

// Validation errors. Each returned error wraps one of these and names the
// segment, the bad value and the limit.
var (
	// ErrInvalidSegment: zero length, misaligned, or an address overflow.
	ErrInvalidSegment = errors.New("transfer: invalid segment")
	// ErrOutOfRange: a segment leaves every registered host range or device
	// allocation the scheduler was told about.
	ErrOutOfRange = errors.New("transfer: segment outside known memory")
	// ErrInvalidRequest: a malformed request (direction, layer bounds, events).
	ErrInvalidRequest = errors.New("transfer: invalid request")
)

// memRange is one registered host range or device allocation.
type memRange struct {
	id         uint64
	base, size uint64
}

// rangeSet is a set of disjoint address ranges, looked up by address.
type rangeSet struct {
	mu     sync.RWMutex
	kind   string
	next   uint64
	ranges []memRange // sorted by base
}

func (rs *rangeSet) add(base, size uint64) error {
	if size == 0 {
		return fmt.Errorf("%w: %s range at %#x has zero size", ErrInvalidRequest, rs.kind, base)
	}
	if base+size < base {
		return fmt.Errorf("%w: %s range %#x+%d overflows", ErrInvalidRequest, rs.kind, base, size)
	}
	rs.mu.Lock()
	defer rs.mu.Unlock()
	i := sort.Search(len(rs.ranges), func(i int) bool { return rs.ranges[i].base >= base })
	if i > 0 && rs.ranges[i-1].base+rs.ranges[i-1].size > base {
		p := rs.ranges[i-1]
		return fmt.Errorf("%w: %s range [%#x,%#x) overlaps [%#x,%#x)", ErrInvalidRequest, rs.kind, base, base+size, p.base, p.base+p.size)
	}
	if i < len(rs.ranges) && rs.ranges[i].base < base+size {
		n := rs.ranges[i]
		return fmt.Errorf("%w: %s range [%#x,%#x) overlaps [%#x,%#x)", ErrInvalidRequest, rs.kind, base, base+size, n.base, n.base+n.size)
	}
	rs.next++
	rs.ranges = append(rs.ranges, memRange{})
	copy(rs.ranges[i+1:], rs.ranges[i:])
	rs.ranges[i] = memRange{id: rs.next, base: base, size: size}
	return nil
}

func (rs *rangeSet) remove(base uint64) error {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	i := sort.Search(len(rs.ranges), func(i int) bool { return rs.ranges[i].base >= base })
	if i == len(rs.ranges) || rs.ranges[i].base != base {
		return fmt.Errorf("%w: no %s range starts at %#x", ErrInvalidRequest, rs.kind, base)
	}
	rs.ranges = append(rs.ranges[:i], rs.ranges[i+1:]...)
	return nil
}

// lookupNear returns the range holding all of [addr, addr+n) and its
// index. It first tries the ranges at hint and next to it
// (a request's segments walk a model's tensors, allocated one after the
// other: a layer-separate block's 2×layers segments each fall in the
// range after the previous one's; hint -1: none), then searches; the
// index is the next call's hint.
func (rs *rangeSet) lookupNear(addr, n uint64, hint int) (memRange, int, bool) {
	for _, i := range [3]int{hint + 1, hint - 1, hint} {
		if hint >= 0 && i >= 0 && i < len(rs.ranges) && rs.ranges[i].holds(addr, n) {
			return rs.ranges[i], i, true
		}
	}
	i := sort.Search(len(rs.ranges), func(i int) bool { return rs.ranges[i].base > addr }) - 1
	if i < 0 {
		return memRange{}, -1, false
	}
	r := rs.ranges[i]
	return r, i, r.holds(addr, n)
}

// holds reports whether [addr, addr+n) lies inside r.
func (r memRange) holds(addr, n uint64) bool {
	return r.size != 0 && addr >= r.base && addr-r.base <= r.size && n <= r.size-(addr-r.base)
}

// placed is a validated segment with the ids of the ranges holding it, so
// coalescing never joins segments across two registrations.
type placed struct {
	Segment
	hostID, devID uint64
}

// validate checks every segment of a request before anything is enqueued.
func validate(segs []Segment, align uint64, host, dev *rangeSet, out []placed) ([]placed, error) {
	host.mu.RLock()
	defer host.mu.RUnlock()
	dev.mu.RLock()
	defer dev.mu.RUnlock()
	// The ranges the previous segment fell in: a request's segments mostly
	// share them, so most segments skip both binary searches.
	var lastHost, lastDev memRange
	hostAt, devAt := -1, -1
	// Each placed is filled in place from segs (a Segment copied through a
	// local and appended by value stalled on store forwarding: more than
	// half of validate's time).
	n0 := len(out)
	out = slices.Grow(out, len(segs))[:n0+len(segs)]
	for i := range segs {
		s := &segs[i]
		if s.Len == 0 {
			return out[:n0+i], fmt.Errorf("%w: segment %d (dev %#x, host %#x) has zero length", ErrInvalidSegment, i, s.Dev, s.Host)
		}
		if s.Dev+s.Len < s.Dev || s.Host+s.Len < s.Host {
			return out[:n0+i], fmt.Errorf("%w: segment %d (dev %#x, host %#x, len %d) overflows the address space", ErrInvalidSegment, i, s.Dev, s.Host, s.Len)
		}
		if align > 1 && (s.Dev%align != 0 || s.Host%align != 0 || s.Len%align != 0) {
			return out[:n0+i], fmt.Errorf("%w: segment %d (dev %#x, host %#x, len %d) is not aligned to %d bytes", ErrInvalidSegment, i, s.Dev, s.Host, s.Len, align)
		}
		if s.Rows > 1 {
			if err := check2D(i, *s, align); err != nil {
				return out[:n0+i], err
			}
		}
		hn, dn := s.hostExtent(), s.devExtent()
		if !lastHost.holds(s.Host, hn) {
			var r memRange
			var ok bool
			r, hostAt, ok = host.lookupNear(s.Host, hn, hostAt)
			if !ok {
				return out[:n0+i], fmt.Errorf("%w: segment %d host [%#x,%#x) is not inside a registered host range", ErrOutOfRange, i, s.Host, s.Host+hn)
			}
			lastHost = r
		}
		if !lastDev.holds(s.Dev, dn) {
			var r memRange
			var ok bool
			r, devAt, ok = dev.lookupNear(s.Dev, dn, devAt)
			if !ok {
				return out[:n0+i], fmt.Errorf("%w: segment %d device [%#x,%#x) is not inside a known device allocation", ErrOutOfRange, i, s.Dev, s.Dev+dn)
			}
			lastDev = r
		}
		p := &out[n0+i]
		setSegment(&p.Segment, s)
		p.hostID, p.devID = lastHost.id, lastDev.id
	}
	return out, nil
}

// checkSpan checks that segment i's rows at pitch from addr (one side of
// it) end inside the 64-bit address space.
func checkSpan(i int, name string, addr, pitch uint64, s Segment) error {
	hi, lo := bits.Mul64(s.Rows-1, pitch)
	end, c1 := bits.Add64(lo, s.RowLen, 0)
	_, c2 := bits.Add64(addr, end, 0)
	if hi != 0 || c1 != 0 || c2 != 0 {
		return fmt.Errorf("%w: segment %d %s %#x: %d rows at pitch %d overflow the address space", ErrInvalidSegment, i, name, addr, s.Rows, pitch)
	}
	return nil
}

// check2D checks the strided fields of segment i (Rows > 1): Len is
// Rows × RowLen, each pitch holds a row (rows never overlap), both sides'
// extents fit in 64-bit addresses, and row length and pitches are aligned.
func check2D(i int, s Segment, align uint64) error {
	hi, n := bits.Mul64(s.Rows, s.RowLen)
	if s.RowLen == 0 || hi != 0 || n != s.Len {
		return fmt.Errorf("%w: segment %d: %d rows of %d bytes, want Len %d = rows × row length", ErrInvalidSegment, i, s.Rows, s.RowLen, s.Len)
	}
	if s.DevPitch < s.RowLen || s.HostPitch < s.RowLen {
		return fmt.Errorf("%w: segment %d: pitches dev %d, host %d smaller than its rows of %d bytes", ErrInvalidSegment, i, s.DevPitch, s.HostPitch, s.RowLen)
	}
	if err := checkSpan(i, "dev", s.Dev, s.DevPitch, s); err != nil {
		return err
	}
	if err := checkSpan(i, "host", s.Host, s.HostPitch, s); err != nil {
		return err
	}
	if align > 1 && (s.RowLen%align != 0 || s.DevPitch%align != 0 || s.HostPitch%align != 0) {
		return fmt.Errorf("%w: segment %d: row length %d or pitches dev %d, host %d not aligned to %d bytes", ErrInvalidSegment, i, s.RowLen, s.DevPitch, s.HostPitch, align)
	}
	return nil
}

// coalesce appends segs to dst, joining each segment to the previous one when
// both sides continue contiguously inside the same ranges. It returns dst.
// last carries the ranges (hostID, devID) of dst's last segment from one
// call to the next; its Segment is not kept.
func coalesce(dst []Segment, last *placed, segs []placed) []Segment {
	for i := range segs {
		s := &segs[i] // not a copy (see validate)
		if len(dst) > 0 && last.hostID == s.hostID && last.devID == s.devID && s.Rows <= 1 {
			p := &dst[len(dst)-1]
			if p.Rows <= 1 && p.Dev+p.Len == s.Dev && p.Host+p.Len == s.Host {
				p.Len += s.Len
				continue
			}
		}
		dst = append(dst, Segment{})
		setSegment(&dst[len(dst)-1], &s.Segment)
		last.hostID, last.devID = s.hostID, s.devID
	}
	return dst
}

// setSegment copies *s into *d field by field: a whole-struct copy goes
// through a stack temporary with overlapping moves, which stalls the next
// read of it on store forwarding.
func setSegment(d, s *Segment) {
	d.Dev, d.Host, d.Len = s.Dev, s.Host, s.Len
	d.Rows, d.RowLen, d.DevPitch, d.HostPitch = s.Rows, s.RowLen, s.DevPitch, s.HostPitch
}
