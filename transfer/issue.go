package transfer

// Queueing and issuing: Submit, the submitting goroutine, issue rounds, and
// the issue of a batch: its waits, its ops' copies layer by layer (lazy
// ops' parts), their events. Locks: Scheduler.mu to queue (Submit), to
// take a round (issueRoundDirs), to see whether to stop (submitter) and to
// give a batch event back (issue), never held across a driver call or with
// another lock; Op.mu to tell Event and LayerEvent waiters (recordLayer,
// signalIssued), with no other lock held.

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

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
// thread), taking them from f (the issue's feed, which builds them ahead in
// this order, but for its first, built here) or, without one, building them
// here. Each part's descriptors are appended to the batch's. A part that
// fails to build or copy fails the op.
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

// recordLayer records op's events that follow its layer l and tells
// those waiting for them (LayerEvent, and Event after the last layer).
func (s *Scheduler) recordLayer(op *Op, l int) error {
	if l >= len(op.layerEnds) {
		return nil
	}
	if err := s.recordLayerEvents(op, l); err != nil {
		return err
	}
	if l == 0 {
		s.trace("layer", 0)
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
