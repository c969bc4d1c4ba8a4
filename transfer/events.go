package transfer

// The pools of op events, batch events and descriptor buffers, and their
// destruction. Locks: Scheduler.mu, held only to take from or give to the
// pools (opEvents, lentEvents, eventsGone, batchEvs, descs), never across a
// driver call (CreateEvent, DestroyEvent) or with another lock.

import "fmt"

// prewarmBatchEvents is how many batch events the scheduler creates ahead
// when Config.PrewarmOpEvents asks for op events.
const prewarmBatchEvents = 4

// prewarmEvents fills the op and batch event pools
// (Config.PrewarmOpEvents), on the submitting thread before it serves.
// Best effort: a failure stops it, and the ops create what they lack as
// before.
func (s *Scheduler) prewarmEvents() {
	if s.cfg.PrewarmOpEvents <= 0 {
		return
	}
	var ops, batch []Event
	for range s.cfg.PrewarmOpEvents {
		e, err := s.dev.CreateEvent(false)
		if err != nil {
			break
		}
		ops = append(ops, e)
	}
	for range prewarmBatchEvents {
		e, err := s.dev.CreateEvent(s.cfg.Completion == CompletionBlocking)
		if err != nil {
			break
		}
		batch = append(batch, e)
	}
	s.mu.Lock()
	s.opEvents = append(s.opEvents, ops...)
	s.batchEvs = append(s.batchEvs, batch...)
	s.mu.Unlock()
}

func (s *Scheduler) batchEvent() (Event, error) {
	s.mu.Lock()
	if n := len(s.batchEvs); n > 0 {
		e := s.batchEvs[n-1]
		s.batchEvs = s.batchEvs[:n-1]
		s.mu.Unlock()
		return e, nil
	}
	s.mu.Unlock()
	e, err := s.dev.CreateEvent(s.cfg.Completion == CompletionBlocking)
	if err != nil {
		return 0, fmt.Errorf("transfer: creating a batch event: %w", err)
	}
	return e, nil
}

// opEventsFor gives op its pooled events (the submitting thread).
func (s *Scheduler) opEventsFor(op *Op) error {
	if !op.req.Events {
		return nil
	}
	n := 1
	if op.req.layered() {
		n += len(op.layerEnds)
	}
	evs := make([]Event, 0, n)
	s.mu.Lock()
	for len(evs) < n && len(s.opEvents) > 0 {
		evs = append(evs, s.opEvents[len(s.opEvents)-1])
		s.opEvents = s.opEvents[:len(s.opEvents)-1]
	}
	s.mu.Unlock()
	for len(evs) < n {
		e, err := s.dev.CreateEvent(false)
		if err != nil {
			s.putOpEvents(evs)
			return fmt.Errorf("transfer: creating an op event: %w", err)
		}
		evs = append(evs, e)
	}
	s.mu.Lock()
	if s.lentEvents == nil {
		s.lentEvents = map[Event]struct{}{}
	}
	for _, e := range evs {
		s.lentEvents[e] = struct{}{}
	}
	s.mu.Unlock()
	op.ev = evs[0]
	if n > 1 {
		op.layerEvs = evs[1:]
	}
	return nil
}

// putOpEvents returns op events to the pool; after destroyEvents (which
// destroyed them with the rest) it only forgets them.
func (s *Scheduler) putOpEvents(evs []Event) {
	s.mu.Lock()
	for _, e := range evs {
		delete(s.lentEvents, e)
	}
	if !s.eventsGone {
		s.opEvents = append(s.opEvents, evs...)
	}
	s.mu.Unlock()
}

func (s *Scheduler) descBuf() []Segment {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := len(s.descs); n > 0 {
		b := s.descs[n-1]
		s.descs = s.descs[:n-1]
		return b[:0]
	}
	return nil
}

// destroyEvents destroys the pooled events; the last completer to exit
// calls it, on its engine thread. Events of ops not yet released are
// destroyed too: after Close they must not be used.
func (s *Scheduler) destroyEvents() {
	s.mu.Lock()
	evs := append(s.batchEvs, s.opEvents...)
	for e := range s.lentEvents {
		evs = append(evs, e)
	}
	s.batchEvs, s.opEvents, s.lentEvents, s.eventsGone = nil, nil, nil, true
	s.mu.Unlock()
	for _, e := range evs {
		_ = s.dev.DestroyEvent(e)
	}
}
