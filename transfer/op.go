package transfer

// The Op and its methods. Locks: Op.mu (and rec, its sync.Cond, which
// awaitLayer waits on), never with another lock held; recycle gives the
// events back through putOpEvents (Scheduler.mu) after Op.mu is released.

import (
	"fmt"
	"sync"
)

// Op is one submitted request. Its methods are safe for concurrent use.
// After Release every method returns ErrReleased.
type Op struct {
	s         *Scheduler
	dir       Direction
	bytes     uint64
	segs      []placed
	layerEnds []int
	req       Request
	// waits: the op has events or a Signal (it goes to s.immediate, and
	// Event and LayerEvent wait for its issue).
	waits bool

	ev       Event
	layerEvs []Event
	gens     []uint64

	done chan struct{}

	// built counts the bytes a lazy op's parts have produced.
	built uint64
	// tmpl: the op's templates as the device prepared them (one, or one
	// per layer), nil when its parts are copied from Build.
	tmpl []opTemplate

	mu        sync.Mutex
	err       error
	completed bool
	released  bool
	// Issue progress (under mu; rec waits on it): recorded is how many
	// layers have their events recorded; issued is set once the issuing
	// thread is done with the op, recorded or failed (issueErr: why its
	// remaining events were never recorded).
	rec      sync.Cond
	recorded int
	issued   bool
	issueErr error
}

// complete marks op done with err (nil: every copy completed) and runs its
// callback.
func (op *Op) complete(err error) {
	op.mu.Lock()
	op.err = err
	op.completed = true
	recycle := op.released
	op.mu.Unlock()
	close(op.done)
	if recycle {
		op.recycle()
	}
	if op.req.OnComplete != nil {
		op.req.OnComplete(op, err)
	}
}

func (op *Op) recycle() {
	var evs []Event
	if op.ev != 0 {
		evs = append(evs, op.ev)
	}
	evs = append(evs, op.layerEvs...)
	op.s.putOpEvents(evs)
}

// Dir is the op's direction.
func (op *Op) Dir() Direction { return op.dir }

// Bytes is the number of bytes the op copies.
func (op *Op) Bytes() uint64 { return op.bytes }

// Done is closed when the op has completed or failed.
func (op *Op) Done() <-chan struct{} { return op.done }

// Err is the op's outcome once Done is closed: nil if every copy completed,
// else the (driver's) error. Before Done it is nil.
func (op *Op) Err() error {
	op.mu.Lock()
	defer op.mu.Unlock()
	if op.released {
		return fmt.Errorf("%w: Err", ErrReleased)
	}
	return op.err
}

// Wait blocks until the op is done and returns Err. For tests and tools:
// the engine's own users wait on Done, the callback, or the op's events.
func (op *Op) Wait() error {
	<-op.done
	return op.Err()
}

// Event is the op's completion event, recorded on the engine stream
// after all of its copies: a caller's stream waits on it
// (cuStreamWaitEvent) to read loaded blocks or to overwrite stored ones.
// It blocks until the submitting thread has recorded it (the op's copies
// enqueued, not finished; Signal recorded too): a stream only ever waits
// on work already enqueued. An op submitted with a Signal and without
// Events returns its Signal once recorded: work that waits on the Signal
// (a graph's event-wait node) must be launched only after that. An op
// whose issue failed first returns that error. Valid until Release.
func (op *Op) Event() (Event, error) {
	if op.isReleased() {
		return 0, fmt.Errorf("%w: Event", ErrReleased)
	}
	if !op.req.Events && op.req.Signal == 0 {
		return 0, fmt.Errorf("%w: the op was submitted without Events or a Signal", ErrInvalidRequest)
	}
	return op.awaitLayer(len(op.layerEnds)-1, "Event", func() Event {
		if op.ev != 0 {
			return op.ev
		}
		return op.req.Signal
	})
}

// Layers is the number of layers the op declared (1 without LayerEnds).
func (op *Op) Layers() int { return len(op.layerEnds) }

// LayerEvent is the event recorded after layer l's copies (requests with
// LayerEnds, or Layered, and Events). Like Event it blocks until the event
// is recorded: until layer l's copies are enqueued, which the submitting
// thread does in layer order, so layer 0's event comes first. Valid until
// Release.
func (op *Op) LayerEvent(l int) (Event, error) {
	if op.isReleased() {
		return 0, fmt.Errorf("%w: LayerEvent(%d)", ErrReleased, l)
	}
	if !op.req.Events || !op.req.layered() {
		return 0, fmt.Errorf("%w: the op has no layer events (submit with LayerEnds and Events)", ErrInvalidRequest)
	}
	if l < 0 || l >= len(op.layerEnds) {
		return 0, fmt.Errorf("%w: layer %d outside [0, %d)", ErrInvalidRequest, l, len(op.layerEnds))
	}
	return op.awaitLayer(l, fmt.Sprintf("LayerEvent(%d)", l), func() Event { return op.layerEvs[l] })
}

func (op *Op) isReleased() bool {
	op.mu.Lock()
	defer op.mu.Unlock()
	return op.released
}

// awaitLayer waits until layer l's events are recorded (or the op's issue
// failed before) and returns ev() read then.
func (op *Op) awaitLayer(l int, what string, ev func() Event) (Event, error) {
	op.mu.Lock()
	defer op.mu.Unlock()
	for !op.released && op.recorded <= l && !op.issued {
		op.rec.Wait()
	}
	switch {
	case op.released:
		return 0, fmt.Errorf("%w: %s", ErrReleased, what)
	case op.recorded <= l:
		return 0, fmt.Errorf("transfer: %s: the %v failed before its event was recorded: %w", what, op.dir, op.issueErr)
	}
	return ev(), nil
}

// Release ends the caller's use of the op: its events return to the pool
// (once the op has completed) and every later method call on it returns
// ErrReleased. The caller must not wait on its events afterwards.
func (op *Op) Release() error {
	op.mu.Lock()
	if op.released {
		op.mu.Unlock()
		return fmt.Errorf("%w: Release twice", ErrReleased)
	}
	op.released = true
	recycle := op.completed
	op.mu.Unlock()
	op.rec.Broadcast() // an Event waiter returns ErrReleased
	if recycle {
		op.recycle()
	}
	return nil
}
