// Package register pins regions (package mmapmem) so that DMA engines can
// read and write them: NewCUDA's Pinner registers them with
// cuMemHostRegister_v2 in a Context, the CUDA context it is given (the
// module's device context implements it: register never sees the driver
// and imports no device package). (The host backend's mlock pinning lives
// in offload.)
//
// Invariants:
//   - register, not mmapmem, knows which regions are registered: a Pinner
//     tracks the regions it pinned and reports their registration ranges.
//   - A registered region cannot be closed. Register takes a hold on the
//     region (mmapmem.Region.Hold), so Region.Close fails with
//     mmapmem.ErrHeld until Unregister; Release unregisters and closes.
//   - A region is registered in ranges of at most the pinner's range limit
//     (64 GiB by default for CUDA: one cuMemHostRegister of hundreds of GiB
//     has been seen to fail). Ranges reports them; a slot must never
//     straddle two ranges.
//   - A region mapped with mmapmem.Options.DeferPrefault is prefaulted by
//     Register itself, pipelined: its registration ranges are at most the
//     pinner's pipeline chunk (DefaultPipelineChunk, 2 GiB), range k+1 is
//     prefaulted on the region's prefault threads while range k is being
//     registered, and no range is pinned before its prefault
//     has finished. Ranges reports these ranges like any other.
//   - A failed Register leaves nothing registered: when range k fails (its
//     prefault or its pinning), ranges 0..k-1 are unregistered again, the
//     prefaulting goroutine has ended, and the error names range k, its
//     offset and size, and wraps the reason (the driver's error or the
//     prefault's).
//   - CUDA calls run through Context.Do: on a locked OS thread with the
//     pinner's context current and CU_STREAM_CAPTURE_MODE_RELAXED set (the
//     previous mode restored afterwards), so pinning never breaks a serving
//     stack's graph capture on another thread.
//
// Pinners are safe for concurrent use. Registering a region takes seconds
// for tens of GiB; Stats, Registered and Ranges do not wait for it.
package register
