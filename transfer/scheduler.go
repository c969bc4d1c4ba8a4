package transfer

import (
	"errors"
	"fmt"
	"hash/maphash"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffload/kvoffload/internal/cuda"
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

	// The issuer's buffers for lazy requests (submitting thread only): lone for an
	// issue of a single part, built here, and for a head's parts; the
	// feed's, two for each of its
	// builder goroutines, for several (issueLayers).
	lone     partBuf
	feed     partFeed  // the issue's part builder (submitting thread only)
	partRefs []partRef // the parts it builds, in the order they are copied
	// builderDelay (tests) holds each builder goroutine back before its
	// first part, as a slow wake of its thread does.
	builderDelay time.Duration
	// holdSubmitter (tests), when set, is received from by the
	// submitting thread each time it wakes, before it issues:
	// closing it lets the thread go on.
	holdSubmitter atomic.Pointer[chan struct{}]
}

// partBuf is one built and validated part of a lazy op: its segments as
// Build gave them, validated, coalesced into the descriptors to copy
// (descs) and, on a device that prepares copies (preparer), prepared.
type partBuf struct {
	op       *Op
	p        int
	segs     []Segment
	placed   []placed
	descs    []Segment
	prep     devPrep
	prepared bool
	err      error
	builder  int // the feed's builder that owns it
	// A template part (tmpl): its blocks and the bytes they copy.
	tmpl   bool
	blocks []Block
	tbytes uint64
}

// preparer is a Device that can do a Copy's host-side work ahead, on a
// builder goroutine (no driver call, safe at once with its other methods
// and other Prepare calls on other devPreps), so that the submitting
// thread only enqueues (CopyPrepared). Prepare's error is not the copy's:
// the part is then copied with Copy, which reports it.
type preparer interface {
	Prepare(dir Direction, segs []Segment, p *devPrep) error
	// CopyPrepared is Copy(dir, segs) for segs as Prepare saw them.
	CopyPrepared(dir Direction, segs []Segment, p *devPrep) (retire func(), err error)
}

// partRef names part p of a lazy op.
type partRef struct {
	op *Op
	p  int
}

// partFeed builds lazy ops' parts (a list of partRefs, in the order the
// issuer (the submitting thread, or a caller issuing its own op) copies
// them) on builder goroutines ahead of the issuer, which takes them in
// that order (next) and gives their buffers back (done). With more than
// one builder configured (Build may then run concurrently anyway), the
// first part the issuer builds itself (first), at once, while the builders start: waiting for
// a builder to wake and hand it over delayed the first copy. Builder j of
// n builds the rest's parts j, j+n, j+2n, …
// alternating between its two buffers, so one issue holds at most 2n
// parts' buffers whatever its ops, and the rest's part i is the next
// one builder i mod n hands over. Each part of the rest is claimed once
// (claimed), by its builder as it starts it or by the submitting thread
// when it needs the part before its builder has started it (with more
// than one builder configured, as for building the first part): the
// submitting thread then builds it itself (steal) instead of waiting for
// a builder goroutine still being woken (on the H200 machine the parts
// the builders built first came 0.3–0.5 ms after they were started,
// while the device ran dry), and the builder skips it. A builder stops
// after a part that fails (the submitting thread, taking parts in order,
// fails the op there), or at stop; all have exited once stop returns.
type partFeed struct {
	all      []feedBuilder // every builder made so far, each initialised
	builders []feedBuilder // this issue's: all[:n]
	parts    []partRef     // the rest: the parts the builders build
	claimed  []atomic.Bool // per part of the rest: someone builds it
	taken    int           // parts handed to the submitting thread
	first    partRef       // built by the submitting thread (firstDue: not yet)
	firstDue bool
	quit     chan struct{}
	exited   sync.WaitGroup
	running  bool
}

// feedBuilder is one builder goroutine's two buffers and their channels.
type feedBuilder struct {
	bufs        [2]partBuf
	free, ready chan *partBuf
}

// startFeed starts the scheduler's feed on parts (which it reads until
// stopFeed returns), with up to Config.Builders builders.
func (s *Scheduler) startFeed(parts []partRef) *partFeed {
	f := &s.feed
	f.firstDue = s.cfg.Builders > 1
	if f.firstDue {
		f.first = parts[0]
		parts = parts[1:]
	}
	n := min(s.cfg.Builders, len(parts))
	f.parts = parts
	if cap(f.claimed) < len(parts) {
		f.claimed = make([]atomic.Bool, len(parts))
	}
	f.claimed = f.claimed[:len(parts)]
	for i := range f.claimed {
		f.claimed[i].Store(false)
	}
	for len(f.all) < n {
		j := len(f.all)
		f.all = append(f.all, feedBuilder{free: make(chan *partBuf, 2), ready: make(chan *partBuf, 2)})
		f.all[j].bufs[0].builder, f.all[j].bufs[1].builder = j, j
	}
	f.builders = f.all[:n]
	f.quit, f.taken, f.running = make(chan struct{}), 0, true
	for j := range n {
		fb := &f.builders[j]
		for i := range fb.bufs {
			fb.free <- &fb.bufs[i]
		}
		f.exited.Add(1)
		go func() {
			defer f.exited.Done()
			if d := s.builderDelay; d > 0 {
				select {
				case <-time.After(d):
				case <-f.quit:
					return
				}
			}
			for i := j; i < len(parts); i += n {
				select { // stop first, even with a buffer free
				case <-f.quit:
					return
				default:
				}
				var pb *partBuf
				select {
				case pb = <-fb.free:
				case <-f.quit:
					return
				}
				if !f.claimed[i].CompareAndSwap(false, true) {
					fb.free <- pb // stolen; never blocks: as many places as buffers
					continue
				}
				s.buildPart(parts[i].op, parts[i].p, pb)
				fb.ready <- pb // never blocks: as many places as buffers
				if pb.err != nil {
					return
				}
			}
		}()
	}
	return f
}

// nextPart returns the feed's next part: built by the submitting thread
// itself into s.lone if no builder has started it (see partFeed), else
// its builder's once ready.
func (s *Scheduler) nextPart(f *partFeed) *partBuf {
	i := f.taken
	f.taken++
	// With one builder, Build never runs twice at once: no stealing.
	if s.cfg.Builders > 1 && f.claimed[i].CompareAndSwap(false, true) {
		s.buildPart(f.parts[i].op, f.parts[i].p, &s.lone)
		s.trace("built", f.parts[i].p)
		return &s.lone
	}
	return <-f.builders[i%len(f.builders)].ready
}

// stopFeed ends the feed: the builders build nothing more and have exited
// when it returns. Idempotent.
func (s *Scheduler) stopFeed(f *partFeed) {
	if !f.running {
		return
	}
	close(f.quit)
	f.exited.Wait()
	for i := range f.builders {
		fb := &f.builders[i]
		for len(fb.free) > 0 {
			<-fb.free
		}
		for len(fb.ready) > 0 {
			<-fb.ready
		}
		for j := range fb.bufs {
			fb.bufs[j].op = nil
		}
	}
	f.running = false
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
// which must then have the context current (as for Context.NewCUDA).
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

// Submit validates req and queues it, and returns without waiting for
// anything but the scheduler's lock: it makes no driver call, and the
// submitting thread issues the op (builds its parts, enqueues its copies,
// records its events). A request with Events or a Signal is taken in the
// order submitted, whatever the bytes in flight; one without waits for
// the in-flight bound, and beyond MaxQueuedBytes it gets ErrBusy. On
// error nothing was queued and no callback will run.
func (s *Scheduler) Submit(req Request) (*Op, error) {
	if req.lazy() {
		s.trace("submit", -1)
	}
	op, err := s.prepare(req)
	if err != nil {
		return nil, err
	}
	d := req.Dir
	s.mu.Lock()
	if err := s.stateErr(); err != nil {
		s.mu.Unlock()
		return nil, err
	}
	if op.waits {
		// An op with events is issued in its turn and never refused for
		// the bytes already in flight: the copy stream is its queue, and
		// refusing it would lose the blocks a swap or an eviction stores
		// (the caller would recompute them). Its bytes still count, so
		// plain ops queue behind it.
		s.inflight[d] += op.bytes
		s.immediate[d] = append(s.immediate[d], op)
		s.mu.Unlock()
		s.kick()
		return op, nil
	}
	if queued := s.queued[d]; queued > 0 && queued+op.bytes > s.cfg.MaxQueuedBytes {
		s.mu.Unlock()
		return nil, fmt.Errorf("%w: %v: %d bytes queued + %d exceeds the queue bound %d", ErrBusy, d, queued, op.bytes, s.cfg.MaxQueuedBytes)
	}
	s.queued[d] += op.bytes
	s.queue[d] = append(s.queue[d], op)
	s.mu.Unlock()
	s.kick()
	return op, nil
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

func (s *Scheduler) submitter(ready chan<- error) {
	defer s.done.Done()
	defer runtime.UnlockOSThread()
	err := s.lockThread()
	if err == nil {
		s.prewarmEvents()
	}
	ready <- err
	if err != nil {
		for d := range s.pending {
			close(s.pending[d])
		}
		return
	}
	for {
		s.awaitWake()
		if h := s.holdSubmitter.Load(); h != nil {
			<-*h
		}
		for s.issueRound() {
		}
		s.mu.Lock()
		// Also after a sticky error: the ops queued are taken (and failed
		// by issueRound) before the engine stops, so no op is left
		// without completion and no Event waits forever.
		stop := s.closed && !s.waitingLocked()
		s.mu.Unlock()
		if stop {
			break
		}
	}
	for d := range s.pending {
		close(s.pending[d])
	}
	// The completers finish the batches in flight; their events are
	// destroyed by the last completer to exit (see completer).
}

// copyLone builds part p of lazy op on the issuing thread, into s.lone,
// and copies it into b (submitting thread).
func (s *Scheduler) copyLone(b *batch, op *Op, p int) error {
	s.buildPart(op, p, &s.lone)
	s.trace("built", p)
	err := s.copyPart(b, op, &s.lone)
	s.lone.op = nil
	return err
}

// checkBuilt reports a lazy op whose parts, once its last layer l is
// copied, did not copy the bytes it declared.
func (op *Op) checkBuilt(l int) error {
	if l == len(op.layerEnds)-1 && op.built != op.bytes {
		return fmt.Errorf("%w: a %v's parts copy %d bytes, it declared %d", ErrInvalidRequest, op.dir, op.built, op.bytes)
	}
	return nil
}

// waitingLocked is waiting with s.mu held.
func (s *Scheduler) waitingLocked() bool {
	return len(s.queue[Load])+len(s.queue[Store])+len(s.immediate[Load])+len(s.immediate[Store]) > 0
}

// issueRound takes what may be issued now, loads first, and issues it. It
// reports whether anything was taken (submitting thread).
func (s *Scheduler) issueRound() bool { return s.issueRoundDirs(Load, Store) }

// issueRoundDirs is issueRound over dirs only, in that order.
func (s *Scheduler) issueRoundDirs(dirs ...Direction) bool {
	var take [2][]*Op
	s.mu.Lock()
	sticky := s.sticky
	for _, d := range dirs {
		take[d] = s.immediate[d]
		s.immediate[d] = nil
		for len(s.queue[d]) > 0 && s.batches[d] < s.cfg.MaxBatchesInFlight {
			op := s.queue[d][0]
			if s.inflight[d] > 0 && s.inflight[d]+op.bytes > s.cfg.MaxInFlightBytes {
				break
			}
			s.queue[d] = s.queue[d][1:]
			s.queued[d] -= op.bytes
			s.inflight[d] += op.bytes
			take[d] = append(take[d], op)
		}
		if len(take[d]) > 0 {
			s.batches[d]++
		}
	}
	s.mu.Unlock()
	any := false
	for _, d := range dirs {
		if len(take[d]) == 0 {
			continue
		}
		any = true
		b := &batch{dir: d, ops: take[d]}
		if sticky != nil {
			b.err = sticky
			ops := b.ops
			s.pending[d] <- b
			signalIssued(ops, sticky)
			continue
		}
		ops := b.ops
		signalIssued(ops, s.issue(b))
	}
	return any
}

// signalIssued tells the waiters of ops (Event, LayerEvent) that the
// submitting thread is done with them: err, when the batch failed, is why
// the events not yet recorded never will be.
func signalIssued(ops []*Op, err error) {
	for _, op := range ops {
		if !op.waits {
			continue
		}
		op.mu.Lock()
		op.issued = true
		if op.recorded < len(op.layerEnds) {
			op.issueErr = err
			if err == nil {
				op.issueErr = fmt.Errorf("transfer: the %v was issued without its events recorded", op.dir)
			}
		}
		op.mu.Unlock()
		op.rec.Broadcast()
	}
}

// issue enqueues one batch on its stream and hands it to the completer. A
// failure fails the whole batch; if copies were already enqueued, the
// failure is reported only once they are known finished (the batch event,
// or a stream synchronize), so no memory is reused under a running copy.
// It returns the failure (for the ops' Event waiters), nil when issued.
func (s *Scheduler) issue(b *batch) (failed error) {
	d := b.dir
	enqueued := false
	fail := func(err error) {
		failed = err
		if cuda.IsSticky(err) {
			err = s.setSticky(err)
		}
		b.err = err
		if !enqueued || cuda.IsSticky(err) {
			s.finish(b)
			return
		}
		if b.ev != 0 {
			if rerr := s.dev.Record(d, b.ev); rerr == nil {
				b.recorded = true
				s.pending[d] <- b
				return
			}
		}
		// Copies may still be running: wait for the stream before anyone
		// reuses their memory.
		b.err = errors.Join(err, s.dev.SyncStream(d))
		s.finish(b)
	}
	b.descs = s.descBuf()
	ev, err := s.batchEvent()
	if err != nil {
		fail(err)
		return failed
	}
	b.ev = ev
	s.trace("issue", -1)
	if invariantsEnabled && s.cfg.Tracker != nil {
		for _, op := range b.ops {
			if !op.req.lazy() {
				op.gens = s.cfg.Tracker.gens("at submission", d, op.segs, nil)
			}
		}
	}
	// The ops layer by layer, their copies coalesced after their waits:
	// a later op's After cannot depend on an earlier op of the batch
	// (nothing waits on an op's events before they are recorded, and
	// Event and LayerEvent return only then).
	shared := b.ops
	for _, op := range shared {
		if op.req.After != 0 {
			if err := s.dev.Wait(d, op.req.After); err != nil {
				fail(fmt.Errorf("transfer: waiting on the After event %#x: %w", uintptr(op.req.After), err))
				return failed
			}
		}
		if op.req.Events {
			if err := s.opEventsFor(op); err != nil {
				fail(err)
				return failed
			}
		}
	}
	enqueued = true
	s.trace("events", -1)
	if err := s.issueLayers(b, shared); err != nil {
		fail(err)
		return failed
	}
	if invariantsEnabled {
		b.hash = descHash(s.seed, b.descs)
	}
	if err := s.dev.Record(d, b.ev); err != nil {
		ev := b.ev
		b.ev = 0
		s.mu.Lock()
		s.batchEvs = append(s.batchEvs, ev)
		s.mu.Unlock()
		fail(fmt.Errorf("transfer: recording the %v batch event: %w", d, err))
		return failed
	}
	b.recorded = true
	s.trace("issued", -1)
	s.pending[d] <- b
	return nil
}

// issueLayers enqueues the copies of ops layer by layer (the given ops'
// segments of one layer coalesced into one Copy, lazy ops' parts built and
// copied), each op's layer events after its layer. A Copy that fails may
// have enqueued part of its work (a batch cut into several driver calls, a
// gathered store's first chunks): the caller fails the batch only once the
// stream is known past it.
func (s *Scheduler) issueLayers(b *batch, ops []*Op) error {
	d := b.dir
	layers := 0
	for _, op := range ops {
		layers = max(layers, len(op.layerEnds))
	}
	// The lazy ops' parts, in the order they are copied below: with two or
	// more, a feed builds them ahead while the ones before are copied.
	refs := s.partRefs[:0]
	for l := range layers {
		for _, op := range ops {
			if l < len(op.layerEnds) && op.req.lazy() {
				from, to := op.partsOf(l)
				for p := from; p < to; p++ {
					refs = append(refs, partRef{op, p})
				}
			}
		}
	}
	s.partRefs = refs[:0]
	var f *partFeed
	if len(refs) >= 2 {
		f = s.startFeed(refs)
		defer s.stopFeed(f)
		s.trace("fed", -1)
	}
	for l := range layers {
		start := len(b.descs)
		var last placed
		for _, op := range ops {
			if l < len(op.layerEnds) && !op.req.lazy() {
				lo := 0
				if l > 0 {
					lo = op.layerEnds[l-1]
				}
				b.descs = coalesce(b.descs, &last, op.segs[lo:op.layerEnds[l]])
			}
		}
		if len(b.descs) > start {
			retire, err := s.dev.Copy(d, b.descs[start:])
			if err != nil {
				return fmt.Errorf("transfer: %v copy of %d segments: %w", d, len(b.descs)-start, err)
			}
			b.retires = append(b.retires, retire)
		}
		for _, op := range ops {
			if l < len(op.layerEnds) && op.req.lazy() {
				if err := s.issueParts(b, op, l, f); err != nil {
					return err
				}
			}
			if err := s.recordLayer(op, l); err != nil {
				return err
			}
		}
	}
	return nil
}

// partsOf returns the parts of lazy op that make its layer l: part l of a
// layered op (the layer's LayerParts with them), all of them otherwise.
func (op *Op) partsOf(l int) (from, to int) {
	if l > 0 {
		from = op.layerEnds[l-1]
	}
	return from, op.layerEnds[l]
}

// issueParts copies the parts of lazy op that make its layer l (issuing
// thread), skipping those its head copied, taking them from f (the issue's feed, which builds them ahead
// in this order, but for its first, built here) or, without one, building
// them here. Each part's
// descriptors are appended to the batch's. A part that fails to build or
// copy fails the op.
func (s *Scheduler) issueParts(b *batch, op *Op, l int, f *partFeed) error {
	from, to := op.partsOf(l)
	for p := from; p < to; p++ {
		inline := f == nil
		if f != nil && f.firstDue {
			if f.first != (partRef{op, p}) {
				return fmt.Errorf("%w: the feed's first part is part %d of another op, want part %d of this %v", ErrInvalidRequest, f.first.p, p, op.dir)
			}
			f.firstDue, inline = false, true
		}
		if inline {
			if err := s.copyLone(b, op, p); err != nil {
				return err
			}
			continue
		}
		pb := s.nextPart(f)
		if pb.op != op || pb.p != p {
			return fmt.Errorf("%w: the part builder gave part %d of another op, want part %d of this %v", ErrInvalidRequest, pb.p, p, op.dir)
		}
		err := s.copyPart(b, op, pb)
		switch {
		case pb == &s.lone: // a part the submitting thread built (nextPart)
			pb.op = nil
		case err == nil: // back to its builder (after a failure the feed stops)
			f.builders[pb.builder].free <- pb
		}
		if err != nil {
			return err
		}
	}
	return op.checkBuilt(l)
}

// buildPart builds part p of lazy op into pb, validates it (pb.err says
// why it cannot be copied), coalesces it into its descriptors and, on a
// preparer, prepares their copy. Safe on another goroutine than the
// submitter's, and on several at once for different buffers: it touches
// only pb, op's Build, the range sets (under their read locks) and the
// device's Prepare.
func (s *Scheduler) buildPart(op *Op, p int, pb *partBuf) {
	pb.op, pb.p, pb.err, pb.prepared = op, p, nil, false
	pb.descs = pb.descs[:0]
	pb.tmpl, pb.tbytes = false, 0
	if op.tmpl != nil {
		pb.placed = pb.placed[:0]
		s.buildTemplatePart(op, p, pb)
		return
	}
	segs, err := op.req.Build(p, pb.segs[:0])
	if err != nil {
		pb.placed = pb.placed[:0]
		pb.err = fmt.Errorf("transfer: building part %d of %d of a %v: %w", p, op.req.Parts, op.dir, err)
		return
	}
	pb.segs = segs[:0]
	pb.placed, err = validate(segs, s.cfg.Align, &s.host, &s.devR, pb.placed[:0])
	if err != nil {
		pb.err = fmt.Errorf("transfer: part %d of %d of a %v: %w", p, op.req.Parts, op.dir, err)
		return
	}
	var last placed
	pb.descs = coalesce(pb.descs, &last, pb.placed)
	if pp, ok := s.dev.(preparer); ok && len(pb.descs) > 0 {
		pb.prepared = pp.Prepare(op.dir, pb.descs, &pb.prep) == nil
	}
}

// copyPart coalesces a built part's segments into the batch's descriptors
// and copies them (issuing thread: the submitting thread, or a caller
// issuing its op or its op's head).
func (s *Scheduler) copyPart(b *batch, op *Op, pb *partBuf) error {
	if pb.err != nil {
		return pb.err
	}
	if pb.tmpl {
		return s.copyTemplatePart(b, op, pb)
	}
	if len(pb.placed) == 0 {
		return nil
	}
	d := op.dir
	for _, g := range pb.placed {
		op.built += g.Len
	}
	if op.built > op.bytes {
		return fmt.Errorf("%w: a %v's parts copy more than the %d bytes it declared", ErrInvalidRequest, d, op.bytes)
	}
	if invariantsEnabled && s.cfg.Tracker != nil {
		op.gens = append(op.gens, s.cfg.Tracker.gens("at submission", d, pb.placed, nil)...)
		op.segs = append(op.segs, pb.placed...)
	}
	// Copy and CopyPrepared keep nothing of the descriptors once they
	// return (pb goes back to its builder after this); the batch keeps a
	// copy only for the invariant that checks them at completion.
	if invariantsEnabled {
		b.descs = append(b.descs, pb.descs...)
	}
	var retire func()
	var err error
	s.trace("copy", pb.p)
	if pb.prepared {
		retire, err = s.dev.(preparer).CopyPrepared(d, pb.descs, &pb.prep)
	} else {
		retire, err = s.dev.Copy(d, pb.descs)
	}
	s.trace("copied", pb.p)
	if err != nil {
		return fmt.Errorf("transfer: %v copy of part %d of %d (%d segments): %w", d, pb.p, op.req.Parts, len(pb.descs), err)
	}
	b.retires = append(b.retires, retire)
	return nil
}

// recordLayer records op's events that follow its layer l and tells
// those waiting for them (LayerEvent, and Event after the last layer).
func (s *Scheduler) recordLayer(op *Op, l int) error {
	if l >= len(op.layerEnds) {
		return nil
	}
	if err := s.recordLayerEvents(op, l); err != nil {
		return err
	}
	if op.waits {
		op.mu.Lock()
		op.recorded = l + 1
		op.mu.Unlock()
		op.rec.Broadcast()
	}
	return nil
}

// recordLayerEvents records op's events that follow its layer l.
func (s *Scheduler) recordLayerEvents(op *Op, l int) error {
	if op.layerEvs != nil {
		if err := s.dev.Record(op.dir, op.layerEvs[l]); err != nil {
			return fmt.Errorf("transfer: recording layer %d's event: %w", l, err)
		}
	}
	if l != len(op.layerEnds)-1 {
		return nil
	}
	if op.ev != 0 {
		if err := s.dev.Record(op.dir, op.ev); err != nil {
			return fmt.Errorf("transfer: recording the op event: %w", err)
		}
	}
	if op.req.Signal != 0 {
		if err := s.dev.Record(op.dir, op.req.Signal); err != nil {
			return fmt.Errorf("transfer: recording the caller's Signal event %#x: %w", uintptr(op.req.Signal), err)
		}
	}
	return nil
}

// trace calls Config.Trace, when set, at point (see Trace).
func (s *Scheduler) trace(point string, part int) {
	if s.cfg.Trace != nil {
		s.cfg.Trace(point, part)
	}
}
