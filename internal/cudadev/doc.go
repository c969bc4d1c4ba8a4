// Package cudadev owns the module's CUDA devices: the driver (loaded at
// run time, dlopen of libcuda.so.1), the primary contexts retained on it,
// and the transfer.Device implementations over them. LoadDriver loads the
// driver, Driver.Probe checks a device, Driver.Open retains its primary
// Context, and Context.NewCUDA makes the CUDA device in it: the engine's
// streams (loads at the greatest priority, stores at the least, a bounce
// stream per direction for gathered stores and scattered loads) copying
// through internal/cudacopy. Context also runs functions with the context
// current (Do), prepares engine threads (InitThread), answers the driver
// questions its owner asks (AllocationRange, HostDevicePointer,
// StreamWaitEvent on a caller's stream), and is the register.Context that
// package register pins host memory in (HostRegister, HostUnregister). Sim
// is the CUDA device over the fake driver (internal/cuda/cudafake), the
// one GPU simulator of the module, with the caller's side for tests.
//
// It imports transfer (Direction, Segment, Event, Stream, the template
// types), and transfer imports neither it nor the copier: the scheduler
// sees only the transfer.Device interface and its optional extensions
// (templates, prepared copies, host ranges), which CUDA and Sim implement.
//
// Invariants:
//   - Driver calls that need the context run on an OS thread with it
//     current: a Context's Do and InitThread set it up, the CUDA device's
//     methods rely on the scheduler's engine threads (transfer.Device's
//     threading rules), and a Context's own queries say which they need.
//   - A Context from Driver.Open holds its primary context until Release,
//     once (Context.mu guards whether it still does); one from Bind never
//     retains nor releases the context its caller holds.
//   - The CUDA device's copier stays within MaxDeviceBytes of device
//     memory: a copy short of it waits for an earlier one on the
//     submitting thread, and one no copier call could hold is split.
//   - Close keeps the copier and the streams while copies still hold the
//     copier's buffers (cudacopy.ErrInFlight), so a later Close frees
//     everything.
package cudadev
