//go:build cgo

package cuda_test

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

func TestLoadFromMissingLibrary(t *testing.T) {
	drv, err := cuda.LoadFrom("/nonexistent/libcuda.so.1")
	require.Nil(t, drv)
	require.ErrorIs(t, err, cuda.ErrNoDriver)
	require.ErrorContains(t, err, "/nonexistent/libcuda.so.1")
}

func TestLoadFromLibraryWithoutDriverSymbols(t *testing.T) {
	drv, err := cuda.LoadFrom("libc.so.6")
	require.Nil(t, drv)
	require.ErrorIs(t, err, cuda.ErrNoDriver)
	require.ErrorContains(t, err, "does not export cuInit")
}

// stubDriver builds testdata/stublib.c into a shared library and loads it.
func stubDriver(t *testing.T) cuda.Driver {
	t.Helper()
	cc := "cc"
	if out, err := exec.Command("go", "env", "CC").Output(); err == nil && len(strings.TrimSpace(string(out))) > 0 {
		cc = strings.Fields(string(out))[0]
	}
	lib := filepath.Join(t.TempDir(), "libstub.so")
	if out, err := exec.Command(cc, "-shared", "-fPIC", "-o", lib, "testdata/stublib.c").CombinedOutput(); err != nil {
		t.Skipf("cannot build the stub driver with %s: %v\n%s", cc, err, out)
	}
	drv, err := cuda.LoadFrom(lib)
	require.NoError(t, err)
	return drv
}

func TestBindingCallingConventions(t *testing.T) {
	drv := stubDriver(t)
	v, err := drv.DriverVersion()
	require.NoError(t, err)
	require.Equal(t, 12080, v)
	name, err := drv.DeviceName(0)
	require.NoError(t, err)
	require.Equal(t, "Stub GPU", name)
	bus, err := drv.DevicePCIBusID(0)
	require.NoError(t, err)
	require.Equal(t, "0000:19:00.0", bus)
	cur, err := drv.CtxGetCurrent()
	require.NoError(t, err)
	require.Equal(t, cuda.Context(0xc0c0), cur)

	_, err = drv.MemAlloc(1)
	var ce *cuda.Error
	require.ErrorAs(t, err, &ce)
	require.Equal(t, cuda.Error{Op: cuda.OpMemAlloc, Code: cuda.ErrorOutOfMemory, Name: "STUB_OUT_OF_MEMORY", Text: "stub says no"}, *ce)

	base, size, err := drv.MemGetAddressRange(0x123456)
	require.NoError(t, err)
	require.Equal(t, cuda.DevicePtr(0x120000), base)
	require.Equal(t, uint64(0x10000), size)
	_, _, err = drv.MemGetAddressRange(0x100)
	require.ErrorAs(t, err, &ce)
	require.Equal(t, cuda.OpMemGetAddressRange, ce.Op)
	require.Equal(t, cuda.ErrorNotFound, ce.Code)

	done, err := drv.StreamQuery(1)
	require.NoError(t, err)
	require.False(t, done, "CUDA_ERROR_NOT_READY is pending, not an error")
	done, err = drv.EventQuery(1)
	require.NoError(t, err)
	require.True(t, done)

	src := []byte("0123456789abcdef")
	dst := make([]byte, len(src))
	ptr := func(b []byte, off int) cuda.DevicePtr { return cuda.DevicePtr(uintptr(unsafe.Pointer(&b[off]))) }
	require.NoError(t, drv.Memcpy(ptr(dst, 0), ptr(src, 0), 4))
	require.Equal(t, "0123", string(dst[:4]))

	require.True(t, drv.HasMemcpyBatch())
	copies := []cuda.BatchCopy{{Dst: ptr(dst, 4), Src: ptr(src, 12), Size: 4}, {Dst: ptr(dst, 8), Src: ptr(src, 4), Size: 8}}
	require.NoError(t, drv.MemcpyBatchAsync(copies, 1))
	require.Equal(t, "0123cdef456789ab", string(dst))
	err = drv.MemcpyBatchAsync(copies[:1], 1)
	var be *cuda.BatchError
	require.ErrorAs(t, err, &be)
	require.Equal(t, 0, be.Index)
	require.Equal(t, copies[0], be.Copy)
	err = drv.MemcpyBatchAsync(copies, 0)
	require.ErrorAs(t, err, &be)
	require.Equal(t, -1, be.Index)
	require.ErrorAs(t, drv.MemcpyBatchAsync(nil, 1), &be)

	var out uint32
	outPtr := uint64(uintptr(unsafe.Pointer(&out)))
	require.NoError(t, drv.LaunchKernel(1, cuda.Dim3{X: 2, Y: 3, Z: 4}, cuda.Dim3{X: 32, Y: 1, Z: 1}, 7, 1,
		cuda.Arg(outPtr), cuda.Arg(uint32(0xC0FFEE))))
	require.Equal(t, uint32(0xC0FFEE), out)
	require.Error(t, drv.LaunchKernel(1, cuda.Dim3{X: 1, Y: 1, Z: 1}, cuda.Dim3{X: 32, Y: 1, Z: 1}, 0, 1))
}
