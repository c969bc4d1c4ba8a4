package cudacopy

import (
	"errors"
	"fmt"
	"math"
)

// Segment is one contiguous copy of Len bytes from Src to Dst. Both are
// unified virtual addresses: device memory as cuMemAlloc returned it, host
// memory as its registered host pointer (the Copier translates host addresses
// for the kernel where the device needs it, see AddHostRange).
type Segment struct {
	Dst, Src, Len uint64
}

// Span is a contiguous range of memory read by Checksum.
type Span struct {
	Addr, Len uint64
}

// FillSegment is a range written by Fill with the pattern of FillPattern(Seed).
type FillSegment struct {
	Dst, Len, Seed uint64
}

// Path says which sides of a segment are host memory: the copier's word
// for what a transfer.Direction (Load, Store) becomes, plus D2D for tests.
type Path int

// Paths. The zero value is invalid so that a forgotten field is caught.
const (
	// D2H copies device memory to host memory (a store).
	D2H Path = iota + 1
	// H2D copies host memory to device memory (a load).
	H2D
	// D2D copies between two device addresses (tests and benchmarks).
	D2D
)

var directionNames = [...]string{D2H: "d2h", H2D: "h2d", D2D: "d2d"}

func (d Path) valid() bool { return d >= D2H && d <= D2D }

func (d Path) String() string {
	if d.valid() {
		return directionNames[d]
	}
	return fmt.Sprintf("Path(%d)", int(d))
}

// MarshalText writes the direction's name ("d2h", "h2d", "d2d").
func (d Path) MarshalText() ([]byte, error) {
	if !d.valid() {
		return nil, fmt.Errorf("%w: direction %d", ErrInvalidOption, int(d))
	}
	return []byte(d.String()), nil
}

// UnmarshalText parses a name written by MarshalText.
func (d *Path) UnmarshalText(b []byte) error {
	for i, n := range directionNames {
		if n != "" && n == string(b) {
			*d = Path(i)
			return nil
		}
	}
	return fmt.Errorf("%w: unknown direction %q (want d2h, h2d or d2d)", ErrInvalidOption, b)
}

// Method is how a batch of segments is copied.
type Method int

// Methods. MethodAuto lets Choose pick per batch.
const (
	// MethodAuto picks the method per batch from the calibration table.
	MethodAuto Method = iota
	// MethodMemcpy issues one cuMemcpyAsync per segment.
	MethodMemcpy
	// MethodBatch issues cuMemcpyBatchAsync calls (drivers ≥ 12.8).
	MethodBatch
	// MethodKernel uploads a descriptor table and launches kvo_copy.
	MethodKernel
)

var methodNames = [...]string{MethodAuto: "auto", MethodMemcpy: "memcpy", MethodBatch: "batch", MethodKernel: "kernel"}

func (m Method) valid() bool { return m >= MethodAuto && m <= MethodKernel }

func (m Method) String() string {
	if m.valid() {
		return methodNames[m]
	}
	return fmt.Sprintf("Method(%d)", int(m))
}

// MarshalText writes the method's name ("auto", "memcpy", "batch", "kernel").
func (m Method) MarshalText() ([]byte, error) {
	if !m.valid() {
		return nil, fmt.Errorf("%w: method %d", ErrInvalidOption, int(m))
	}
	return []byte(m.String()), nil
}

// UnmarshalText parses a name written by MarshalText.
func (m *Method) UnmarshalText(b []byte) error {
	p, err := ParseMethod(string(b))
	if err != nil {
		return err
	}
	*m = p
	return nil
}

// ParseMethod parses "auto", "memcpy", "batch" or "kernel".
func ParseMethod(s string) (Method, error) {
	for i, n := range methodNames {
		if n == s {
			return Method(i), nil
		}
	}
	return 0, fmt.Errorf("%w: unknown method %q (want auto, memcpy, batch or kernel)", ErrInvalidOption, s)
}

// Errors callers branch on. Returned errors wrap one of these (or a driver
// error) and name the bad value and the limit it broke.
var (
	// ErrInvalidSegment: an empty batch, a zero length, a nil address, or a
	// range that wraps around the address space.
	ErrInvalidSegment = errors.New("cudacopy: invalid segment")
	// ErrMisaligned: the kernel method (and Fill/Checksum) need aligned
	// addresses and lengths; Submit with MethodKernel forced refuses a
	// misaligned segment (MethodAuto picks a DMA method for such batches).
	ErrMisaligned = errors.New("cudacopy: misaligned segment")
	// ErrUnregisteredHost: the kernel needs a device pointer for a host
	// address outside every range given to AddHostRange (only on devices
	// without CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM).
	ErrUnregisteredHost = errors.New("cudacopy: host address not in a registered range")
	// ErrInvalidOption: an Options field, direction or method out of range.
	ErrInvalidOption = errors.New("cudacopy: invalid option")
	// ErrUnavailable: the requested method is not available here (no PTX
	// embedded, the module failed to load, or no cuMemcpyBatchAsync).
	ErrUnavailable = errors.New("cudacopy: method unavailable")
	// ErrStaleTicket: Retire of a ticket that is not outstanding.
	ErrStaleTicket = errors.New("cudacopy: ticket not outstanding")
	// ErrInFlight: Close while tickets are outstanding.
	ErrInFlight = errors.New("cudacopy: tickets outstanding")
	// ErrClosed: the Copier was closed.
	ErrClosed = errors.New("cudacopy: closed")
	// ErrDeviceBudget: a call needs more device memory (descriptor tables,
	// staging chunks, a calibration buffer) than Options.MaxDeviceBytes
	// can ever give it: more than the bound, or more than what retiring
	// every outstanding batch would free (memory withdrawn after driver
	// errors stays counted until Close). The error names the bytes needed
	// and the bound; split the batch and submit the pieces.
	ErrDeviceBudget = errors.New("cudacopy: over the device memory budget")
)

// kernelAlign is the alignment kvo_copy needs for its 16-byte accesses; the
// kernel has a byte-wise path for other segments, but it is far slower, so
// the Go side never sends it one.
const kernelAlign = 16

// wordAlign is the alignment kvo_fill and kvo_checksum need (8-byte words).
const wordAlign = 8

// validateSegments checks a batch before anything is enqueued. align > 1
// (a power of two) also requires Src, Dst and Len to be multiples of align;
// it is checked with a mask (a division per segment was 40% of this
// function's time).
func validateSegments(segs []Segment, align uint64) error {
	if len(segs) == 0 {
		return fmt.Errorf("%w: empty batch", ErrInvalidSegment)
	}
	if align == 0 || align&(align-1) != 0 {
		return fmt.Errorf("%w: alignment %d is not a power of two", ErrInvalidSegment, align)
	}
	mask := align - 1
	for i := range segs {
		s := &segs[i]
		if err := checkRange(i, "src", s.Src, s.Len); err != nil {
			return err
		}
		if err := checkRange(i, "dst", s.Dst, s.Len); err != nil {
			return err
		}
		if (s.Src|s.Dst|s.Len)&mask != 0 {
			return fmt.Errorf("%w: segment %d (src %#x, dst %#x, len %d) is not %d-byte aligned", ErrMisaligned, i, s.Src, s.Dst, s.Len, align)
		}
	}
	return nil
}

func checkRange(i int, side string, addr, n uint64) error {
	switch {
	case n == 0:
		return fmt.Errorf("%w: segment %d has zero length", ErrInvalidSegment, i)
	case addr == 0:
		return fmt.Errorf("%w: segment %d has a nil %s address", ErrInvalidSegment, i, side)
	case addr+n < addr:
		return fmt.Errorf("%w: segment %d %s range %#x+%d wraps the address space", ErrInvalidSegment, i, side, addr, n)
	}
	return nil
}

// segBytes is the total length of segs, saturating at the largest uint64.
func segBytes(segs []Segment) uint64 {
	var total uint64
	for _, s := range segs {
		if s.Len > math.MaxUint64-total {
			return math.MaxUint64
		}
		total += s.Len
	}
	return total
}

// aligned reports whether every segment is kernelAlign-aligned.
func aligned(segs []Segment) bool {
	var acc uint64
	for _, s := range segs {
		acc |= s.Src | s.Dst | s.Len
	}
	return acc%kernelAlign == 0
}
