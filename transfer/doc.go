// Package transfer moves segments between device memory and registered host
// memory asynchronously: it owns the engine's two streams (loads at higher
// priority than stores; on CUDA also a bounce stream per direction, for
// gathered stores and scattered loads, see CUDA),
// batches, events and completion. It knows segments
// and addresses, never keys; the owner of the slots (kvcache, composed by
// offload) changes slot state only when an op completes.
//
// A Scheduler runs over a Device: CUDA (copying through transfer/cudacopy)
// or Sim (the CUDA device over the fake driver internal/cuda/cudafake, with
// random, seeded copy delays: machines without a GPU).
//
// The CUDA side starts from the driver, which this package owns with the
// streams, events and device memory: LoadDriver loads libcuda.so.1,
// Driver.Probe checks a device, Driver.Open retains its primary Context,
// and Context.NewCUDA makes the CUDA device in it. Context also runs
// functions with the context current (Do), prepares engine threads
// (InitThread), and answers the driver questions its owner asks
// (AllocationRange, HostDevicePointer, StreamWaitEvent on a caller's
// stream); package register pins host memory for a Context. Events and
// streams are Event and Stream values, plain integers: the driver's CUevent
// and CUstream, or the Sim's. No exported name of this package is of an
// internal type.
//
// Life of a request: Submit validates every segment against the host and
// device ranges the scheduler was told about (AddHostRange, AddDeviceRange)
// before anything is enqueued, then queues it (a request with Build has its
// segments built, validated and copied part by part when it is issued
// instead: when an issue holds several parts, Config.Builders builder
// goroutines build, validate, coalesce and, on a device that prepares
// copies (CUDA's strided ones), prepare the next parts while the
// issuing thread copies the current one; it takes the parts in copy
// order, and a part is built once). A device with early events (CUDA with stream memory
// operations, see promiser) lets Submit of a request with events return
// before its copies are built: Submit records its events itself (on the
// caller's thread, the device's context made current for the calls)
// behind waits on a counter the engine stream writes after the copies,
// and with Config.EarlyHead it builds and copies the op's first parts
// there too (the first one before the events are recorded; Submit
// returns once they are) while the submitting goroutine wakes, when no op of either
// direction waits to be issued (the counter values are written in the
// order given out); that goroutine issues the rest. One submitting goroutine
// takes queued requests, loads before stores, within MaxInFlightBytes and
// MaxBatchesInFlight per direction, and issues them as one batch; without
// early events, a Submit of a request with events (which waits until its
// copies are enqueued) does the same itself on the caller's thread, the
// device's context made current there, whenever no other issue is
// running (Config.NoCallerIssue): one issuer at a time. A batch holds: waits on
// callers' After events, the copies (coalesced, layer by layer when a
// request declares layers, op and layer events recorded after each layer),
// then the batch event. One completion goroutine per direction detects
// batch events in FIFO order (polling with back-off, or blocking sync) and
// completes the batch's ops.
//
// Invariants:
//   - Submit never waits for copies to finish to admit a request: beyond
//     the in-flight bound requests queue, beyond MaxQueuedBytes they get
//     ErrBusy. A request with events (or a signal) is never refused for
//     bytes in flight: it is issued at once, its stream is its queue. A Submit that issues its own request (Config.NoCallerIssue)
//     or its head (Config.EarlyHead) can wait where the submitting thread
//     would have: for the copy
//     method's device memory bound to free a buffer (an event
//     synchronize), or for a stream after a failed enqueue.
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
//   - Every engine goroutine that calls the driver is locked to its OS
//     thread with the context current and stream capture mode relaxed, so a
//     global-mode capture on another thread is never invalidated by it; a
//     caller issuing its own request does so inside the device's OnThread
//     (the same, its thread's own context and mode restored after).
//
// In invariant builds (-race, or the kvoinvariants tag) a Tracker given in
// Config checks that every copy's host ranges stay live from submission to
// completion, poisons released ranges, and batch descriptor buffers are
// fingerprinted at submission and checked at completion.
package transfer
