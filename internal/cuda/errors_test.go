package cuda_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

func TestErrorFormatAndClassification(t *testing.T) {
	tests := []struct {
		code   cuda.Result
		msg    string
		sticky bool
	}{
		{cuda.ErrorOutOfMemory, "cuda: cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory", false},
		{cuda.ErrorIllegalAddress, "cuda: cuMemAlloc_v2: CUDA_ERROR_ILLEGAL_ADDRESS (700): an illegal memory access was encountered", true},
		{cuda.ErrorLaunchFailed, "cuda: cuMemAlloc_v2: CUDA_ERROR_LAUNCH_FAILED (719): unspecified launch failure", true},
		{716, "cuda: cuMemAlloc_v2: CUDA_ERROR_MISALIGNED_ADDRESS (716): misaligned address", true},
		{cuda.ErrorNotReady, "cuda: cuMemAlloc_v2: CUDA_ERROR_NOT_READY (600): device not ready", false},
		{12345, "cuda: cuMemAlloc_v2: CUDA_ERROR_12345 (12345): unrecognized error code", false},
	}
	for _, tt := range tests {
		t.Run(tt.msg, func(t *testing.T) {
			err := fmt.Errorf("wrapped: %w", cuda.NewError(cuda.OpMemAlloc, tt.code))
			require.Equal(t, "wrapped: "+tt.msg, err.Error())
			require.Equal(t, tt.sticky, cuda.IsSticky(err))
			require.True(t, cuda.IsCode(err, tt.code))
			require.False(t, cuda.IsCode(err, tt.code+1))
			require.ErrorIs(t, err, &cuda.Error{Code: tt.code})
		})
	}
	require.False(t, cuda.IsSticky(errors.New("plain")))
	require.False(t, cuda.IsCode(cuda.ErrNoDriver, cuda.ErrorUnknown))
}

func TestResultNameCoversEveryConstant(t *testing.T) {
	for _, code := range []cuda.Result{
		cuda.Success, cuda.ErrorInvalidValue, cuda.ErrorOutOfMemory, cuda.ErrorNotInitialized,
		cuda.ErrorDeinitialized, cuda.ErrorNoDevice, cuda.ErrorInvalidDevice, cuda.ErrorInvalidImage,
		cuda.ErrorInvalidContext, cuda.ErrorInvalidPTX, cuda.ErrorUnsupportedPTXVersion,
		cuda.ErrorInvalidHandle, cuda.ErrorIllegalState, cuda.ErrorNotFound, cuda.ErrorNotReady,
		cuda.ErrorIllegalAddress, cuda.ErrorLaunchFailed, cuda.ErrorHostMemoryAlreadyRegistered,
		cuda.ErrorHostMemoryNotRegistered, cuda.ErrorStreamCaptureUnsupported,
		cuda.ErrorStreamCaptureInvalidated, cuda.ErrorStreamCaptureImplicit, cuda.ErrorCapturedEvent,
		cuda.ErrorStreamCaptureWrongThread, cuda.ErrorNotPermitted, cuda.ErrorNotSupported, cuda.ErrorUnknown,
	} {
		name, text := cuda.ResultName(code)
		require.NotContains(t, text, "unrecognized", "code %d", code)
		require.Regexp(t, `^CUDA_(SUCCESS|ERROR_[A-Z_]+)$`, name)
	}
}

func TestBatchError(t *testing.T) {
	inner := cuda.NewError(cuda.OpMemcpyBatchAsync, cuda.ErrorInvalidValue)
	err := error(&cuda.BatchError{Index: 3, Copy: cuda.BatchCopy{Dst: 0x10, Src: 0x20, Size: 4096}, Err: inner})
	require.Equal(t, "cuda: batch copy 3 (dst 0x10, src 0x20, 4096 bytes): "+inner.Error(), err.Error())
	require.True(t, cuda.IsCode(err, cuda.ErrorInvalidValue))
	err = &cuda.BatchError{Index: -1, Err: inner}
	require.Equal(t, "cuda: batch copy: "+inner.Error(), err.Error())
}

func TestArg(t *testing.T) {
	require.Equal(t, []byte{1, 2, 0, 0}, cuda.Arg(uint32(0x0201)))
	require.Equal(t, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, cuda.Arg(int64(-1)))
	require.Len(t, cuda.Arg(cuda.DevicePtr(7)), 8)
}
