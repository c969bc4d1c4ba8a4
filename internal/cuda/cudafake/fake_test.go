package cudafake_test

import (
	"encoding/binary"
	"errors"
	"runtime"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// hostBuf is mmap'd host memory registered with the fake.
func hostBuf(t *testing.T, d *cudafake.Driver, n int) ([]byte, cuda.DevicePtr) {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	p := unsafe.Pointer(&b[0])
	require.NoError(t, d.MemHostRegister(p, uint64(n), cuda.HostRegisterPortable))
	dp, err := d.MemHostGetDevicePointer(p)
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, d.MemHostUnregister(p))
		require.NoError(t, unix.Munmap(b))
	})
	return b, dp
}

func devBuf(t *testing.T, d *cudafake.Driver, n uint64) cuda.DevicePtr {
	t.Helper()
	p, err := d.MemAlloc(n)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, d.MemFree(p)) })
	return p
}

func newStream(t *testing.T, d *cudafake.Driver) cuda.Stream {
	t.Helper()
	s, err := d.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, d.StreamDestroy(s)) })
	return s
}

func newEvent(t *testing.T, d *cudafake.Driver) cuda.Event {
	t.Helper()
	e, err := d.EventCreate(cuda.EventDisableTiming)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, d.EventDestroy(e)) })
	return e
}

func waitEvent(t *testing.T, d *cudafake.Driver, e cuda.Event) {
	t.Helper()
	for {
		done, err := d.EventQuery(e)
		require.NoError(t, err)
		if done {
			return
		}
		runtime.Gosched()
	}
}

func pattern(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) + seed
	}
}

func requireCode(t *testing.T, err error, code cuda.Result) {
	t.Helper()
	require.Error(t, err)
	require.True(t, cuda.IsCode(err, code), "want %d, got %v", code, err)
}

func TestRoundTripThroughRegisteredMemory(t *testing.T) {
	d := cudatest.OpenFake(t, cudafake.Options{MaxDelay: time.Millisecond, Seed: 1})
	const n = 1<<16 + 123
	host, hp := hostBuf(t, d, n)
	dev := devBuf(t, d, n)
	s := newStream(t, d)
	e := newEvent(t, d)
	pattern(host, 3)
	want := append([]byte(nil), host...)

	require.NoError(t, d.MemcpyAsync(dev, hp, n, s))
	require.NoError(t, d.MemsetD8(hp, 0, 1)) // a synchronous call does not wait for the stream
	require.NoError(t, d.StreamSynchronize(s))
	clear(host)
	require.NoError(t, d.MemcpyAsync(hp, dev, n, s))
	require.NoError(t, d.EventRecord(e, s))
	waitEvent(t, d, e)
	require.Equal(t, want[1:], host[1:])
}

func TestMemoryErrors(t *testing.T) {
	d := cudatest.OpenFake(t, cudafake.Options{DeviceMemory: 1 << 20})
	host, hp := hostBuf(t, d, 4096)
	dev := devBuf(t, d, 4096)
	s := newStream(t, d)

	requireCode(t, d.MemcpyAsync(dev, hp, 4097, s), cuda.ErrorInvalidValue)
	requireCode(t, d.MemcpyAsync(dev+1, hp, 4096, s), cuda.ErrorInvalidValue)
	requireCode(t, d.Memcpy(dev, cuda.DevicePtr(uintptr(unsafe.Pointer(&[8]byte{}))), 8), cuda.ErrorInvalidValue)
	requireCode(t, d.MemHostRegister(unsafe.Pointer(&host[100]), 10, 0), cuda.ErrorHostMemoryAlreadyRegistered)
	requireCode(t, d.MemHostUnregister(unsafe.Pointer(&host[1])), cuda.ErrorHostMemoryNotRegistered)
	requireCode(t, d.MemHostRegister(unsafe.Pointer(&host[0]), 0, 0), cuda.ErrorInvalidValue)
	requireCode(t, d.MemFree(dev+8), cuda.ErrorInvalidValue)
	_, err := d.MemAlloc(0)
	requireCode(t, err, cuda.ErrorInvalidValue)
	_, err = d.MemAlloc(1<<20 - 4095)
	requireCode(t, err, cuda.ErrorOutOfMemory)
	free, total, err := d.MemGetInfo()
	require.NoError(t, err)
	require.Equal(t, uint64(1<<20), total)
	require.Equal(t, uint64(1<<20-4096), free)
	require.NoError(t, d.StreamSynchronize(s))
}

func TestMemGetAddressRange(t *testing.T) {
	d := cudatest.OpenFake(t, cudafake.Options{})
	_, hp := hostBuf(t, d, 4096)
	dev := devBuf(t, d, 1000)
	for _, p := range []cuda.DevicePtr{dev, dev + 1, dev + 999} {
		base, size, err := d.MemGetAddressRange(p)
		require.NoError(t, err)
		require.Equal(t, dev, base, "address %#x", uint64(p))
		require.Equal(t, uint64(1000), size, "the requested size, not the mapping's")
	}
	for _, p := range []cuda.DevicePtr{dev + 1000, dev - 1, hp, 0, 1 << 40} {
		_, _, err := d.MemGetAddressRange(p)
		requireCode(t, err, cuda.ErrorNotFound)
	}
	d.FailAt(cuda.OpMemGetAddressRange, d.Calls(cuda.OpMemGetAddressRange)+1, cuda.ErrorInvalidContext)
	_, _, err := d.MemGetAddressRange(dev)
	requireCode(t, err, cuda.ErrorInvalidContext)
}

func TestUseAfterFreeIsSticky(t *testing.T) {
	d := cudafake.New(cudafake.Options{})
	defer func() { require.NoError(t, d.Close()) }()
	a, err := d.MemAlloc(64)
	require.NoError(t, err)
	b, err := d.MemAlloc(64)
	require.NoError(t, err)
	s, err := d.StreamCreate(0, 0)
	require.NoError(t, err)
	e, err := d.EventCreate(0)
	require.NoError(t, err)
	require.NoError(t, d.StreamWaitEvent(s, e, 0))
	require.NoError(t, d.EventRecord(e, 0))
	// Hold the stream behind a hung event, free the source, then release it.
	d.HangAt(cuda.OpEventRecord, 2)
	require.NoError(t, d.EventRecord(e, 0))
	require.NoError(t, d.StreamWaitEvent(s, e, 0))
	require.NoError(t, d.MemcpyAsync(a, b, 64, s))
	require.NoError(t, d.MemFree(b))
	require.NoError(t, d.EventRecord(e, 0))
	err = d.StreamSynchronize(s)
	requireCode(t, err, cuda.ErrorIllegalAddress)
	require.True(t, cuda.IsSticky(err))
	_, err = d.MemAlloc(8)
	requireCode(t, err, cuda.ErrorIllegalAddress)
}

func TestFaultInjection(t *testing.T) {
	t.Run("FailAt", func(t *testing.T) {
		d := cudatest.OpenFake(t, cudafake.Options{})
		d.FailAt(cuda.OpMemAlloc, 2, cuda.ErrorOutOfMemory)
		p, err := d.MemAlloc(8)
		require.NoError(t, err)
		_, err = d.MemAlloc(8)
		requireCode(t, err, cuda.ErrorOutOfMemory)
		var ce *cuda.Error
		require.ErrorAs(t, err, &ce)
		require.Equal(t, cuda.OpMemAlloc, ce.Op)
		require.Equal(t, "CUDA_ERROR_OUT_OF_MEMORY", ce.Name)
		q, err := d.MemAlloc(8)
		require.NoError(t, err)
		require.Equal(t, 3, d.Calls(cuda.OpMemAlloc))
		require.NoError(t, d.MemFree(p))
		require.NoError(t, d.MemFree(q))
	})
	t.Run("Hook", func(t *testing.T) {
		d := cudatest.OpenFake(t, cudafake.Options{})
		var seen []int
		d.SetHook(func(op string, call int) cuda.Result {
			if op == cuda.OpStreamCreate {
				seen = append(seen, call)
				if call%2 == 0 {
					return cuda.ErrorNotPermitted
				}
			}
			return cuda.Success
		})
		newStream(t, d)
		_, err := d.StreamCreate(0, 0)
		requireCode(t, err, cuda.ErrorNotPermitted)
		newStream(t, d)
		d.SetHook(nil)
		require.Equal(t, []int{1, 2, 3}, seen)
	})
	t.Run("StickyFromFailAt", func(t *testing.T) {
		d := cudafake.New(cudafake.Options{})
		defer func() { require.NoError(t, d.Close()) }()
		d.FailAt(cuda.OpLaunchKernel, 1, cuda.ErrorLaunchFailed)
		requireCode(t, d.LaunchKernel(0, cuda.Dim3{}, cuda.Dim3{}, 0, 0), cuda.ErrorLaunchFailed)
		_, err := d.EventCreate(0)
		requireCode(t, err, cuda.ErrorLaunchFailed)
	})
	t.Run("MakeSticky", func(t *testing.T) {
		d := cudafake.New(cudafake.Options{})
		defer func() { require.NoError(t, d.Close()) }()
		d.MakeSticky(cuda.ErrorIllegalAddress)
		_, err := d.DriverVersion()
		require.True(t, cuda.IsSticky(err))
	})
	t.Run("StickyAt", func(t *testing.T) {
		d := cudafake.New(cudafake.Options{})
		defer func() { require.NoError(t, d.Close()) }()
		a, err := d.MemAlloc(8)
		require.NoError(t, err)
		// The event first: once the poisoned copy has run (at once, on
		// the stream's goroutine) every call fails, EventCreate included.
		e, err := d.EventCreate(0)
		require.NoError(t, err)
		d.StickyAt(cuda.OpMemcpyAsync, 1, cuda.ErrorIllegalAddress)
		require.NoError(t, d.MemcpyAsync(a, a, 8, 0))
		err = d.EventRecord(e, 0)
		if err == nil {
			err = d.EventSynchronize(e)
		}
		requireCode(t, err, cuda.ErrorIllegalAddress)
	})
	t.Run("HangAt", func(t *testing.T) {
		d := cudatest.OpenFake(t, cudafake.Options{})
		s := newStream(t, d)
		e := newEvent(t, d)
		d.HangAt(cuda.OpEventRecordWithFlags, 1)
		require.NoError(t, d.EventRecordWithFlags(e, s, 0))
		require.NoError(t, d.StreamSynchronize(s))
		done, err := d.EventQuery(e)
		require.NoError(t, err)
		require.False(t, done)
		require.NoError(t, d.EventRecord(e, s))
		waitEvent(t, d, e)
	})
	t.Run("NoMemcpyBatch", func(t *testing.T) {
		d := cudatest.OpenFake(t, cudafake.Options{NoMemcpyBatch: true})
		require.False(t, d.HasMemcpyBatch())
		requireCode(t, d.MemcpyBatchAsync([]cuda.BatchCopy{{}}, 1), cuda.ErrorNotSupported)
		d.SetMemcpyBatch(true)
		require.True(t, d.HasMemcpyBatch())
	})
	t.Run("CheckContext", func(t *testing.T) {
		d := cudafake.New(cudafake.Options{CheckContext: true})
		defer func() { require.NoError(t, d.Close()) }()
		_, err := d.MemAlloc(8)
		requireCode(t, err, cuda.ErrorInvalidContext)
		requireCode(t, d.CtxSetCurrent(0x100), cuda.ErrorInvalidContext)
	})
	t.Run("CtxGetCurrent", func(t *testing.T) {
		d := cudafake.New(cudafake.Options{Devices: 2})
		defer func() { require.NoError(t, d.Close()) }()
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		cur, err := d.CtxGetCurrent()
		require.NoError(t, err)
		require.Zero(t, cur, "no context current on a new thread")
		ctx, err := d.PrimaryCtxRetain(1)
		require.NoError(t, err)
		defer func() { require.NoError(t, d.PrimaryCtxRelease(1)) }()
		require.NoError(t, d.CtxSetCurrent(ctx))
		cur, err = d.CtxGetCurrent()
		require.NoError(t, err)
		require.Equal(t, ctx, cur)
		other := make(chan cuda.Context)
		go func() {
			runtime.LockOSThread() // a thread of its own, exiting with the goroutine
			c, _ := d.CtxGetCurrent()
			other <- c
		}()
		require.Zero(t, <-other, "the current context is per OS thread")
		require.NoError(t, d.CtxSetCurrent(0))
		cur, err = d.CtxGetCurrent()
		require.NoError(t, err)
		require.Zero(t, cur)
	})
	t.Run("Close", func(t *testing.T) {
		d := cudafake.New(cudafake.Options{})
		_, err := d.MemAlloc(8) // unmapped by Close
		require.NoError(t, err)
		require.NoError(t, d.Close())
		_, err = d.DriverVersion()
		requireCode(t, err, cuda.ErrorDeinitialized)
		require.Error(t, d.Close())
	})
}

func TestStreamWaitEventOrdersAcrossStreams(t *testing.T) {
	d := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 2 * time.Millisecond, Seed: 7})
	const seg = 4096
	host, hp := hostBuf(t, d, 2*seg+64)
	dev := devBuf(t, d, seg)
	producer, consumer := newStream(t, d), newStream(t, d)
	e, done := newEvent(t, d), newEvent(t, d)
	mod, err := d.ModuleLoadData([]byte("ptx"))
	require.NoError(t, err)
	fill, err := d.ModuleGetFunction(mod, cudafake.KernelFill)
	require.NoError(t, err)
	putDesc(host[2*seg:], 0, uint64(dev), seg, 42)
	require.NoError(t, d.LaunchKernel(fill, cuda.Dim3{X: 1, Y: 1, Z: 1}, cuda.Dim3{X: 32, Y: 1, Z: 1}, 0, producer,
		cuda.Arg(uint64(hp)+2*seg), cuda.Arg(uint32(1)), cuda.Arg(uint64(4_000_000))))
	require.NoError(t, d.EventRecord(e, producer))
	require.NoError(t, d.StreamWaitEvent(consumer, e, 0))
	require.NoError(t, d.MemcpyAsync(hp, dev, seg, consumer))
	require.NoError(t, d.EventRecord(done, consumer))
	waitEvent(t, d, done)
	for w := range uint64(seg / 8) {
		require.Equal(t, cudafake.Mix64(42+w), binary.LittleEndian.Uint64(host[w*8:]))
	}
	require.NoError(t, d.ModuleUnload(mod))
}

func putDesc(b []byte, src, dst, n, aux uint64) {
	binary.LittleEndian.PutUint64(b[0:], src)
	binary.LittleEndian.PutUint64(b[8:], dst)
	binary.LittleEndian.PutUint64(b[16:], n)
	binary.LittleEndian.PutUint64(b[24:], aux)
}

func TestKernels(t *testing.T) {
	d := cudatest.OpenFake(t, cudafake.Options{})
	const seg, nseg = 1000, 5
	host, hp := hostBuf(t, d, 3*seg*nseg+nseg*32+nseg*8)
	src, dst, table, out := host[:seg*nseg], host[seg*nseg:2*seg*nseg], 3*seg*nseg, 3*seg*nseg+nseg*32
	pattern(src, 9)
	mod, err := d.ModuleLoadData([]byte{1})
	require.NoError(t, err)
	defer func() { require.NoError(t, d.ModuleUnload(mod)) }()
	s := newStream(t, d)
	launch := func(name string, args ...[]byte) {
		f, err := d.ModuleGetFunction(mod, name)
		require.NoError(t, err)
		require.NoError(t, d.LaunchKernel(f, cuda.Dim3{X: 8, Y: 1, Z: 1}, cuda.Dim3{X: 256, Y: 1, Z: 1}, 0, s, args...))
		require.NoError(t, d.StreamSynchronize(s))
	}
	for i := range nseg {
		// Reversed order, so a kernel that ignored the descriptors would be caught.
		putDesc(host[table+i*32:], uint64(hp)+uint64(i*seg), uint64(hp)+uint64(seg*nseg+(nseg-1-i)*seg), seg, 0)
	}
	launch(cudafake.KernelCopy, cuda.Arg(uint64(hp)+uint64(table)), cuda.Arg(uint32(nseg)))
	for i := range nseg {
		require.Equal(t, src[i*seg:(i+1)*seg], dst[(nseg-1-i)*seg:(nseg-i)*seg])
	}
	launch(cudafake.KernelChecksum, cuda.Arg(uint64(hp)+uint64(table)), cuda.Arg(uint32(nseg)), cuda.Arg(uint64(hp)+uint64(out)))
	for i := range nseg {
		require.Equal(t, cudafake.Checksum(src[i*seg:(i+1)*seg]), binary.LittleEndian.Uint64(host[out+i*8:]))
	}
	f, err := d.ModuleGetFunction(mod, cudafake.KernelCopy)
	require.NoError(t, err)
	requireCode(t, d.LaunchKernel(f, cuda.Dim3{X: 1, Y: 1, Z: 1}, cuda.Dim3{X: 32, Y: 1, Z: 1}, 0, s, cuda.Arg(uint64(0))), cuda.ErrorInvalidValue)
	requireCode(t, d.LaunchKernel(f, cuda.Dim3{X: 1, Y: 1, Z: 1}, cuda.Dim3{X: 2048, Y: 1, Z: 1}, 0, s, cuda.Arg(uint64(0)), cuda.Arg(uint32(0))), cuda.ErrorInvalidValue)
	_, err = d.ModuleGetFunction(mod, "nope")
	requireCode(t, err, cuda.ErrorNotFound)
	_, err = d.ModuleLoadData(nil)
	requireCode(t, err, cuda.ErrorInvalidImage)
}

func TestMemcpyBatch(t *testing.T) {
	d := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 50 * time.Microsecond})
	const piece, n = 512, 200
	host, hp := hostBuf(t, d, piece*n)
	back, bp := hostBuf(t, d, piece*n)
	dev := devBuf(t, d, piece*n)
	s := newStream(t, d)
	pattern(host, 1)
	var up, down []cuda.BatchCopy
	for i := range n {
		j := (i * 37) % n // scattered on the device side
		up = append(up, cuda.BatchCopy{Dst: dev + cuda.DevicePtr(j*piece), Src: hp + cuda.DevicePtr(i*piece), Size: piece})
		down = append(down, cuda.BatchCopy{Dst: bp + cuda.DevicePtr(i*piece), Src: dev + cuda.DevicePtr(j*piece), Size: piece})
	}
	require.NoError(t, d.MemcpyBatchAsync(up, s))
	require.NoError(t, d.MemcpyBatchAsync(down, s))
	require.NoError(t, d.StreamSynchronize(s))
	require.Equal(t, host, back)

	bad := append([]cuda.BatchCopy(nil), up...)
	bad[17].Size = piece + 1<<20
	err := d.MemcpyBatchAsync(bad, s)
	var be *cuda.BatchError
	require.ErrorAs(t, err, &be)
	require.Equal(t, 17, be.Index)
	requireCode(t, err, cuda.ErrorInvalidValue)
	requireCode(t, d.MemcpyBatchAsync(up, 0), cuda.ErrorInvalidValue)
	requireCode(t, d.MemcpyBatchAsync(nil, s), cuda.ErrorInvalidValue)
}

func TestOutOfOrderCompletion(t *testing.T) {
	d := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 200 * time.Microsecond, Seed: 3})
	const streams = 4
	var evs []cuda.Event
	for range streams {
		s := newStream(t, d)
		for range 10 {
			e := newEvent(t, d)
			require.NoError(t, d.EventRecord(e, s))
			evs = append(evs, e)
		}
	}
	require.NoError(t, d.CtxSynchronize())
	for _, e := range evs {
		done, err := d.EventQuery(e)
		require.NoError(t, err)
		require.True(t, done)
	}
}

// onThread runs f on a fresh goroutine locked to its own OS thread with the
// fake's context current.
func onThread(t *testing.T, d *cudafake.Driver, f func()) {
	t.Helper()
	var wg sync.WaitGroup
	wg.Go(func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		ctx, err := d.PrimaryCtxRetain(0)
		if err == nil {
			err = d.CtxSetCurrent(ctx)
		}
		if err != nil {
			t.Error(err)
			return
		}
		f()
		if err := d.PrimaryCtxRelease(0); err != nil {
			t.Error(err)
		}
	})
	wg.Wait()
}

func TestGraphCaptureAndReplay(t *testing.T) {
	d := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 100 * time.Microsecond})
	host, hp := hostBuf(t, d, 256)
	dev := devBuf(t, d, 128)
	s := newStream(t, d)
	signal := newEvent(t, d)

	require.NoError(t, d.StreamBeginCapture(s, cuda.CaptureModeGlobal))
	st, err := d.StreamIsCapturing(s)
	require.NoError(t, err)
	require.Equal(t, cuda.CaptureStatusActive, st)
	require.NoError(t, d.StreamWaitEvent(s, signal, cuda.EventWaitExternal))
	require.NoError(t, d.MemcpyAsync(dev, hp, 128, s))
	require.NoError(t, d.MemcpyAsync(hp+128, dev, 128, s))
	g, err := d.StreamEndCapture(s)
	require.NoError(t, err)
	ge, err := d.GraphInstantiate(g)
	require.NoError(t, err)
	require.Zero(t, host[200], "capture must not run the work")

	for round := byte(1); round <= 3; round++ {
		pattern(host[:128], round)
		require.NoError(t, d.GraphLaunch(ge, s))
		require.NoError(t, d.StreamSynchronize(s))
		require.Equal(t, host[:128], host[128:])
	}
	require.NoError(t, d.GraphExecDestroy(ge))
	require.NoError(t, d.GraphDestroy(g))
}

func TestCaptureSafety(t *testing.T) {
	tests := []struct {
		name        string
		captureMode cuda.CaptureMode
		otherMode   cuda.CaptureMode
		breaks      bool
	}{
		{"global capture, global caller", cuda.CaptureModeGlobal, cuda.CaptureModeGlobal, true},
		{"global capture, relaxed caller", cuda.CaptureModeGlobal, cuda.CaptureModeRelaxed, false},
		{"global capture, thread-local caller", cuda.CaptureModeGlobal, cuda.CaptureModeThreadLocal, false},
		{"thread-local capture, global caller", cuda.CaptureModeThreadLocal, cuda.CaptureModeGlobal, false},
		{"relaxed capture, global caller", cuda.CaptureModeRelaxed, cuda.CaptureModeGlobal, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := cudatest.OpenFake(t, cudafake.Options{})
			s := newStream(t, d)
			e := newEvent(t, d)
			require.NoError(t, d.StreamBeginCapture(s, tt.captureMode))
			onThread(t, d, func() {
				prev, err := d.ThreadExchangeStreamCaptureMode(tt.otherMode)
				require.NoError(t, err)
				require.Equal(t, cuda.CaptureModeGlobal, prev)
				_, err = d.EventQuery(e)
				if tt.breaks {
					requireCode(t, err, cuda.ErrorStreamCaptureUnsupported)
				} else {
					require.NoError(t, err)
				}
			})
			g, err := d.StreamEndCapture(s)
			if tt.breaks {
				requireCode(t, err, cuda.ErrorStreamCaptureInvalidated)
				return
			}
			require.NoError(t, err)
			require.NoError(t, d.GraphDestroy(g))
		})
	}
	t.Run("own thread unsafe call", func(t *testing.T) {
		d := cudatest.OpenFake(t, cudafake.Options{})
		s := newStream(t, d)
		require.NoError(t, d.StreamBeginCapture(s, cuda.CaptureModeThreadLocal))
		_, err := d.MemAlloc(8)
		requireCode(t, err, cuda.ErrorStreamCaptureUnsupported)
		requireCode(t, d.StreamSynchronize(s), cuda.ErrorStreamCaptureUnsupported)
		_, err = d.StreamEndCapture(s)
		requireCode(t, err, cuda.ErrorStreamCaptureInvalidated)
	})
	t.Run("end from wrong thread", func(t *testing.T) {
		d := cudatest.OpenFake(t, cudafake.Options{})
		s := newStream(t, d)
		require.NoError(t, d.StreamBeginCapture(s, cuda.CaptureModeGlobal))
		onThread(t, d, func() {
			_, err := d.StreamEndCapture(s)
			requireCode(t, err, cuda.ErrorStreamCaptureWrongThread)
		})
		st, err := d.StreamIsCapturing(s)
		require.NoError(t, err)
		require.Equal(t, cuda.CaptureStatusNone, st)
		_, err = d.StreamEndCapture(s)
		requireCode(t, err, cuda.ErrorIllegalState)
	})
	t.Run("captured event", func(t *testing.T) {
		d := cudatest.OpenFake(t, cudafake.Options{})
		s := newStream(t, d)
		e := newEvent(t, d)
		require.NoError(t, d.StreamBeginCapture(s, cuda.CaptureModeRelaxed))
		require.NoError(t, d.EventRecord(e, s))
		_, err := d.EventQuery(e)
		requireCode(t, err, cuda.ErrorCapturedEvent)
		g, err := d.StreamEndCapture(s)
		require.NoError(t, err)
		require.NoError(t, d.GraphDestroy(g))
		require.True(t, errors.Is(d.StreamBeginCapture(0, cuda.CaptureModeGlobal), &cuda.Error{Code: cuda.ErrorStreamCaptureUnsupported}))
	})
}

func TestPeakDeviceBytes(t *testing.T) {
	d := cudafake.New(cudafake.Options{})
	defer func() { require.NoError(t, d.Close()) }()
	a, err := d.MemAlloc(3 << 20)
	require.NoError(t, err)
	b, err := d.MemAlloc(1 << 20)
	require.NoError(t, err)
	require.NoError(t, d.MemFree(a))
	c, err := d.MemAlloc(2 << 20)
	require.NoError(t, err)
	require.Equal(t, uint64(4<<20), d.PeakDeviceBytes())
	require.NoError(t, errors.Join(d.MemFree(b), d.MemFree(c)))
	require.Equal(t, uint64(4<<20), d.PeakDeviceBytes())
}

// Memcpy2DAsync copies rows at each side's pitch, and refuses an empty
// copy, a pitch below the width and rows outside known memory.
func TestMemcpy2D(t *testing.T) {
	d := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 50 * time.Microsecond})
	const row, pitch, rows = 256, 1024, 16
	host, hp := hostBuf(t, d, pitch*rows)
	back, bp := hostBuf(t, d, pitch*rows)
	dev := devBuf(t, d, row*rows)
	s := newStream(t, d)
	pattern(host, 3)
	require.NoError(t, d.Memcpy2DAsync(cuda.Memcpy2D{Dst: dev, DstPitch: row, Src: hp + 128, SrcPitch: pitch, Width: row, Height: rows}, s))
	require.NoError(t, d.Memcpy2DAsync(cuda.Memcpy2D{Dst: bp + 128, DstPitch: pitch, Src: dev, SrcPitch: row, Width: row, Height: rows}, s))
	require.NoError(t, d.StreamSynchronize(s))
	for r := range rows {
		o := r*pitch + 128
		require.Equal(t, host[o:o+row], back[o:o+row], "row %d", r)
		require.Equal(t, byte(0), back[o+row], "row %d: nothing past the width", r)
	}
	for _, bad := range []cuda.Memcpy2D{
		{Dst: dev, DstPitch: row, Src: hp, SrcPitch: row - 16, Width: row, Height: rows},
		{Dst: dev, DstPitch: row, Src: hp, SrcPitch: pitch, Width: row, Height: 0},
		{Dst: dev, DstPitch: row, Src: hp, SrcPitch: pitch, Width: row, Height: rows + 1},
	} {
		requireCode(t, d.Memcpy2DAsync(bad, s), cuda.ErrorInvalidValue)
	}
}
