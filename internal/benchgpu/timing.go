package benchgpu

// Timed runs: measure times one run between events on the bench's two
// streams (behind the gate, where there is one) and retires its tickets
// (tk); reps and repsN sum several up as a timing (best, median, submit
// cost), and holdFor sizes the gate from the warm-up's submit time. No
// locks.

import (
	"errors"
	"slices"
	"time"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
)

// run is one timed run: GPU time between the events, CPU time of enqueue,
// and whether the gate (if any) still held when enqueue returned.
type run struct {
	ms     float64
	submit time.Duration
	held   bool
	// sideMs is when each stream's work ended ([0] b.s[0], the D2H side;
	// [1] b.s[1], the H2D side), from the same start as ms.
	sideMs [2]float64
}

// measure times enqueue (which submits on b.s[0] and/or b.s[1]) between
// events that order both streams, and retires its tickets. With hold > 0
// (and a gate) both streams first wait behind a spin of that length, so the
// events time the GPU work alone; held reports whether the spin outlasted
// the CPU's enqueueing (else the time includes some of it).
func (b *bench) measure(enqueue func(tickets *[]tk) error, hold time.Duration) (run, error) {
	drv := b.drv
	gated := hold > 0 && b.gate != nil
	if gated {
		if err := b.gate.launch(drv, b.s[0], uint64(float64(hold.Nanoseconds())/1e6*b.gate.cyclesPerMs)); err != nil {
			return run{}, err
		}
	}
	if err := drv.EventRecord(b.ev[0], b.s[0]); err != nil {
		return run{}, err
	}
	if err := drv.StreamWaitEvent(b.s[1], b.ev[0], 0); err != nil {
		return run{}, err
	}
	var tickets []tk
	t0 := time.Now()
	err := enqueue(&tickets)
	r := run{submit: time.Since(t0)}
	if err == nil && gated {
		var started bool
		started, err = drv.EventQuery(b.ev[0])
		r.held = !started
	}
	if err == nil {
		err = errors.Join(drv.EventRecord(b.ev[3], b.s[0]), drv.EventRecord(b.ev[1], b.s[1]), drv.StreamWaitEvent(b.s[0], b.ev[1], 0), drv.EventRecord(b.ev[2], b.s[0]))
	}
	err = errors.Join(err, drv.StreamSynchronize(b.s[0]), drv.StreamSynchronize(b.s[1]))
	for _, t := range tickets {
		err = errors.Join(err, t.c.Retire(t.t))
	}
	if err != nil {
		return run{}, err
	}
	for i, e := range []cuda.Event{b.ev[3], b.ev[1], b.ev[2]} {
		ms, err := drv.EventElapsedTime(b.ev[0], e)
		if err != nil {
			return run{}, err
		}
		if i < 2 {
			r.sideMs[i] = float64(ms)
		} else {
			r.ms = float64(ms)
		}
	}
	return r, nil
}

type tk struct {
	c *cudacopy.Copier
	t cudacopy.Ticket
}

// timing summarises the timed runs of one point.
type timing struct {
	best, median float64       // ms
	bestSides    [2]float64    // the best run's sideMs
	submit       time.Duration // median CPU time of enqueue
	held         bool          // every run was gated and the gate held
	ungated      bool          // no gate ran: the submission exceeds maxGate/2 (or no kvo_fill)
}

// slowRunMs: a point whose warm-up took longer gets at most slowReps timed
// runs, which keeps the full benchmark within minutes (one memcpy per 4 KiB
// segment of 2 GiB takes over a second a run).
const (
	slowRunMs = 400
	slowReps  = 2
)

// holdFor is the gate for a submission that took submit on the CPU: twice
// that plus gateMargin, or 0 (ungated) beyond maxGate.
func holdFor(submit time.Duration) time.Duration {
	if h := 2*submit + gateMargin; h <= maxGate {
		return h
	}
	return 0
}

// reps runs one ungated warm-up and cfg.Reps timed runs (slowReps after a
// slow warm-up). With gated set, each timed run waits behind a gate of
// twice the warm-up's submit time plus gateMargin (none when that exceeds
// maxGate).
func (b *bench) reps(enqueue func(tickets *[]tk) error, gated bool) (timing, error) {
	return b.repsN(enqueue, gated, b.cfg.Reps)
}

// repsN is reps with n timed runs instead of cfg.Reps.
func (b *bench) repsN(enqueue func(tickets *[]tk) error, gated bool, n int) (timing, error) {
	warm, err := b.measure(enqueue, 0)
	if err != nil {
		return timing{}, err
	}
	if warm.ms > slowRunMs {
		n = min(n, slowReps)
	}
	var hold time.Duration
	if gated && b.gate != nil {
		hold = holdFor(warm.submit)
	}
	times := make([]float64, 0, n)
	subs := make([]time.Duration, 0, n)
	held := hold > 0
	ungated := hold == 0
	var sides [2]float64
	for range n {
		r, err := b.measure(enqueue, hold)
		if err != nil {
			return timing{}, err
		}
		if len(times) == 0 || r.ms < slices.Min(times) {
			sides = r.sideMs
		}
		times = append(times, r.ms)
		subs = append(subs, r.submit)
		held = held && r.held
	}
	slices.Sort(times)
	slices.Sort(subs)
	return timing{best: times[0], median: times[len(times)/2], bestSides: sides, submit: subs[len(subs)/2], held: held, ungated: ungated}, nil
}

func gbps(bytes uint64, ms float64) float64 { return float64(bytes) / (ms * 1e6) }
