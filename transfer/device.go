package transfer

// Device is what the scheduler drives: two engine streams (one per
// Direction), events, and a copy method. The module's implementations are
// internal/cudadev's: CUDA (Context.NewCUDA, over the driver and
// internal/cudacopy) and Sim (the same over the fake driver, for machines
// without a GPU). A device may also copy templates, prepare copies ahead
// and learn host ranges (the optional interfaces templater, preparer and
// hostRanger, whose methods are exported so that a device of another
// package implements them).
//
// Threading: every method except IsCapturing is called only from the
// scheduler's engine goroutines, each locked to its OS thread, after
// InitThread has run on that thread; the copies only from the submitting
// thread, one issuer. Events are Event handles in both
// implementations; 0 is never a valid event.
type Device interface {
	// InitThread prepares the calling (locked) OS thread for driver calls:
	// the context current and stream capture mode relaxed.
	InitThread() error
	// Copy enqueues segs on dir's stream; part of the work may run on
	// another stream of the device's (CUDA's bounce streams), which waits
	// for what dir's stream waits for and which dir's stream joins before
	// the copy's completion, also when Copy fails after enqueueing some of
	// it. The returned retire func must be
	// called once, after an event recorded after the copy has completed (or
	// the stream is known idle), so the method's descriptor buffers can be
	// reused. On error nothing needs retiring. Copy keeps nothing of segs
	// once it returns: the caller may reuse them at once.
	Copy(dir Direction, segs []Segment) (retire func(), err error)
	// Record records e on dir's stream.
	Record(dir Direction, e Event) error
	// Wait makes dir's stream wait for the most recent record of e.
	Wait(dir Direction, e Event) error
	// SyncStream blocks until dir's stream is idle.
	SyncStream(dir Direction) error

	// CreateEvent creates an event (timing disabled); blockingSync selects
	// blocking synchronisation for Sync.
	CreateEvent(blockingSync bool) (Event, error)
	DestroyEvent(e Event) error
	// Query reports whether e's most recent record has completed.
	Query(e Event) (bool, error)
	// Sync blocks until e's most recent record has completed.
	Sync(e Event) error

	// IsCapturing reports whether a caller's stream is capturing a graph. It
	// is called on the caller's goroutine (see Request.AfterStream).
	IsCapturing(s Stream) (bool, error)
	// Close releases the streams and the copy method. The scheduler is
	// closed first.
	Close() error
}
