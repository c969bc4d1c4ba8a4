package transfer

// Prewake and the submitting thread's wait for work (awaitWake, spinFor).
// No lock: Prewakes are counted in an atomic (announced), the wake-ups are
// channels (wake, prewake).

import (
	"sync/atomic"
	"time"
)

// Prewake tells the engine's threads that a request is about to be
// submitted: they wake now, while the caller still prepares it, and poll
// for it for up to Config.PrewakeSpin, so that its Submit does not wait
// for a sleeping thread to wake (see PrewakeSpin). Each Prewake is paired
// with one PrewakeDone once the caller has submitted or given up; the
// threads stop polling when no announced call is pending. Cheap, never
// blocks; safe for concurrent use.
func (s *Scheduler) Prewake() {
	if !s.prewakes() {
		return
	}
	s.announced.Add(1)
	select {
	case s.prewake <- struct{}{}:
	default:
	}
}

// PrewakeDone ends what one Prewake announced (see Prewake).
func (s *Scheduler) PrewakeDone() {
	if s.prewakes() {
		s.announced.Add(-1)
	}
}

// prewakes reports whether Prewake wakes the submitting thread: not
// without a PrewakeSpin.
func (s *Scheduler) prewakes() bool {
	return s.cfg.PrewakeSpin > 0
}

// awaitWake waits for kick; woken by Prewake first, it polls for the kick
// for up to PrewakeSpin (while a call is announced) before it blocks again.
func (s *Scheduler) awaitWake() {
	for {
		select {
		case <-s.wake:
			return
		case <-s.prewake:
			if _, ok := spinFor(s.wake, s.cfg.PrewakeSpin, &s.announced); ok {
				return
			}
		}
	}
}

// spinFor polls ch for up to d, while *pending is positive, and reports
// what it received, if anything.
func spinFor[T any](ch <-chan T, d time.Duration, pending *atomic.Int32) (T, bool) {
	deadline := time.Now().Add(d)
	for i := 0; ; i++ {
		select {
		case v := <-ch:
			return v, true
		default:
		}
		if i%64 == 0 && (pending.Load() <= 0 || time.Now().After(deadline)) {
			var zero T
			return zero, false
		}
	}
}
