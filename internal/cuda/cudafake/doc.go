// Package cudafake is a functional simulation of the CUDA driver on host
// memory, implementing cuda.Driver for tests that must run without a GPU and
// for fault injection.
//
// What it simulates:
//
//   - Memory. MemAlloc and MemHostAlloc return real memory from unix.Mmap
//     (not the Go heap); MemHostRegister records caller ranges. Every copy,
//     synchronous or queued, is bounds-checked against these allocations and
//     registered ranges: a copy touching anything else is refused at the call
//     with CUDA_ERROR_INVALID_VALUE, and one whose memory was freed or
//     unregistered before it ran fails on its stream with the sticky
//     CUDA_ERROR_ILLEGAL_ADDRESS, as a DMA into freed memory would.
//     Device memory is bounded by Options.DeviceMemory (OOM beyond it).
//     MemGetAddressRange finds the MemAlloc allocation containing an address
//     (its requested size) and answers CUDA_ERROR_NOT_FOUND for any other.
//   - Streams and events. Each stream is a FIFO served by its own goroutine;
//     MemcpyAsync, Memcpy2DAsync, MemcpyBatchAsync, LaunchKernel, EventRecord and
//     StreamWaitEvent enqueue work items. An event completes when its stream
//     reaches it. Options.MaxDelay adds a seeded random delay to every item,
//     so completions across streams arrive out of order.
//   - Kernels. LaunchKernel interprets the project's kernels (kvo_copy,
//     kvo_copy_sys, kvo_copy_probe, kvo_copy_tmpl, kvo_copy_tmpl_probe, kvo_fill,
//     kvo_checksum of internal/cudacopy/kernels.cu) by the name
//     given to ModuleGetFunction; ModuleLoadData accepts any non-empty image.
//   - Graphs. StreamBeginCapture/EndCapture record the work a single stream
//     enqueues; GraphLaunch replays it. Events recorded inside a capture are
//     capture-internal unless recorded with EventRecordExternal, and a wait
//     on an event from outside the capture replays as a wait on that event's
//     latest record at launch time (as CU_EVENT_WAIT_EXTERNAL does).
//     Cross-stream capture (forking a capture into a second stream) is not
//     modelled: it returns CUDA_ERROR_NOT_SUPPORTED.
//   - Capture safety. Threads are OS threads (unix.Gettid), each with the
//     capture mode set by ThreadExchangeStreamCaptureMode (global by
//     default). While a capture that is not relaxed is in progress, a
//     potentially unsafe call (synchronising, querying, allocating, freeing
//     or registering) from a thread whose mode forbids it fails with
//     CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture,
//     following CUDA's rules for global and thread-local modes.
//
// Fault injection is deterministic and per call: FailAt fails the Nth call of
// a driver function (named by the cuda.Op* constants) with a CUresult;
// SetHook decides for every call; MakeSticky and sticky codes passed to
// FailAt poison the context so every later call fails the same way; StickyAt
// fails the work a call enqueued when its stream reaches it; HangAt leaves an
// event pending forever; SetMemcpyBatch toggles HasMemcpyBatch. Live counts
// what is allocated, registered and created, so tests can assert nothing
// leaks, and Close releases everything and stops the stream goroutines.
//
// With Options.CheckContext, calls that need a context fail with
// CUDA_ERROR_INVALID_CONTEXT unless the calling OS thread has a retained
// primary context current, which catches goroutines that are not locked to
// their thread.
//
// Differences from the driver, deliberately: Memcpy and MemsetD8 act at
// once rather than on the legacy stream, and the legacy stream (Stream 0)
// does not synchronise with other streams.
package cudafake
