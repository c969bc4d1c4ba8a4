package transfer

// A lazy op's parts: the part buffers, the partFeed and its builder
// goroutines, buildPart and copyPart. No mutex of its own: the feed belongs
// to the submitting thread, which hands part buffers to and from its
// builders over channels (free, ready; quit and exited to stop them), and
// claimed (atomic) settles who builds a part. buildPart takes the range
// sets' read locks (validate, checkBlocks) and copyPart the Tracker's, each
// with no other lock held; nothing here takes Scheduler.mu or Op.mu.

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// partBuf is one built and validated part of a lazy op: its segments as
// Build gave them, validated, coalesced into the descriptors to copy
// (descs) and, on a device that prepares copies (preparer), prepared.
type partBuf struct {
	op       *Op
	p        int
	segs     []Segment
	placed   []placed
	descs    []Segment
	prep     any
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
// and other Prepare calls on other parts' state), so that the submitting
// thread only enqueues (CopyPrepared); p is the part's, for the device to
// keep its prepared state in (nil at first, kept across the part's reuses).
// Prepare's error is not the copy's:
// the part is then copied with Copy, which reports it.
type preparer interface {
	Prepare(dir Direction, segs []Segment, p *any) error
	// CopyPrepared is Copy(dir, segs) for segs as Prepare saw them.
	CopyPrepared(dir Direction, segs []Segment, p *any) (retire func(), err error)
}

// partRef names part p of a lazy op.
type partRef struct {
	op *Op
	p  int
}

// partFeed builds lazy ops' parts (a list of partRefs, in the order the
// issuer (the submitting thread) copies them) on builder goroutines ahead of
// the issuer, which takes them in that order (next) and gives their buffers
// back (done). With more than one builder configured (Build may then run
// concurrently anyway), the first part the issuer builds itself (first), at
// once, while the builders start: waiting for a builder to wake and hand it
// over delayed the first copy. Builder j of n builds the rest's parts j,
// j+n, j+2n, … alternating between its two buffers, so one issue holds at
// most 2n parts' buffers whatever its ops, and the rest's part i is the next
// one builder i mod n hands over. Each part of the rest is claimed once
// (claimed), by its builder as it starts it or by the submitting thread when
// it needs the part before its builder has started it (with more than one
// builder configured, as for building the first part): the submitting thread
// then builds it itself (steal) instead of waiting for a builder goroutine
// still being woken (on the H200 machine the parts the builders built first
// came 0.3–0.5 ms after they were started, while the device ran dry), and
// the builder skips it. A builder stops after a part that fails (the
// submitting thread, taking parts in order, fails the op there), or at stop;
// all have exited once stop returns.
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
			if d := s.hooks.builderDelay; d > 0 {
				select {
				case <-time.After(d):
				case <-f.quit:
					return
				}
			}
			if g := s.hooks.builderGate; g != nil {
				select {
				case <-g:
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
// and copies them (the submitting thread).
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
