// Package transfer moves segments between device memory and registered host
// memory asynchronously: it owns the scheduling of the engine's two
// streams (loads at higher priority than stores), batches, events and
// completion. It knows segments and addresses, never keys; the owner of
// the slots (kvcache, composed by offload) changes slot state only when an
// op completes.
//
// A Scheduler runs over a Device, the public interface of this package:
// the module's are the CUDA device and its simulation over the fake
// driver (package internal/cudadev: CUDA, copying through
// internal/cudacopy, with a bounce stream per direction for gathered
// stores and scattered loads; Sim, with random, seeded copy delays, for
// machines without a GPU). The driver, its contexts, device memory and
// the copy method belong to internal/cudadev, not to this package, which
// imports neither it nor the copier. Events and streams are Event and
// Stream values, plain integers: the driver's CUevent and CUstream, or the
// Sim's. No exported name of this package is of an internal type.
//
// Life of a request: Submit validates every segment against the host and
// device ranges the scheduler was told about (AddHostRange, AddDeviceRange)
// before anything is enqueued (a request with Build has its segments
// built, validated and copied part by part when it is issued instead:
// when an issue holds several parts, Config.Builders builder goroutines
// build, validate, coalesce and, on a device that prepares copies (CUDA's
// strided ones), prepare the next parts while the issuing thread copies
// the current one; it takes the parts in copy order, and a part is built
// once), then queues it, kicks the submitting goroutine and returns
// without waiting for an engine thread: it never issues. The submitting
// goroutine alone issues: it takes queued requests, loads before stores
// (those with events or a Signal as they come, in the order submitted; the
// others within MaxInFlightBytes and MaxBatchesInFlight per direction),
// and issues them as one batch per direction, on its own thread, the
// device's context current there. A batch holds: waits on
// callers' After events, the copies (coalesced, layer by layer when a
// request declares layers, op and layer events recorded after each layer),
// then the batch event. Op.Event and Op.LayerEvent wait on the host until
// the submitting thread has recorded the event asked for (the copies it
// follows enqueued, not finished), or return the failure that kept it from
// being recorded. One completion goroutine per direction detects batch
// events in FIFO order (polling with back-off, or blocking sync) and
// completes the batch's ops.
//
// Invariants:
//   - Submit never waits for copies to finish to admit a request: beyond
//     the in-flight bound requests queue, beyond MaxQueuedBytes they get
//     ErrBusy. A request with events (or a signal) is never refused for
//     bytes in flight: it is issued in its turn, its stream is its queue.
//     Submit never waits for the submitting thread either: only that
//     thread waits where issuing must, for the copy method's device
//     memory bound to free a buffer (an event synchronize), or for a
//     stream after a failed enqueue.
//   - Nothing the engine enqueues waits on work a host thread has yet to
//     enqueue: Event and LayerEvent hand out only events already
//     recorded.
//   - An op completes without error only after an event recorded after all
//     of its copies has retired; a failed op is reported only once none of
//     its copies can still run (its batch event, or a stream synchronize,
//     or a sticky error that killed the context).
//   - Descriptor buffers (the batch's and the copy method's) are reused only
//     after their batch's event retired.
//   - Op events are pooled and reused only after the op is both completed
//     and released; a released Op returns ErrReleased.
//   - A sticky driver error fails everything in flight and queued, and every
//     later Submit returns it (wrapped with ErrDeviceLost).
//   - Every engine goroutine that calls the driver (the submitting one and
//     the completion ones) is locked to its OS thread with the context
//     current and stream capture mode relaxed, so a global-mode capture on
//     another thread is never invalidated by it.
//
// Locks, what each guards, and which may be taken while holding which:
//   - Scheduler.mu guards the queues (queue, immediate, queued), what is in
//     flight (inflight, batches), sticky and closed, and the pools of op
//     events (opEvents, lentEvents, eventsGone), batch events (batchEvs)
//     and descriptor buffers (descs). It is held for a few field updates
//     only: never across a driver call, a channel operation, a callback
//     or while taking another lock.
//   - Op.mu guards an op's outcome (err, completed, released) and its issue
//     progress (recorded, issued, issueErr); rec, a sync.Cond on it, wakes
//     Event and LayerEvent (awaitLayer) when the submitting thread has
//     recorded a layer (recordLayer) or is done with the op
//     (signalIssued), or the op is released. Nothing else is taken while
//     holding it: complete drops it before it closes done, gives the
//     events back (recycle, which takes Scheduler.mu) and runs OnComplete,
//     Release before it gives them back. No code holds Op.mu and
//     Scheduler.mu together, in either order: finish and setSticky release
//     Scheduler.mu before they complete ops (Op.complete). An op's events
//     (ev, layerEvs), set by the submitting thread before it records them,
//     are read by Event and LayerEvent under Op.mu once recorded says so.
//   - Each range set (Scheduler.host, Scheduler.devR) has a sync.RWMutex
//     over its ranges: written by AddHostRange, RemoveHostRange,
//     AddDeviceRange and RemoveDeviceRange, read by validate and
//     checkBlocks (on Submit's caller, the builder goroutines and the
//     submitting thread), which hold host's read lock while they take
//     devR's: the one nesting of locks in the scheduler. AddHostRange and
//     RemoveHostRange release host's lock before they call the device's.
//   - Tracker.mu guards a Tracker's live ranges and violations; the
//     scheduler takes it (gens, violate) with none of its locks held.
//   - The partFeed has no lock: it belongs to the submitting thread (as
//     do the Scheduler's lone and partRefs), which hands part buffers to
//     and from the builder goroutines over channels (free, ready); claimed
//     (atomic, per part) settles whether a builder or the submitting
//     thread builds a part, and quit and the exited WaitGroup stop the
//     builders.
//   - Without a lock: announced and liveCompleters (atomic counters),
//     the wake and prewake channels, and
//     pending, which hands each batch from the submitting thread to its
//     direction's completion goroutine.
//   - A Device keeps its own locks (internal/cudadev's, the copier's in
//     internal/cudacopy), taken inside its methods, which the scheduler
//     calls with none of its locks held.
//
// In invariant builds (-race, or the kvoinvariants tag) a Tracker given in
// Config checks that every copy's host ranges stay live from submission to
// completion, poisons released ranges, and batch descriptor buffers are
// fingerprinted at submission and checked at completion.
package transfer
