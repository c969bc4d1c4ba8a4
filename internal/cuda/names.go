package cuda

import "fmt"

// resultNames is the built-in table of CUresult names and descriptions used
// when the driver is not loaded (or cannot describe a code). The texts are the
// driver's own wording.
var resultNames = map[Result][2]string{
	Success:                          {"CUDA_SUCCESS", "no error"},
	ErrorInvalidValue:                {"CUDA_ERROR_INVALID_VALUE", "invalid argument"},
	ErrorOutOfMemory:                 {"CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
	ErrorNotInitialized:              {"CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
	ErrorDeinitialized:               {"CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
	ErrorNoDevice:                    {"CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
	ErrorInvalidDevice:               {"CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
	ErrorInvalidImage:                {"CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
	ErrorInvalidContext:              {"CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
	ErrorInvalidPTX:                  {"CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
	ErrorUnsupportedPTXVersion:       {"CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "the provided PTX was compiled with an unsupported toolchain."},
	ErrorInvalidHandle:               {"CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
	ErrorIllegalState:                {"CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
	ErrorNotFound:                    {"CUDA_ERROR_NOT_FOUND", "named symbol not found"},
	ErrorNotReady:                    {"CUDA_ERROR_NOT_READY", "device not ready"},
	ErrorIllegalAddress:              {"CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
	ErrorHostMemoryAlreadyRegistered: {"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped"},
	ErrorHostMemoryNotRegistered:     {"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
	714:                              {"CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error"},
	715:                              {"CUDA_ERROR_ILLEGAL_INSTRUCTION", "an illegal instruction was encountered"},
	716:                              {"CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"},
	717:                              {"CUDA_ERROR_INVALID_ADDRESS_SPACE", "operation not supported on global/shared address space"},
	718:                              {"CUDA_ERROR_INVALID_PC", "invalid program counter"},
	ErrorLaunchFailed:                {"CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
	ErrorNotPermitted:                {"CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
	ErrorNotSupported:                {"CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
	ErrorStreamCaptureUnsupported:    {"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
	ErrorStreamCaptureInvalidated:    {"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
	ErrorStreamCaptureImplicit:       {"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "operation would make the legacy stream depend on a capturing blocking stream"},
	ErrorCapturedEvent:               {"CUDA_ERROR_CAPTURED_EVENT", "operation not permitted on an event last recorded in a capturing stream"},
	ErrorStreamCaptureWrongThread:    {"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "attempt to terminate a thread-local capture sequence from another thread"},
	ErrorUnknown:                     {"CUDA_ERROR_UNKNOWN", "unknown error"},
}

// ResultName returns the CUresult's name and description from the built-in
// table; codes it does not know get "CUDA_ERROR_<code>" and "unrecognized
// error code".
func ResultName(code Result) (name, text string) {
	if nt, ok := resultNames[code]; ok {
		return nt[0], nt[1]
	}
	return fmt.Sprintf("CUDA_ERROR_%d", int32(code)), "unrecognized error code"
}

// NewError returns the *Error for a failed call of op, named from the
// built-in table. The real binding names errors with cuGetErrorName and
// cuGetErrorString instead; fakes use this.
func NewError(op string, code Result) *Error {
	name, text := ResultName(code)
	return &Error{Op: op, Code: code, Name: name, Text: text}
}

// BatchError is a MemcpyBatchAsync failure attributed to one copy: Index is
// the position in the copies slice the driver (or argument checking) blamed,
// or -1 when the driver did not name one.
type BatchError struct {
	Index int
	Copy  BatchCopy
	Err   error
}

func (e *BatchError) Error() string {
	if e.Index < 0 {
		return fmt.Sprintf("cuda: batch copy: %v", e.Err)
	}
	return fmt.Sprintf("cuda: batch copy %d (dst %#x, src %#x, %d bytes): %v",
		e.Index, uint64(e.Copy.Dst), uint64(e.Copy.Src), e.Copy.Size, e.Err)
}

func (e *BatchError) Unwrap() error { return e.Err }
