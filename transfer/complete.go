package transfer

// Completion: the completion goroutines, await, finish and sticky errors.
// Locks: Scheduler.mu, released before any op completes (Op.complete takes
// Op.mu) and never held across a driver call; the Tracker's lock (gens,
// violate) with no other lock held.

import (
	"errors"
	"fmt"
	"runtime"
	"time"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// setSticky records a sticky error: queued ops fail with it and every later
// Submit returns it. It returns the recorded error (the first one wins).
func (s *Scheduler) setSticky(err error) error {
	s.mu.Lock()
	if s.sticky != nil {
		defer s.mu.Unlock()
		return s.sticky
	}
	s.sticky = fmt.Errorf("%w: %w", ErrDeviceLost, err)
	var failed []*Op
	for d := range s.queue {
		failed = append(failed, s.queue[d]...)
		s.queue[d] = nil
		s.queued[d] = 0
	}
	sticky := s.sticky
	s.mu.Unlock()
	for _, op := range failed {
		op.complete(sticky)
	}
	s.kick()
	return sticky
}

// completer detects the completion of dir's batches in FIFO order.
func (s *Scheduler) completer(d Direction, ready chan<- error) {
	defer s.done.Done()
	defer runtime.UnlockOSThread()
	err := s.lockThread()
	ready <- err
	for b := range s.pending[d] {
		if err != nil {
			// The thread could not be initialised: New fails and nothing
			// is ever issued, but drain defensively.
			b.err = errors.Join(b.err, err)
			s.finish(b)
			continue
		}
		s.mu.Lock()
		sticky := s.sticky
		s.mu.Unlock()
		if sticky == nil && b.recorded {
			werr := s.await(b.ev)
			if werr != nil {
				werr = fmt.Errorf("transfer: %v batch event: %w", d, werr)
				if cuda.IsSticky(werr) {
					werr = s.setSticky(werr)
				} else {
					werr = errors.Join(werr, s.dev.SyncStream(d))
				}
				b.err = errors.Join(b.err, werr)
			}
		} else if sticky != nil {
			b.err = sticky
		}
		s.finish(b)
	}
	if s.liveCompleters.Add(-1) == 0 && err == nil {
		s.destroyEvents()
	}
}

// await waits for e by the configured method.
func (s *Scheduler) await(e Event) error {
	if s.cfg.Completion == CompletionBlocking {
		return s.dev.Sync(e)
	}
	start := time.Now()
	sleep := 5 * time.Microsecond
	for {
		done, err := s.dev.Query(e)
		if err != nil || done {
			return err
		}
		if time.Since(start) < s.cfg.PollSpin {
			continue
		}
		time.Sleep(sleep)
		sleep = min(2*sleep, s.cfg.PollMaxSleep)
	}
}

// finish retires a batch's descriptors and completes its ops.
func (s *Scheduler) finish(b *batch) {
	d := b.dir
	for _, r := range b.retires {
		r()
	}
	if invariantsEnabled {
		if b.recorded && b.err == nil && descHash(s.seed, b.descs) != b.hash {
			s.violate(fmt.Errorf("%w: %v batch descriptor buffer changed before its event retired", ErrInvariant, d))
		}
		for i := range b.descs {
			b.descs[i] = Segment{Dev: ^uint64(0), Host: ^uint64(0), Len: ^uint64(0)}
		}
		if s.cfg.Tracker != nil && b.err == nil {
			for _, op := range b.ops {
				s.cfg.Tracker.gens("at completion", d, op.segs, op.gens)
			}
		}
	}
	s.mu.Lock()
	for _, op := range b.ops {
		s.inflight[d] -= op.bytes
	}
	s.batches[d]--
	if b.ev != 0 {
		s.batchEvs = append(s.batchEvs, b.ev)
	}
	if b.descs != nil {
		s.descs = append(s.descs, b.descs)
	}
	s.mu.Unlock()
	for _, op := range b.ops {
		op.complete(b.err)
	}
	s.kick()
}

func (s *Scheduler) violate(err error) {
	if s.cfg.Tracker != nil {
		s.cfg.Tracker.violate(err)
		return
	}
	panic(err)
}
