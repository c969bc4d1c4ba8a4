package transfer

import (
	"errors"
	"fmt"
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
		return "load(H2D)"
	case Store:
		return "store(D2H)"
	}
	return fmt.Sprintf("Direction(%d)", int(d))
}

func (d Direction) valid() bool { return d == Load || d == Store }

// Segment is one contiguous copy between device memory and a registered host
// range. Dev is a device (unified virtual) address, Host the registered host
// pointer. The direction comes from the request.
type Segment struct {
	Dev, Host, Len uint64
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

// find returns the id of the range holding all of [addr, addr+n), or 0.
func (rs *rangeSet) find(addr, n uint64) uint64 {
	i := sort.Search(len(rs.ranges), func(i int) bool { return rs.ranges[i].base > addr }) - 1
	if i < 0 {
		return 0
	}
	r := rs.ranges[i]
	if addr-r.base > r.size || n > r.size-(addr-r.base) {
		return 0
	}
	return r.id
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
	for i, s := range segs {
		if s.Len == 0 {
			return out, fmt.Errorf("%w: segment %d (dev %#x, host %#x) has zero length", ErrInvalidSegment, i, s.Dev, s.Host)
		}
		if s.Dev+s.Len < s.Dev || s.Host+s.Len < s.Host {
			return out, fmt.Errorf("%w: segment %d (dev %#x, host %#x, len %d) overflows the address space", ErrInvalidSegment, i, s.Dev, s.Host, s.Len)
		}
		if align > 1 && (s.Dev%align != 0 || s.Host%align != 0 || s.Len%align != 0) {
			return out, fmt.Errorf("%w: segment %d (dev %#x, host %#x, len %d) is not aligned to %d bytes", ErrInvalidSegment, i, s.Dev, s.Host, s.Len, align)
		}
		h := host.find(s.Host, s.Len)
		if h == 0 {
			return out, fmt.Errorf("%w: segment %d host [%#x,%#x) is not inside a registered host range", ErrOutOfRange, i, s.Host, s.Host+s.Len)
		}
		d := dev.find(s.Dev, s.Len)
		if d == 0 {
			return out, fmt.Errorf("%w: segment %d device [%#x,%#x) is not inside a known device allocation", ErrOutOfRange, i, s.Dev, s.Dev+s.Len)
		}
		out = append(out, placed{Segment: s, hostID: h, devID: d})
	}
	return out, nil
}

// coalesce appends segs to dst, joining each segment to the previous one when
// both sides continue contiguously inside the same ranges. It returns dst.
func coalesce(dst []Segment, last *placed, segs []placed) []Segment {
	for _, s := range segs {
		if len(dst) > 0 && last.hostID == s.hostID && last.devID == s.devID {
			p := &dst[len(dst)-1]
			if p.Dev+p.Len == s.Dev && p.Host+p.Len == s.Host {
				p.Len += s.Len
				continue
			}
		}
		dst = append(dst, s.Segment)
		*last = s
	}
	return dst
}
