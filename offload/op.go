package offload

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvoffload/kvoffload/transfer"
)

// Op is one asynchronous Store or Load, safe for concurrent use.
type Op struct {
	kind transfer.Direction
	eng  *Engine

	done     chan struct{}
	mu       sync.Mutex
	outcomes []Outcome
	err      error
	released atomic.Bool

	// completion is the engine-side handle for events and for the wait
	// Release does; nil for an op that never reached the transfer layer.
	completion completion
	// layers is the number of per-layer events (LayerEvent's range) of a
	// Load with PerLayer on a layer-separate or MLA layout; 0 otherwise.
	layers int
}

// completion is the part of an op that lives in the copy layer.
type completion interface {
	event() (uintptr, error)
	layerEvent(i int) (uintptr, bool, error)
	streamWait(stream uintptr) error
	release() error
}

// closedChan is returned by Done on a released op.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

func newOp(e *Engine, kind transfer.Direction, n int) *Op {
	return &Op{kind: kind, eng: e, done: make(chan struct{}), outcomes: make([]Outcome, n)}
}

// Kind is transfer.Store (device → host) or transfer.Load (host → device).
func (o *Op) Kind() transfer.Direction { return o.kind }

// Len is the number of blocks of the op.
func (o *Op) Len() int { return len(o.outcomes) }

// Done is closed when every block of the op has its final outcome.
func (o *Op) Done() <-chan struct{} {
	if o.released.Load() {
		return closedChan
	}
	return o.done
}

// Wait blocks until the op is done (then returns Err) or ctx ends.
func (o *Op) Wait(ctx context.Context) error {
	if o.released.Load() {
		return ErrReleased
	}
	select {
	case <-o.done:
		return o.Err()
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Err is the first failed block's error, nil if none (refusals are not).
func (o *Op) Err() error {
	if o.released.Load() {
		return ErrReleased
	}
	select {
	case <-o.done:
	default:
		return nil
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.err
}

// Outcomes returns the blocks' outcomes in key order, ErrNotDone before
// Done.
func (o *Op) Outcomes() ([]Outcome, error) {
	if o.released.Load() {
		return nil, ErrReleased
	}
	select {
	case <-o.done:
	default:
		return nil, fmt.Errorf("%w: %s of %d blocks still in flight", ErrNotDone, o.kind, len(o.outcomes))
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]Outcome(nil), o.outcomes...), nil
}

// Count returns how many blocks ended with outcome oc (0 before Done).
func (o *Op) count(oc Outcome) int {
	out, err := o.Outcomes()
	if err != nil {
		return 0
	}
	n := 0
	for _, x := range out {
		if x == oc {
			n++
		}
	}
	return n
}

// Event is a CUevent after the op's copies (or 0), valid until Release.
func (o *Op) Event() (uintptr, error) {
	if o.released.Load() {
		return 0, ErrReleased
	}
	if o.completion == nil {
		return 0, nil
	}
	return o.completion.event()
}

// LayerEvent is Event for layer i of a Load with LoadOptions.PerLayer.
func (o *Op) LayerEvent(i int) (uintptr, error) {
	if o.released.Load() {
		return 0, ErrReleased
	}
	if o.layers == 0 {
		return 0, fmt.Errorf("%w: layer %d: the %s op has no per-layer events (only a Load with PerLayer on a layer-separate or MLA layout has)", ErrInvalidArgument, i, o.kind)
	}
	if i < 0 || i >= o.layers {
		return 0, fmt.Errorf("%w: layer %d: outside the op's %d layers [0, %d)", ErrInvalidArgument, i, o.layers, o.layers)
	}
	if o.completion == nil {
		return 0, nil
	}
	ev, ok, err := o.completion.layerEvent(i)
	if !ok {
		return 0, fmt.Errorf("%w: layer %d: the op has no per-layer event for it", ErrInvalidArgument, i)
	}
	return ev, err
}

// StreamWait makes stream wait for the op's copies (host backend: the CPU).
func (o *Op) StreamWait(stream uintptr) error {
	if o.released.Load() {
		return ErrReleased
	}
	if o.completion == nil {
		return nil
	}
	return o.completion.streamWait(stream)
}

// Release gives the op's events back at once; the copies and outcomes go on.
func (o *Op) Release() error {
	if o.released.Swap(true) {
		return ErrReleased
	}
	if o.completion == nil {
		return nil
	}
	return o.completion.release()
}

// finish closes done once every outcome is set. It is called exactly once
// per op (by Engine.finishOp).
func (o *Op) finish() {
	close(o.done)
}

// setOutcome records block i's outcome (and err for OutcomeFailed) before
// the op is finished.
func (o *Op) setOutcome(i int, oc Outcome, err error) {
	o.mu.Lock()
	o.outcomes[i] = oc
	if err != nil && o.err == nil {
		o.err = err
	}
	o.mu.Unlock()
}
