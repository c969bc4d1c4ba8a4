package transfer

// Request and its checks on the caller's goroutine (prepare, prepareLazy,
// checkAfter). Locks: validate's read locks on the range sets (host, then
// device), with no other lock held; not Scheduler.mu.

import "fmt"

// Request is one op: segments to copy in one direction, with its ordering.
type Request struct {
	Dir      Direction
	Segments []Segment
	// LayerEnds optionally groups Segments by layer: layer i is
	// Segments[LayerEnds[i-1]:LayerEnds[i]] (LayerEnds strictly increasing,
	// the last equal to len(Segments)). Copies are then issued layer by
	// layer, and with Events an event is recorded after each layer.
	LayerEnds []int
	// After (0: none) is a caller event, recorded on the caller's stream
	// after the work producing the source (for a store: the kernels writing
	// the blocks). The copies wait on its most recent record at the time
	// the submitting thread issues the op, which may be after Submit
	// returns: a caller that records After again before the op is done
	// makes the copies wait for that later record (never an earlier one).
	After Event
	// AfterStream, if set, is the stream After was recorded on: the request
	// is refused with ErrCapturing if it is capturing. Checked on the
	// caller's goroutine, whose thread must have the context current.
	AfterStream *Stream
	// Events asks for an op event (Op.Event) and, with LayerEnds, one per
	// layer (Op.LayerEvent). Such an op is issued by the submitting thread
	// in the order submitted, whatever the bytes in flight: its stream is
	// its queue. Submit returns before its copies are enqueued; Op.Event
	// and Op.LayerEvent wait on the host until the event asked for is
	// recorded (after the copies it follows are enqueued, not finished).
	Events bool
	// Signal (0: none) is a caller-owned event recorded on the engine stream
	// after the op's copies (for a graph's external event-wait node). Like
	// Events, the op is issued in order, whatever the bytes in flight;
	// Op.Event waits until the Signal is recorded too. Work that waits on
	// the Signal must be launched only once Op.Event has returned: until
	// then the Signal holds an earlier record.
	Signal Event
	// OnComplete, if set, is called once when the op completes or fails:
	// on a completion goroutine, or, for an op failed before its copies
	// ran, on the submitting thread. It must not block or take a lock a
	// Submit's caller may hold.
	OnComplete func(op *Op, err error)

	// Build, instead of Segments, produces the op's segments when the op
	// is issued, part by part: Build(p, dst) appends part p's segments to
	// dst (p from 0 to Parts-1, in order) and returns it. Each part is
	// validated and copied as soon as it is built, so the first part's
	// copies run while later parts are built; a part that fails to build
	// or validate fails the op (with the other ops of its batch), after
	// the copies already enqueued are known finished. Bytes is the total
	// length of every part's segments; the engine checks it. With Layered,
	// part l is layer l (as LayerEnds would declare it), or, with
	// LayerParts, layer l is LayerParts[l] parts in a row (each at least
	// 1, their sum Parts): a layer cut into parts starts copying once its
	// first part is built (a per-layer load's first layer, whose event the
	// caller waits for first). Build runs on the
	// submitting thread or on builder
	// goroutines (Config.Builders) ahead of it: it must make no driver
	// call and need no thread state (no CUDA context need be current
	// there), must not block or take a lock a Submit's caller may hold,
	// and must produce segments valid until the op completes. Calls
	// for different parts, of this request or another, may run at once
	// (one on each builder goroutine): Build must be safe for that. A part
	// is built once, and no Build runs after the op has completed.
	Build func(part int, dst []Segment) ([]Segment, error)
	// Template, with Build, gives the parts as blocks of one shape, which
	// a device that copies templates copies from it instead of Build's
	// segments (see Template); Build's segments remain the definition.
	Template   *Template
	Parts      int
	Layered    bool
	LayerParts []int
	Bytes      uint64
}

// layered reports whether the request declares layers (LayerEnds, or a
// lazy request's Layered): with Events, it gets an event per layer.
func (r *Request) layered() bool { return len(r.LayerEnds) > 0 || (r.lazy() && r.Layered) }

// lazy reports whether the request's segments come from Build.
func (r *Request) lazy() bool { return r.Build != nil }

func (s *Scheduler) prepare(req Request) (*Op, error) {
	if !req.Dir.valid() {
		return nil, fmt.Errorf("%w: direction %d", ErrInvalidRequest, int(req.Dir))
	}
	if req.lazy() {
		return s.prepareLazy(req)
	}
	if len(req.Segments) == 0 {
		return nil, fmt.Errorf("%w: %v with no segments", ErrInvalidRequest, req.Dir)
	}
	prev := 0
	for i, e := range req.LayerEnds {
		if e <= prev || e > len(req.Segments) {
			return nil, fmt.Errorf("%w: LayerEnds[%d] = %d, want > %d and ≤ %d segments", ErrInvalidRequest, i, e, prev, len(req.Segments))
		}
		prev = e
	}
	if len(req.LayerEnds) > 0 && prev != len(req.Segments) {
		return nil, fmt.Errorf("%w: LayerEnds ends at %d, want %d (every segment in a layer)", ErrInvalidRequest, prev, len(req.Segments))
	}
	if err := s.checkAfter(req); err != nil {
		return nil, err
	}
	segs, err := validate(req.Segments, s.cfg.Align, &s.host, &s.devR, make([]placed, 0, len(req.Segments)))
	if err != nil {
		return nil, err
	}
	op := &Op{s: s, dir: req.Dir, segs: segs, req: req, done: make(chan struct{})}
	op.req.Segments = nil
	op.layerEnds = append([]int(nil), req.LayerEnds...)
	if len(op.layerEnds) == 0 {
		op.layerEnds = []int{len(segs)}
	}
	for _, g := range segs {
		op.bytes += g.Len
	}
	op.waits = req.Events || req.Signal != 0
	op.rec.L = &op.mu
	return op, nil
}

// MaxLayers bounds the layers of a lazy request (Request.Layered).
const MaxLayers = 4096

// prepareLazy checks a request whose segments come from Build.
func (s *Scheduler) prepareLazy(req Request) (*Op, error) {
	switch {
	case len(req.Segments) > 0 || len(req.LayerEnds) > 0:
		return nil, fmt.Errorf("%w: %v: Build given with %d Segments and %d LayerEnds; give one or the other", ErrInvalidRequest, req.Dir, len(req.Segments), len(req.LayerEnds))
	case req.Parts < 1:
		return nil, fmt.Errorf("%w: %v: Build given with Parts = %d, want at least 1", ErrInvalidRequest, req.Dir, req.Parts)
	case req.Bytes == 0:
		return nil, fmt.Errorf("%w: %v: Build given with Bytes = 0", ErrInvalidRequest, req.Dir)
	case req.Layered && len(req.LayerParts) == 0 && req.Parts > MaxLayers:
		return nil, fmt.Errorf("%w: %v: %d layers, at most %d", ErrInvalidRequest, req.Dir, req.Parts, MaxLayers)
	case len(req.LayerParts) > 0 && !req.Layered:
		return nil, fmt.Errorf("%w: %v: LayerParts given without Layered", ErrInvalidRequest, req.Dir)
	case len(req.LayerParts) > MaxLayers:
		return nil, fmt.Errorf("%w: %v: %d layers, at most %d", ErrInvalidRequest, req.Dir, len(req.LayerParts), MaxLayers)
	}
	if err := s.checkAfter(req); err != nil {
		return nil, err
	}
	// A lazy op's layerEnds are in parts: layer l is parts
	// [layerEnds[l-1], layerEnds[l]) (partsOf).
	var ends []int
	switch {
	case len(req.LayerParts) > 0:
		ends = make([]int, len(req.LayerParts))
		sum := 0
		for l, n := range req.LayerParts {
			if n < 1 || n > req.Parts-sum {
				return nil, fmt.Errorf("%w: %v: LayerParts[%d] = %d: every layer needs at least one part, and they add up to Parts = %d", ErrInvalidRequest, req.Dir, l, n, req.Parts)
			}
			sum += n
			ends[l] = sum
		}
		if sum != req.Parts {
			return nil, fmt.Errorf("%w: %v: LayerParts add up to %d parts, want Parts = %d", ErrInvalidRequest, req.Dir, sum, req.Parts)
		}
	case req.Layered:
		ends = make([]int, req.Parts)
		for i := range ends {
			ends[i] = i + 1
		}
	default:
		ends = []int{req.Parts}
	}
	if req.Template != nil {
		if err := checkTemplate(&req); err != nil {
			return nil, err
		}
	}
	op := &Op{s: s, dir: req.Dir, req: req, bytes: req.Bytes, done: make(chan struct{}), layerEnds: ends}
	op.waits = req.Events || req.Signal != 0
	op.rec.L = &op.mu
	s.prepareTemplates(op)
	return op, nil
}

// checkAfter checks AfterStream (on the caller's goroutine).
func (s *Scheduler) checkAfter(req Request) error {
	if req.AfterStream != nil {
		if req.After == 0 {
			return fmt.Errorf("%w: AfterStream given without After", ErrInvalidRequest)
		}
		capturing, err := s.dev.IsCapturing(*req.AfterStream)
		if err != nil {
			return fmt.Errorf("transfer: checking the After stream %#x: %w", uintptr(*req.AfterStream), err)
		}
		if capturing {
			return fmt.Errorf("%w: After event %#x's stream %#x is capturing a graph; record it outside the capture", ErrCapturing, uintptr(req.After), uintptr(*req.AfterStream))
		}
	}
	return nil
}
