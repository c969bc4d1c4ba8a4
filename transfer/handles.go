package transfer

// Handles of the copy layer's device objects, as plain integers so that
// they cross the C ABI and tests without Go pointers. On CUDA they are the
// driver's CUevent and CUstream (a caller passes its own as such); on the
// host backend they are the simulation's.
type (
	// Event is a CUevent, or an event of the Sim. 0 is never a valid event.
	Event uintptr
	// Stream is a CUstream, or a stream of the Sim. The zero Stream is
	// CUDA's legacy default stream.
	Stream uintptr
)
