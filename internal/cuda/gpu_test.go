package cuda_test

import (
	"bytes"
	"math/rand/v2"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// The TestGPU* tests need a real driver and device (cudatest.Open skips
// without one, or fails with KVO_REQUIRE_GPU=1).

// pinned is an mmap'd host buffer registered with the driver.
func pinned(t *testing.T, g *cudatest.GPU, n int) ([]byte, cuda.DevicePtr) {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	p := unsafe.Pointer(&b[0])
	require.NoError(t, g.Drv.MemHostRegister(p, uint64(n), cuda.HostRegisterPortable))
	dp, err := g.Drv.MemHostGetDevicePointer(p)
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, g.Drv.MemHostUnregister(p))
		require.NoError(t, unix.Munmap(b))
	})
	return b, dp
}

func deviceMem(t *testing.T, g *cudatest.GPU, n uint64) cuda.DevicePtr {
	t.Helper()
	p, err := g.Drv.MemAlloc(n)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, g.Drv.MemFree(p)) })
	return p
}

func gpuStream(t *testing.T, g *cudatest.GPU) cuda.Stream {
	t.Helper()
	s, err := g.Drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, g.Drv.StreamDestroy(s)) })
	return s
}

func gpuEvent(t *testing.T, g *cudatest.GPU, flags uint32) cuda.Event {
	t.Helper()
	e, err := g.Drv.EventCreate(flags)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, g.Drv.EventDestroy(e)) })
	return e
}

func randomBytes(b []byte, seed uint64) {
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8)})
	_, _ = r.Read(b)
}

func pollEvent(t *testing.T, drv cuda.Driver, e cuda.Event) {
	t.Helper()
	for {
		done, err := drv.EventQuery(e)
		require.NoError(t, err)
		if done {
			return
		}
	}
}

func TestGPUDriverAndDevice(t *testing.T) {
	g := cudatest.Open(t)
	v, err := g.Drv.DriverVersion()
	require.NoError(t, err)
	require.GreaterOrEqual(t, v, 12080, "driver API version")
	name, err := g.Drv.DeviceName(g.Dev)
	require.NoError(t, err)
	bus, err := g.Drv.DevicePCIBusID(g.Dev)
	require.NoError(t, err)
	require.Regexp(t, `^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-9a-fA-F]$`, bus)
	attrs := map[cuda.Attribute]int{}
	for _, a := range []cuda.Attribute{
		cuda.AttrMultiprocessorCount, cuda.AttrPCIBusID, cuda.AttrPCIDeviceID, cuda.AttrPCIDomainID,
		cuda.AttrComputeCapabilityMajor, cuda.AttrComputeCapabilityMinor,
		cuda.AttrCanUseHostPointerForRegisteredMem, cuda.AttrHostRegisterSupported,
	} {
		attrs[a], err = g.Drv.DeviceAttribute(a, g.Dev)
		require.NoError(t, err, "attribute %d", a)
	}
	require.Equal(t, 1, attrs[cuda.AttrCanUseHostPointerForRegisteredMem])
	require.Equal(t, 1, attrs[cuda.AttrHostRegisterSupported])
	require.Positive(t, attrs[cuda.AttrMultiprocessorCount])
	require.GreaterOrEqual(t, attrs[cuda.AttrComputeCapabilityMajor], 8)
	total, err := g.Drv.DeviceTotalMem(g.Dev)
	require.NoError(t, err)
	free, total2, err := g.Drv.MemGetInfo()
	require.NoError(t, err)
	require.Equal(t, total, total2)
	require.LessOrEqual(t, free, total)
	least, greatest, err := g.Drv.StreamPriorityRange()
	require.NoError(t, err)
	require.LessOrEqual(t, greatest, least)
	t.Logf("driver %d, %s at %s, %d SMs, cc %d.%d, %d MiB (%d free), priorities %d..%d, batch copy %v",
		v, name, bus, attrs[cuda.AttrMultiprocessorCount], attrs[cuda.AttrComputeCapabilityMajor],
		attrs[cuda.AttrComputeCapabilityMinor], total>>20, free>>20, least, greatest, g.Drv.HasMemcpyBatch())
}

func TestGPUSyncRoundTrip(t *testing.T) {
	g := cudatest.Open(t)
	const n = 1<<20 + 17
	host, hp := pinned(t, g, 2*n)
	dev := deviceMem(t, g, n)
	require.NoError(t, g.Drv.MemsetD8(dev, 0xAB, n))
	require.NoError(t, g.Drv.Memcpy(hp, dev, n))
	require.Equal(t, bytes.Repeat([]byte{0xAB}, n), host[:n])
	randomBytes(host[:n], 1)
	require.NoError(t, g.Drv.Memcpy(dev, hp, n))
	require.NoError(t, g.Drv.Memcpy(hp+n, dev, n))
	require.Equal(t, host[:n], host[n:])

	p, err := g.Drv.MemHostAlloc(4096, cuda.HostAllocPortable)
	require.NoError(t, err)
	require.NoError(t, g.Drv.MemFreeHost(p))
}

func TestGPURegisteredAsyncWithEventPolling(t *testing.T) {
	g := cudatest.Open(t)
	const n = 64 << 20
	host, hp := pinned(t, g, 2*n)
	require.Equal(t, uint64(uintptr(unsafe.Pointer(&host[0]))), uint64(hp), "registered host pointer is its device pointer")
	dev := deviceMem(t, g, n)
	_, greatest, err := g.Drv.StreamPriorityRange()
	require.NoError(t, err)
	s, err := g.Drv.StreamCreate(cuda.StreamNonBlocking, greatest)
	require.NoError(t, err)
	defer func() { require.NoError(t, g.Drv.StreamDestroy(s)) }()
	start, end := gpuEvent(t, g, cuda.EventDefault), gpuEvent(t, g, cuda.EventDefault)
	randomBytes(host[:n], 2)

	require.NoError(t, g.Drv.EventRecord(start, s))
	require.NoError(t, g.Drv.MemcpyAsync(dev, hp, n, s))
	require.NoError(t, g.Drv.MemcpyAsync(hp+n, dev, n, s))
	require.NoError(t, g.Drv.EventRecord(end, s))
	pollEvent(t, g.Drv, end)
	require.True(t, bytes.Equal(host[:n], host[n:]), "round trip through a registered mmap buffer")
	ms, err := g.Drv.EventElapsedTime(start, end)
	require.NoError(t, err)
	t.Logf("64 MiB H2D + D2H: %.3f ms (%.1f GB/s per direction)", ms, 2*float64(n)/float64(ms)/1e6)
	done, err := g.Drv.StreamQuery(s)
	require.NoError(t, err)
	require.True(t, done)
}

func TestGPUMemcpyBatch(t *testing.T) {
	g := cudatest.Open(t)
	if !g.Drv.HasMemcpyBatch() {
		t.Skip("driver does not export cuMemcpyBatchAsync (needs ≥ 12.8)")
	}
	const piece, count = 16 << 10, 1000
	host, hp := pinned(t, g, 2*piece*count)
	dev := deviceMem(t, g, 2*piece*count) // every other slot: scattered
	s := gpuStream(t, g)
	randomBytes(host[:piece*count], 3)
	perm := rand.New(rand.NewPCG(4, 5)).Perm(count)
	up := make([]cuda.BatchCopy, count)
	down := make([]cuda.BatchCopy, count)
	for i, j := range perm {
		d := dev + cuda.DevicePtr(2*j*piece)
		up[i] = cuda.BatchCopy{Dst: d, Src: hp + cuda.DevicePtr(i*piece), Size: piece}
		down[i] = cuda.BatchCopy{Dst: hp + cuda.DevicePtr((count+i)*piece), Src: d, Size: piece}
	}
	require.NoError(t, g.Drv.MemcpyBatchAsync(up, s))
	require.NoError(t, g.Drv.MemcpyBatchAsync(down, s))
	require.NoError(t, g.Drv.StreamSynchronize(s))
	require.True(t, bytes.Equal(host[:piece*count], host[piece*count:]), "1000 scattered 16 KiB pieces byte-exact")
	require.Error(t, g.Drv.MemcpyBatchAsync(up, 0), "the legacy stream is refused")
}

func TestGPUStreamWaitEvent(t *testing.T) {
	g := cudatest.Open(t)
	const n = 128 << 20
	host, hp := pinned(t, g, 2*n)
	dev := deviceMem(t, g, n)
	producer, consumer := gpuStream(t, g), gpuStream(t, g)
	e := gpuEvent(t, g, cuda.EventDisableTiming)
	done := gpuEvent(t, g, cuda.EventDisableTiming)
	randomBytes(host[:n], 6)
	require.NoError(t, g.Drv.MemsetD8(dev, 0, n))
	require.NoError(t, g.Drv.MemcpyAsync(dev, hp, n, producer))
	require.NoError(t, g.Drv.EventRecord(e, producer))
	require.NoError(t, g.Drv.StreamWaitEvent(consumer, e, cuda.EventWaitDefault))
	require.NoError(t, g.Drv.MemcpyAsync(hp+n, dev, n, consumer))
	require.NoError(t, g.Drv.EventRecord(done, consumer))
	pollEvent(t, g.Drv, done)
	require.True(t, bytes.Equal(host[:n], host[n:]), "the consumer's copy ran after the producer's")
}

// TestGPUCaptureModes: while this thread captures a stream in global mode,
// another thread queries an event that is not part of the capture. CUDA's
// rule (cuThreadExchangeStreamCaptureMode): a thread in global mode is
// prohibited from "potentially unsafe" calls while any thread has a
// global-mode capture in progress; a relaxed thread is not (it is only
// refused calls that necessarily conflict with capture, such as querying an
// event recorded inside one). The engine relies on the relaxed case, which
// is asserted: a query from an OnThread thread succeeds and the capture
// survives. The documentation does not list cuEventQuery among the unsafe
// calls, so the global-mode case is logged, only checked to fail, if it
// fails, with the codes CUDA uses for a prohibited call.
func TestGPUCaptureModes(t *testing.T) {
	g := cudatest.Open(t)
	prev, err := g.Drv.ThreadExchangeStreamCaptureMode(cuda.CaptureModeRelaxed)
	require.NoError(t, err)
	require.Equal(t, cuda.CaptureModeGlobal, prev, "a thread starts in global mode")
	prev, err = g.Drv.ThreadExchangeStreamCaptureMode(cuda.CaptureModeGlobal)
	require.NoError(t, err)
	require.Equal(t, cuda.CaptureModeRelaxed, prev)

	for _, tt := range []struct {
		name     string
		other    func(f func() error) error
		asserted bool
	}{
		{"relaxed thread (OnThread)", func(f func() error) error { return cuda.OnThread(g.Drv, g.Ctx, f) }, true},
		{"global thread", func(f func() error) error {
			return cuda.OnThread(g.Drv, g.Ctx, func() error {
				if _, err := g.Drv.ThreadExchangeStreamCaptureMode(cuda.CaptureModeGlobal); err != nil {
					return err
				}
				return f()
			})
		}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			g.Lock(t)
			s := gpuStream(t, g)
			e := gpuEvent(t, g, cuda.EventDisableTiming)
			require.NoError(t, g.Drv.StreamBeginCapture(s, cuda.CaptureModeGlobal))
			var queryErr error
			var wg sync.WaitGroup
			wg.Go(func() {
				queryErr = tt.other(func() error {
					_, err := g.Drv.EventQuery(e)
					return err
				})
			})
			wg.Wait()
			graph, endErr := g.Drv.StreamEndCapture(s)
			if endErr == nil {
				require.NoError(t, g.Drv.GraphDestroy(graph))
			}
			if tt.asserted {
				require.NoError(t, queryErr, "a relaxed thread's query during another thread's global capture")
				require.NoError(t, endErr, "the capture survives a relaxed thread's query")
				return
			}
			t.Logf("cuEventQuery from a global-mode thread during a global capture: query %v; end capture %v", queryErr, endErr)
			if queryErr != nil {
				require.True(t, cuda.IsCode(queryErr, cuda.ErrorStreamCaptureUnsupported), "query: %v", queryErr)
			}
			if endErr != nil {
				require.True(t, cuda.IsCode(endErr, cuda.ErrorStreamCaptureInvalidated), "end capture: %v", endErr)
			}
		})
	}
}

func TestGPUGraphReplayWithExternalWait(t *testing.T) {
	g := cudatest.Open(t)
	const n = 8 << 20
	host, hp := pinned(t, g, 3*n)
	dev := deviceMem(t, g, n)
	graphStream, loadStream := gpuStream(t, g), gpuStream(t, g)
	signal := gpuEvent(t, g, cuda.EventDisableTiming)

	require.NoError(t, g.Drv.StreamBeginCapture(graphStream, cuda.CaptureModeGlobal))
	require.NoError(t, g.Drv.StreamWaitEvent(graphStream, signal, cuda.EventWaitExternal))
	require.NoError(t, g.Drv.MemcpyAsync(hp+2*n, dev, n, graphStream))
	graph, err := g.Drv.StreamEndCapture(graphStream)
	require.NoError(t, err)
	defer func() { require.NoError(t, g.Drv.GraphDestroy(graph)) }()
	exec, err := g.Drv.GraphInstantiate(graph)
	require.NoError(t, err)
	defer func() { require.NoError(t, g.Drv.GraphExecDestroy(exec)) }()

	for round := range uint64(3) {
		randomBytes(host[:n], 10+round)
		require.NoError(t, g.Drv.MemcpyAsync(dev, hp, n, loadStream))
		require.NoError(t, g.Drv.EventRecordWithFlags(signal, loadStream, cuda.EventRecordDefault))
		require.NoError(t, g.Drv.GraphLaunch(exec, graphStream))
		require.NoError(t, g.Drv.StreamSynchronize(graphStream))
		require.True(t, bytes.Equal(host[:n], host[2*n:]), "round %d: replay waited for the load", round)
	}
}
