package transfer

// Config, its defaults and the Completion modes. No lock: New copies the
// Config into the Scheduler, which only reads it after.

import (
	"fmt"
	"runtime"
	"time"
)

// Completion selects how the completion goroutines detect finished batches.
type Completion int

const (
	// CompletionPoll queries each direction's oldest batch event in FIFO
	// order: spinning for Config.PollSpin, then sleeping with doubling
	// back-off up to Config.PollMaxSleep. Idle directions block on a
	// channel and use no CPU.
	CompletionPoll Completion = iota
	// CompletionBlocking creates batch events with blocking sync and waits
	// on the oldest one (cuEventSynchronize), one thread per direction.
	CompletionBlocking
)

func (c Completion) String() string {
	switch c {
	case CompletionPoll:
		return "poll"
	case CompletionBlocking:
		return "blocking"
	}
	return fmt.Sprintf("Completion(%d)", int(c))
}

// Config bounds and tunes a Scheduler. Zero fields take the defaults.
type Config struct {
	// MaxInFlightBytes bounds the bytes submitted to each direction's stream
	// and not yet completed (default 256 MiB) by requests without events or
	// signal; a single larger request runs alone. Requests with events are
	// issued at once and never refused for it, but their bytes count.
	MaxInFlightBytes uint64
	// MaxQueuedBytes bounds the bytes waiting for the in-flight bound, per
	// direction (default 1 GiB); beyond it Submit returns ErrBusy.
	MaxQueuedBytes uint64
	// MaxBatchesInFlight bounds batches per direction (default 4); requests
	// queued meanwhile merge into the next batch.
	MaxBatchesInFlight int
	// Align is the alignment every segment's addresses and length must have
	// (default 1: none; set 16 when the kernel method is forced).
	Align uint64
	// Completion picks polling or blocking-sync completion detection.
	Completion Completion
	// PollSpin is how long the poller spins on a pending event before
	// sleeping (default 50µs); PollMaxSleep caps its back-off (default 200µs).
	PollSpin, PollMaxSleep time.Duration
	// Tracker, in invariant builds, has every copy's host ranges checked at
	// submission and completion (see Tracker).
	Tracker *Tracker
	// Builders is how many goroutines build a lazy op's parts (Build,
	// validation and, on CUDA, descriptor encoding) ahead of the
	// submitting thread, which then only enqueues them (default: a
	// quarter of GOMAXPROCS, 1 to 4; at most MaxBuilders).
	Builders int
	// Trace, when set, is called at points of a lazy op's life, with the
	// point's name: "submit" (Submit entered, on the caller's goroutine),
	// then on the submitting thread, with the device's context current:
	// "issue" (the thread took the op's batch), "events" (its events
	// taken), "fed" (builder goroutines started on its parts), "built" (a
	// part built on the issuing thread), "copy" and "copied" around each
	// part's Copy (with the part's number), "issued" (its copies all
	// enqueued). Calls may overlap (concurrent Submits): it must be safe
	// for concurrent use and return at once. Diagnostics: where the time
	// from a call to its first copy goes.
	Trace func(point string, part int)
	// PrewakeSpin is how long the engine's submitting thread, woken by
	// Prewake, polls for the request announced before it sleeps again.
	// Waking a sleeping thread took 45–350 µs on the H200 machine's VM,
	// in series with every call; a Prewake at the start of a call
	// overlaps it with the caller's own work. A polling thread holds
	// a P of the Go runtime: the default is DefaultPrewakeSpin where
	// GOMAXPROCS ≥ 8, else 0; negative or zero: Prewake does nothing.
	PrewakeSpin time.Duration
	// PrewarmOpEvents op events (and a few batch events) are created on
	// the submitting thread before New returns, so that the
	// first ops take theirs from the pools instead of creating them in
	// series with their copies (a first store of 128 8B-class blocks
	// created 26 events, counting the copier's). The engine asks for two
	// per-layer loads' worth (2 × (layers + 1)). 0: none.
	PrewarmOpEvents int
}

// DefaultPrewakeSpin is Config.PrewakeSpin's default where GOMAXPROCS is 8
// or more: the submitting thread polls from a call's Prewake until its
// request arrives or the call ends (PrewakeDone), at most this long. It
// covers the calls' own preparation: a Load of 2048 blocks reached Submit
// 0.5–0.9 ms after its Prewake on the H200 machine, and with 300 µs the
// thread had gone back to sleep by then (its wake then cost 0.1–1.4 ms
// before the first copy).
const DefaultPrewakeSpin = 2 * time.Millisecond

// MaxBuilders bounds Config.Builders.
const MaxBuilders = 16

func (c *Config) setDefaults() error {
	if c.MaxInFlightBytes == 0 {
		c.MaxInFlightBytes = 256 << 20
	}
	if c.MaxQueuedBytes == 0 {
		c.MaxQueuedBytes = 1 << 30
	}
	if c.MaxBatchesInFlight == 0 {
		c.MaxBatchesInFlight = 4
	}
	if c.Align == 0 {
		c.Align = 1
	}
	if c.PollSpin == 0 {
		c.PollSpin = 50 * time.Microsecond
	}
	if c.PollMaxSleep == 0 {
		c.PollMaxSleep = 200 * time.Microsecond
	}
	if c.Builders == 0 {
		c.Builders = min(4, max(1, runtime.GOMAXPROCS(0)/4))
	}
	if c.PrewakeSpin == 0 && runtime.GOMAXPROCS(0) >= 8 {
		c.PrewakeSpin = DefaultPrewakeSpin
	}
	switch {
	case c.MaxBatchesInFlight < 0:
		return fmt.Errorf("%w: MaxBatchesInFlight %d < 0", ErrInvalidRequest, c.MaxBatchesInFlight)
	case c.Align&(c.Align-1) != 0:
		return fmt.Errorf("%w: Align %d is not a power of two", ErrInvalidRequest, c.Align)
	case c.Completion != CompletionPoll && c.Completion != CompletionBlocking:
		return fmt.Errorf("%w: %v", ErrInvalidRequest, c.Completion)
	case c.PollSpin < 0 || c.PollMaxSleep < 0:
		return fmt.Errorf("%w: negative poll timing %v/%v", ErrInvalidRequest, c.PollSpin, c.PollMaxSleep)
	case c.Builders < 0 || c.Builders > MaxBuilders:
		return fmt.Errorf("%w: Builders %d outside [1, %d]", ErrInvalidRequest, c.Builders, MaxBuilders)
	}
	return nil
}
