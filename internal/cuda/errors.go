package cuda

import (
	"errors"
	"fmt"
	"unsafe"
)

// ErrNoDriver means libcuda.so.1 (or a symbol the engine requires) could not
// be loaded, or the module was built with CGO_ENABLED=0.
var ErrNoDriver = errors.New("cuda: driver not available")

// Result is a CUresult.
type Result int32

// CUresult values the engine branches on.
const (
	Success                          Result = 0
	ErrorInvalidValue                Result = 1
	ErrorOutOfMemory                 Result = 2
	ErrorNotInitialized              Result = 3
	ErrorDeinitialized               Result = 4
	ErrorNoDevice                    Result = 100
	ErrorInvalidDevice               Result = 101
	ErrorInvalidImage                Result = 200
	ErrorInvalidContext              Result = 201
	ErrorInvalidPTX                  Result = 218
	ErrorUnsupportedPTXVersion       Result = 222
	ErrorInvalidHandle               Result = 400
	ErrorIllegalState                Result = 401
	ErrorNotFound                    Result = 500
	ErrorNotReady                    Result = 600
	ErrorIllegalAddress              Result = 700
	ErrorLaunchFailed                Result = 719
	ErrorHostMemoryAlreadyRegistered Result = 712
	ErrorHostMemoryNotRegistered     Result = 713
	ErrorStreamCaptureUnsupported    Result = 900
	ErrorStreamCaptureInvalidated    Result = 901
	ErrorStreamCaptureImplicit       Result = 906
	ErrorCapturedEvent               Result = 907
	ErrorStreamCaptureWrongThread    Result = 908
	ErrorNotPermitted                Result = 800
	ErrorNotSupported                Result = 801
	ErrorUnknown                     Result = 999
)

// Error is a failed driver call: the function, the CUresult, and the driver's
// own name and description of it (from cuGetErrorName/cuGetErrorString, or a
// built-in table when the driver is not loaded).
type Error struct {
	Op   string // driver function, e.g. "cuMemHostRegister_v2"
	Code Result
	Name string // e.g. "CUDA_ERROR_OUT_OF_MEMORY"
	Text string // e.g. "out of memory"
}

func (e *Error) Error() string {
	return fmt.Sprintf("cuda: %s: %s (%d): %s", e.Op, e.Name, int32(e.Code), e.Text)
}

// Is makes errors.Is(err, &Error{Code: X}) match on the code alone.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code
}

// Sticky reports whether the error leaves the context unusable: every later
// call in the process fails the same way and the context must be destroyed.
func (e *Error) Sticky() bool {
	switch e.Code {
	case ErrorIllegalAddress, ErrorLaunchFailed, 714 /*hardware stack*/, 715 /*illegal instruction*/, 716 /*misaligned*/, 717 /*invalid address space*/, 718 /*invalid pc*/, ErrorDeinitialized:
		return true
	}
	return false
}

// IsSticky reports whether err is (or wraps) a sticky driver error.
func IsSticky(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Sticky()
}

// IsCode reports whether err is (or wraps) a driver error with this code.
func IsCode(err error, code Result) bool {
	var e *Error
	return errors.As(err, &e) && e.Code == code
}

// Arg returns the bytes of one kernel parameter for LaunchKernel.
func Arg[T ~uint64 | ~int64 | ~uint32 | ~int32 | ~uintptr](v T) []byte {
	b := make([]byte, unsafe.Sizeof(v))
	copy(b, unsafe.Slice((*byte)(unsafe.Pointer(&v)), unsafe.Sizeof(v)))
	return b
}
