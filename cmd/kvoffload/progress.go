package main

import (
	"io"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
)

// stepDelay is how long a step runs before its spinner shows: steps that
// end sooner print nothing. A variable for the tests.
var stepDelay = 2 * time.Second

// stepProgress is a spinner with the step's description and the time it
// has run, for a step whose length is not known in advance (the engine's
// start, a benchmark pass). It shows on w, a terminal's stderr, only once
// the step has run for stepDelay; with a nil w (not a terminal, or --json)
// it does nothing. The serving loop of the demo has a bar of its own
// (demoBar), which knows how far the run is.
type stepProgress struct {
	stop chan struct{}
	done chan struct{}
	once sync.Once
}

// startStep starts desc's spinner (nil w: none). Call end when the step
// ends, before anything else is written to w.
func startStep(w io.Writer, desc string) *stepProgress {
	s := &stepProgress{stop: make(chan struct{}), done: make(chan struct{})}
	if w == nil {
		close(s.done)
		return s
	}
	go s.run(w, desc)
	return s
}

func (s *stepProgress) run(w io.Writer, desc string) {
	defer close(s.done)
	delay := time.NewTimer(stepDelay)
	defer delay.Stop()
	select {
	case <-s.stop:
		return
	case <-delay.C:
	}
	bar := progressbar.NewOptions(-1, progressbar.OptionSetWriter(w), progressbar.OptionSetDescription(desc),
		progressbar.OptionSpinnerType(14), progressbar.OptionSetElapsedTime(true),
		progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionClearOnFinish())
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	_ = bar.Add(1)
	for {
		select {
		case <-s.stop:
			_ = bar.Finish()
			return
		case <-tick.C:
			_ = bar.Add(1)
		}
	}
}

// end stops the spinner and clears its line; it returns once nothing more
// will be written. Safe to call more than once.
func (s *stepProgress) end() {
	s.once.Do(func() { close(s.stop) })
	<-s.done
}
