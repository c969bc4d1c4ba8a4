package transfer

import "time"

// What the external tests (package transfer_test) reach of the
// scheduler's internals.

// SetBuilderHooks holds the builder goroutines back (testHooks): each for
// delay before its first part, and until gate is closed when not nil. Set
// it before the first Submit.
func (s *Scheduler) SetBuilderHooks(delay time.Duration, gate chan struct{}) {
	s.hooks.builderDelay, s.hooks.builderGate = delay, gate
}

// PrewakesOn reports whether the scheduler polls after a Prewake.
func (s *Scheduler) PrewakesOn() bool { return s.prewakes() }

// AnnouncedPrewakes is the count of announced calls pending (announced).
func (s *Scheduler) AnnouncedPrewakes() int32 { return s.announced.Load() }

// Counts returns dir's batches and bytes in flight and bytes queued, under
// Scheduler.mu.
func (s *Scheduler) Counts(dir Direction) (batches int, inflight, queued uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.batches[dir], s.inflight[dir], s.queued[dir]
}

// ClearViolations forgets the violations recorded so far.
func (t *Tracker) ClearViolations() {
	t.mu.Lock()
	t.violations = nil
	t.mu.Unlock()
}
