package cuda

import "unsafe"

// Handles are opaque values owned by the driver. They are plain integers so
// that they can cross cgo, the C ABI and tests without Go pointers.
type (
	// Device is a CUdevice ordinal handle.
	Device int32
	// Context is a CUcontext.
	Context uintptr
	// Stream is a CUstream. The zero Stream is the legacy default stream.
	Stream uintptr
	// Event is a CUevent.
	Event uintptr
	// Module is a CUmodule.
	Module uintptr
	// Function is a CUfunction.
	Function uintptr
	// DevicePtr is a CUdeviceptr: a device (or unified) virtual address.
	DevicePtr uint64
)

// Attribute is a CUdevice_attribute.
type Attribute int32

// Device attributes used by the engine (values from cuda.h).
const (
	AttrMultiprocessorCount               Attribute = 16
	AttrPCIBusID                          Attribute = 33
	AttrPCIDeviceID                       Attribute = 34
	AttrPCIDomainID                       Attribute = 50
	AttrComputeCapabilityMajor            Attribute = 75
	AttrComputeCapabilityMinor            Attribute = 76
	AttrCanUseHostPointerForRegisteredMem Attribute = 91
	AttrHostRegisterSupported             Attribute = 99
)

// Flags for MemHostRegister (CU_MEMHOSTREGISTER_*).
const (
	HostRegisterPortable  uint32 = 0x01
	HostRegisterDeviceMap uint32 = 0x02
	HostRegisterIOMemory  uint32 = 0x04
	HostRegisterReadOnly  uint32 = 0x08
)

// Flags for MemHostAlloc (CU_MEMHOSTALLOC_*).
const (
	HostAllocPortable      uint32 = 0x01
	HostAllocDeviceMap     uint32 = 0x02
	HostAllocWriteCombined uint32 = 0x04
)

// Flags for StreamCreate (CU_STREAM_*).
const (
	StreamDefault     uint32 = 0x0
	StreamNonBlocking uint32 = 0x1
)

// Flags for EventCreate (CU_EVENT_*).
const (
	EventDefault       uint32 = 0x0
	EventBlockingSync  uint32 = 0x1
	EventDisableTiming uint32 = 0x2
	EventInterprocess  uint32 = 0x4
)

// Flags for EventRecordWithFlags and StreamWaitEvent.
const (
	EventRecordDefault  uint32 = 0x0
	EventRecordExternal uint32 = 0x1 // CU_EVENT_RECORD_EXTERNAL
	EventWaitDefault    uint32 = 0x0
	EventWaitExternal   uint32 = 0x1 // CU_EVENT_WAIT_EXTERNAL
)

// CaptureMode is a CUstreamCaptureMode.
type CaptureMode uint32

// Stream capture modes.
const (
	CaptureModeGlobal      CaptureMode = 0
	CaptureModeThreadLocal CaptureMode = 1
	CaptureModeRelaxed     CaptureMode = 2
)

// CaptureStatus is a CUstreamCaptureStatus.
type CaptureStatus uint32

// Stream capture states.
const (
	CaptureStatusNone        CaptureStatus = 0
	CaptureStatusActive      CaptureStatus = 1
	CaptureStatusInvalidated CaptureStatus = 2
)

// Dim3 is a grid or block size.
type Dim3 struct{ X, Y, Z uint32 }

// BatchCopy is one entry of a MemcpyBatchAsync call. Src and Dst are unified
// virtual addresses (a registered host pointer is valid as either).
type BatchCopy struct {
	Dst, Src DevicePtr
	Size     uint64
}

// Memcpy2D is one pitched copy of Memcpy2DAsync: Height rows of Width
// bytes, row r from Src + r×SrcPitch to Dst + r×DstPitch (unified
// addresses; each pitch at least Width).
type Memcpy2D struct {
	Dst, Src           DevicePtr
	DstPitch, SrcPitch uint64
	Width, Height      uint64
}

// Driver is the subset of the CUDA driver API the engine uses. The real
// implementation (Load) binds libcuda.so.1 at run time; tests substitute a fake
// that injects faults. Methods that take a context-bound resource require the
// calling goroutine's OS thread to have the engine's context current: callers
// lock the goroutine to its thread (runtime.LockOSThread) and call
// CtxSetCurrent first.
//
// Every error returned is either ErrNoDriver (wrapped) or an *Error carrying
// the CUresult.
type Driver interface {
	// DriverVersion is cuDriverGetVersion: 1000*major + 10*minor.
	DriverVersion() (int, error)
	DeviceCount() (int, error)
	DeviceGet(ordinal int) (Device, error)
	DeviceName(dev Device) (string, error)
	DeviceAttribute(attr Attribute, dev Device) (int, error)
	// DevicePCIBusID is cuDeviceGetPCIBusId: "0000:19:00.0".
	DevicePCIBusID(dev Device) (string, error)
	DeviceTotalMem(dev Device) (uint64, error)
	// MemGetInfo is cuMemGetInfo_v2 for the current context's device.
	MemGetInfo() (free, total uint64, err error)

	PrimaryCtxRetain(dev Device) (Context, error)
	PrimaryCtxRelease(dev Device) error
	CtxSetCurrent(ctx Context) error
	// CtxGetCurrent is cuCtxGetCurrent: the calling OS thread's current
	// context, 0 when it has none.
	CtxGetCurrent() (Context, error)
	CtxSynchronize() error
	// StreamPriorityRange is cuCtxGetStreamPriorityRange (least, greatest).
	StreamPriorityRange() (least, greatest int, err error)

	// MemHostRegister is cuMemHostRegister_v2 on [p, p+size).
	MemHostRegister(p unsafe.Pointer, size uint64, flags uint32) error
	MemHostUnregister(p unsafe.Pointer) error
	// MemHostGetDevicePointer is cuMemHostGetDevicePointer_v2.
	MemHostGetDevicePointer(p unsafe.Pointer) (DevicePtr, error)
	MemHostAlloc(size uint64, flags uint32) (unsafe.Pointer, error)
	MemFreeHost(p unsafe.Pointer) error
	MemAlloc(size uint64) (DevicePtr, error)
	MemFree(p DevicePtr) error
	MemsetD8(dst DevicePtr, value uint8, n uint64) error
	// MemGetAddressRange is cuMemGetAddressRange_v2: the base and size of
	// the device allocation containing p. An address in no allocation fails
	// (CUDA_ERROR_NOT_FOUND or CUDA_ERROR_INVALID_VALUE).
	MemGetAddressRange(p DevicePtr) (base DevicePtr, size uint64, err error)

	// Memcpy is a synchronous cuMemcpy between unified addresses.
	Memcpy(dst, src DevicePtr, n uint64) error
	// MemcpyAsync is cuMemcpyAsync between unified addresses.
	MemcpyAsync(dst, src DevicePtr, n uint64, s Stream) error
	// Memcpy2DAsync is cuMemcpy2DAsync_v2 between unified addresses
	// (CU_MEMORYTYPE_UNIFIED on both sides): one DMA of p.Height rows.
	Memcpy2DAsync(p Memcpy2D, s Stream) error
	// HasMemcpyBatch reports whether cuMemcpyBatchAsync was bound (driver ≥ 12.8).
	HasMemcpyBatch() bool
	// MemcpyBatchAsync is cuMemcpyBatchAsync with one attribute set
	// (stream-ordered source access) applied to all copies. On failure the
	// error says which copy failed.
	MemcpyBatchAsync(copies []BatchCopy, s Stream) error

	StreamCreate(flags uint32, priority int) (Stream, error)
	StreamDestroy(s Stream) error
	StreamSynchronize(s Stream) error
	StreamQuery(s Stream) (done bool, err error)
	StreamWaitEvent(s Stream, e Event, flags uint32) error
	StreamIsCapturing(s Stream) (CaptureStatus, error)
	StreamBeginCapture(s Stream, mode CaptureMode) error
	StreamEndCapture(s Stream) (Graph, error)

	EventCreate(flags uint32) (Event, error)
	EventDestroy(e Event) error
	EventRecord(e Event, s Stream) error
	EventRecordWithFlags(e Event, s Stream, flags uint32) error
	// EventQuery returns (true, nil) when the event has completed,
	// (false, nil) when it is still pending (CUDA_ERROR_NOT_READY).
	EventQuery(e Event) (done bool, err error)
	EventSynchronize(e Event) error
	// EventElapsedTime is in milliseconds.
	EventElapsedTime(start, end Event) (float32, error)

	// ThreadExchangeStreamCaptureMode sets the calling thread's capture mode
	// and returns the previous one.
	ThreadExchangeStreamCaptureMode(mode CaptureMode) (CaptureMode, error)

	ModuleLoadData(image []byte) (Module, error)
	ModuleUnload(m Module) error
	ModuleGetFunction(m Module, name string) (Function, error)
	// LaunchKernel is cuLaunchKernel. Each element of args is the raw bytes of
	// one kernel parameter (use Arg to build them); the binding copies them to
	// C memory, so no Go pointer is retained.
	LaunchKernel(f Function, grid, block Dim3, sharedMem uint32, s Stream, args ...[]byte) error

	GraphInstantiate(g Graph) (GraphExec, error)
	GraphLaunch(ge GraphExec, s Stream) error
	GraphDestroy(g Graph) error
	GraphExecDestroy(ge GraphExec) error
}

// Graph is a CUgraph and GraphExec a CUgraphExec (used by the graph-capture
// tests and the staging-buffer checks).
type (
	Graph     uintptr
	GraphExec uintptr
)
