package transfer

// The Scheduler: its state, New, Close, range registration and the
// batch. Locks: Scheduler.mu (Close; stateErr's callers hold it), never
// with another lock held; the range sets' own locks (AddHostRange and the
// rest), each released before the device's AddHostRange or
// RemoveHostRange is called.

import (
	"errors"
	"fmt"
	"hash/maphash"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Errors callers branch on.
var (
	// ErrBusy: the direction's in-flight bound and queue are full (or, for
	// an op with events, the in-flight bound is). Never blocks; retry later.
	ErrBusy = errors.New("transfer: busy")
	// ErrClosed: the scheduler was closed.
	ErrClosed = errors.New("transfer: scheduler closed")
	// ErrReleased: the op was released; its events may already be reused.
	ErrReleased = errors.New("transfer: op released")
	// ErrCapturing: the caller's stream is capturing a graph, so its event
	// cannot order the engine's copies.
	ErrCapturing = errors.New("transfer: caller stream is capturing")
	// ErrDeviceLost: a sticky driver error; the scheduler refuses all work.
	// Returned errors wrap both this and the driver's error.
	ErrDeviceLost = errors.New("transfer: device lost")
)

// Scheduler queues requests, issues them in batches on a Device's two
// engine streams, and reports their completion. See the package doc.
type Scheduler struct {
	dev  Device
	cfg  Config
	host rangeSet
	devR rangeSet
	seed maphash.Seed

	mu        sync.Mutex
	queue     [2][]*Op // waiting for the in-flight bound
	immediate [2][]*Op // ops with events, bytes already in flight
	queued    [2]uint64
	inflight  [2]uint64
	batches   [2]int
	sticky    error
	closed    bool
	opEvents  []Event // pooled op events, free to record
	// lentEvents counts the op events held by ops (not in opEvents), so
	// that destroyEvents destroys them too; eventsGone: destroyEvents
	// ran, and events released later are dropped, not pooled.
	lentEvents map[Event]struct{}
	eventsGone bool
	batchEvs   []Event     // pooled batch events
	descs      [][]Segment // pooled descriptor buffers

	wake           chan struct{}
	prewake        chan struct{} // Prewake to the submitter
	announced      atomic.Int32  // Prewakes not yet PrewakeDone
	pending        [2]chan *batch
	done           sync.WaitGroup
	liveCompleters atomic.Int32

	// The issuer's buffers for lazy requests (submitting thread only): lone
	// for a part the submitting thread builds itself (an issue of a single
	// part, the feed's first, or one it steals); the feed's, two for each
	// of its builder goroutines, for several (issueLayers).
	lone     partBuf
	feed     partFeed  // the part builder (submitting thread only)
	partRefs []partRef // the parts it builds, in the order they are copied
	hooks    testHooks // set by tests only
}

// testHooks are the Scheduler's fields that only tests set, to hold its
// goroutines back.
type testHooks struct {
	// builderDelay holds each builder goroutine back before its
	// first part, as a slow wake of its thread does; builderGate, when
	// set, holds them until it is closed.
	builderDelay time.Duration
	builderGate  chan struct{}
}

type batch struct {
	dir     Direction
	ops     []*Op
	ev      Event
	retires []func()
	descs   []Segment
	hash    uint64
	// recorded: ev was recorded after the batch's copies, so the completer
	// awaits it before reporting.
	recorded bool
	err      error // the batch's failure, reported at completion
}

// New starts a scheduler over dev: one submitting goroutine and one
// completion goroutine per direction, each locked to its OS thread and
// initialised with dev.InitThread.
func New(dev Device, cfg Config) (*Scheduler, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	s := &Scheduler{
		dev:     dev,
		cfg:     cfg,
		host:    rangeSet{kind: "host"},
		devR:    rangeSet{kind: "device"},
		seed:    maphash.MakeSeed(),
		wake:    make(chan struct{}, 1),
		prewake: make(chan struct{}, 1),
	}
	for d := range s.pending {
		s.pending[d] = make(chan *batch, 4096)
	}
	threads := 3
	ready := make(chan error, threads)
	s.done.Add(threads)
	s.liveCompleters.Store(2)
	go s.submitter(ready)
	go s.completer(Load, ready)
	go s.completer(Store, ready)
	var err error
	for range threads {
		err = errors.Join(err, <-ready)
	}
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("transfer: starting engine threads: %w", err)
	}
	return s, nil
}

// hostRanger is implemented by devices whose copy method needs to know the
// registered host ranges (CUDA: the kernel's address translation).
type hostRanger interface {
	AddHostRange(base, size uint64) error
	RemoveHostRange(base uint64) error
}

// AddHostRange tells the scheduler (and the device's copy method) that
// [base, base+size) is registered host memory that segments may use. Over
// CUDA on a device that cannot use registered host pointers directly the
// copy method looks up the range's device pointer on the calling thread,
// which must then have the context current (as for the CUDA device's construction).
func (s *Scheduler) AddHostRange(base, size uint64) error {
	if err := s.host.add(base, size); err != nil {
		return err
	}
	if hr, ok := s.dev.(hostRanger); ok {
		if err := hr.AddHostRange(base, size); err != nil {
			return errors.Join(err, s.host.remove(base))
		}
	}
	return nil
}

// RemoveHostRange forgets the host range starting at base. Ops already
// submitted are unaffected; the caller must not unregister the memory before
// they complete.
func (s *Scheduler) RemoveHostRange(base uint64) error {
	if err := s.host.remove(base); err != nil {
		return err
	}
	if hr, ok := s.dev.(hostRanger); ok {
		return hr.RemoveHostRange(base)
	}
	return nil
}

// AddDeviceRange tells the scheduler that [base, base+size) is device memory
// (the serving stack's KV cache) that segments may use.
func (s *Scheduler) AddDeviceRange(base, size uint64) error { return s.devR.add(base, size) }

// RemoveDeviceRange forgets the device range starting at base.
func (s *Scheduler) RemoveDeviceRange(base uint64) error { return s.devR.remove(base) }

func (s *Scheduler) stateErr() error {
	if s.sticky != nil {
		return s.sticky
	}
	if s.closed {
		return ErrClosed
	}
	return nil
}

func (s *Scheduler) kick() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Close refuses new requests, lets everything submitted finish, stops the
// engine goroutines and destroys the scheduler's events. It does not close
// the Device.
func (s *Scheduler) Close() error {
	s.mu.Lock()
	already := s.closed
	s.closed = true
	s.mu.Unlock()
	if !already {
		s.kick()
	}
	s.done.Wait()
	return nil
}

// lockThread locks the calling goroutine to its OS thread for good and
// prepares the thread for driver calls.
func (s *Scheduler) lockThread() error {
	runtime.LockOSThread()
	return s.dev.InitThread()
}

// trace calls Config.Trace, when set, at point (see Trace).
func (s *Scheduler) trace(point string, part int) {
	if s.cfg.Trace != nil {
		s.cfg.Trace(point, part)
	}
}
