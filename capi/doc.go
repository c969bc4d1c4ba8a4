// Command capi is the C ABI of kvoffload, built as a shared library:
//
//	go build -buildmode=c-shared -o build/libkvoffload.so ./capi
//
// (or capi/build.sh). The public header is the hand-written kvoffload.h in
// this directory, not the one cgo generates. The library wraps package
// offload for C callers and for the Python package python/kvoffload
// (ctypes).
//
// Invariants it keeps:
//   - No Go pointer is ever handed to C. Engines, ops and leases cross the
//     boundary as opaque handles: integers that index handle tables (one per
//     kind, the kind encoded in the top byte, sequence numbers never reused),
//     so an unknown, stale or wrong-kind handle is an error code, never a
//     crash. Pointers C passes in are used only during the call.
//   - Every entry point refuses a forked child (KVO_EFORK) in C, before
//     entering Go: a child of fork has a Go runtime whose threads are gone.
//   - Every entry point recovers panics into KVO_EFAIL; a failed call sets
//     the calling thread's last error (C thread-local storage) and leaves no
//     partial state.
//   - Every entry point is safe for concurrent use from many C threads.
//     Objects are published in a handle table or the event-subscription
//     table only once whole (an event subscription with its stream), so a
//     call racing another never sees a part of one; kvo_engine_destroy
//     runs every step of the destroy (the engine, its event stream, its
//     simulated GPU) even when one fails, and reports it after.
//   - Loading the library caps the Go runtime's GOMAXPROCS at 8 (runtime.go)
//     unless the GOMAXPROCS environment variable is set; it writes no
//     environment variable.
//   - The engine's KVOFFLOAD_* switches are read from the process's current
//     environment (C's getenv, env.go), not from the copy Go took when the
//     library loaded: a host's later os.environ or setenv reaches the next
//     engine made.
//
// Without cgo (CGO_ENABLED=0) the package builds as an empty command, so
// that the module builds anywhere.
package main

func main() {}
