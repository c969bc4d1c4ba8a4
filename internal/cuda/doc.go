// Package cuda is the CUDA driver API as the engine uses it: a Driver
// interface, typed errors, and a binding that loads libcuda.so.1 at run time
// with dlopen/dlsym (cgo, no CUDA headers, toolkit or link-time dependency).
// Only the module's own packages see these types (register, transfer,
// offload's CUDA backend, bench and the command); offload's public API
// exposes streams and events as plain uintptr values.
//
// Loading. Load opens libcuda.so.1 (RTLD_NOW|RTLD_LOCAL), binds every
// required entry point by its versioned symbol (cuMemHostRegister_v2,
// cuMemAlloc_v2, ...), probes the optional cuMemcpyBatchAsync (drivers ≥
// 12.8; HasMemcpyBatch reports it) and calls cuInit(0). A missing library or
// required symbol, a failing cuInit, or a build with CGO_ENABLED=0 is an
// error wrapping ErrNoDriver that names the library or symbol. All dl calls
// run on a locked OS thread because dlerror is thread-local.
//
// Errors. Every failed call returns an *Error with the function (the Op*
// constants), the CUresult and the driver's name and text for it (a built-in
// table when the driver cannot say). IsCode and IsSticky classify them;
// sticky errors mean the context is unusable.
//
// Threads and contexts. The driver binds the current context and the
// stream-capture mode to the OS thread, and Go moves goroutines between
// threads. A goroutine that calls the driver must therefore lock its thread
// and make the context current first. OnThread does both for one function
// on the caller's thread, and sets the thread's capture mode to relaxed, so
// that the engine's driver calls never invalidate a CUDA graph that the
// serving stack captures in global mode. The caller's thread may be the
// application's (through the C ABI), so OnThread restores its previous
// context (and with it the CUDA runtime's current device) and capture mode
// afterwards. The engine's own long-lived goroutines (the copy scheduler's,
// pool growth) lock their threads and set the same mode themselves, for good.
//
// Memory. The binding keeps all C memory handling inside this package:
// kernel parameters and batch-copy arrays are copied into C memory for the
// duration of the call, so no Go pointer reaches the driver, and handles
// are plain integers.
//
// Tests use internal/cuda/cudafake (a simulation with fault injection) or
// internal/cuda/cudatest (the real driver, or a skip).
package cuda
