package cudacopy

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"math"
	mrand "math/rand/v2"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// fakePTX is any non-empty image: the fake driver interprets the kernels by
// name.
var fakePTX = []byte("// kvo kernels (interpreted by cudafake)")

// hostMem is an mmap'd region registered with drv (DEVICEMAP, PORTABLE).
func hostMem(t testing.TB, drv cuda.Driver, n uint64) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	p := unsafe.Pointer(&b[0])
	require.NoError(t, drv.MemHostRegister(p, n, cuda.HostRegisterPortable|cuda.HostRegisterDeviceMap))
	t.Cleanup(func() {
		require.NoError(t, drv.MemHostUnregister(p))
		require.NoError(t, unix.Munmap(b))
	})
	return b
}

func addr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

func devMem(t testing.TB, drv cuda.Driver, n uint64) cuda.DevicePtr {
	t.Helper()
	p, err := drv.MemAlloc(n)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, drv.MemFree(p)) })
	return p
}

func newCopier(t testing.TB, drv cuda.Driver, opts Options) *Copier {
	t.Helper()
	c, err := New(drv, 0, opts)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	return c
}

func newStream(t testing.TB, drv cuda.Driver) cuda.Stream {
	t.Helper()
	s, err := drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, drv.StreamDestroy(s)) })
	return s
}

// run submits segs, waits for an event after them and retires the ticket.
func run(t testing.TB, drv cuda.Driver, c *Copier, s cuda.Stream, dir Path, segs []Segment) {
	t.Helper()
	tk, err := c.Submit(s, dir, segs)
	require.NoError(t, err)
	waitRetire(t, drv, c, s, tk)
}

func waitRetire(t testing.TB, drv cuda.Driver, c *Copier, s cuda.Stream, tk Ticket) {
	t.Helper()
	e, err := drv.EventCreate(cuda.EventDisableTiming)
	require.NoError(t, err)
	defer func() { require.NoError(t, drv.EventDestroy(e)) }()
	require.NoError(t, drv.EventRecord(e, s))
	require.NoError(t, drv.EventSynchronize(e))
	require.NoError(t, c.Retire(tk))
}

// testBuffers allocates n bytes of registered host memory twice and of
// device memory once: src random, dst poisoned with 0xEE.
func testBuffers(t *testing.T, drv cuda.Driver, n uint64) (src, dst []byte, dev cuda.DevicePtr) {
	t.Helper()
	src, dst = hostMem(t, drv, n), hostMem(t, drv, n)
	dev = devMem(t, drv, n)
	_, _ = rand.Read(src)
	poison(dst, 0xEE)
	return src, dst, dev
}

func poison(b []byte, v byte) {
	for i := range b {
		b[i] = v
	}
}

// roundTrip copies random data host → device → host2 through c with the
// layout's scattered segments, poisoning the device and host2 first, and
// checks every byte.
func roundTrip(t *testing.T, drv cuda.Driver, c *Copier, s cuda.Stream, l layout, seed uint64) {
	t.Helper()
	n := l.bytes()
	src, dst, dev := testBuffers(t, drv, n)
	require.NoError(t, drv.MemsetD8(dev, 0xDD, n))
	require.NoError(t, drv.CtxSynchronize())
	h2d, d2h := l.segments(addr(src), uint64(dev), addr(dst), mrand.New(mrand.NewPCG(seed, 1)))
	run(t, drv, c, s, H2D, h2d)
	run(t, drv, c, s, D2H, d2h)
	if i := firstDiff(src, dst); i >= 0 {
		t.Fatalf("%v via %v: byte %d differs: sent %#x, got %#x", l, c.Options().Method, i, src[i], dst[i])
	}
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

func TestSubmitRoundTripFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 50_000})
	s := newStream(t, drv)
	layouts := []layout{crossLayer(7, 4<<10), crossLayer(3, 80<<10), layerSeparate(5, 3, 4<<10), layerSeparate(2, 2, 48<<10)}
	for _, m := range []Method{MethodMemcpy, MethodBatch, MethodKernel, MethodAuto} {
		// Small descriptor buffers and chunks: batches span several launches.
		c := newCopier(t, drv, Options{Method: m, PTX: fakePTX, DescCapacity: 5, ChunkBytes: 16 << 10, BatchMax: 4})
		// No subtests: the context is current on this test's locked thread only.
		for i, l := range layouts {
			roundTrip(t, drv, c, s, l, uint64(i))
		}
	}
}

// launchRecorder records the arguments of every kernel launch.
type launchRecorder struct {
	cuda.Driver
	args [][][]byte
}

func (r *launchRecorder) LaunchKernel(f cuda.Function, grid, block cuda.Dim3, shm uint32, s cuda.Stream, args ...[]byte) error {
	cp := make([][]byte, len(args))
	for i, a := range args {
		cp[i] = append([]byte(nil), a...)
	}
	r.args = append(r.args, cp)
	return r.Driver.LaunchKernel(f, grid, block, shm, s, args...)
}

// Options resolve to one launch per direction: the defaults, each set field
// overriding both directions, fences and paces kept for D2H only.
func TestLaunchResolution(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	probe := Launch{CTAs: 8, Threads: 192, Kernel: ProbeCopyKernel, FenceBytes: FenceUnit}
	plain := Launch{CTAs: 4, Threads: 512, Kernel: DefaultCopyKernel}
	tests := []struct {
		name     string
		opts     Options
		d2h, h2d Launch
	}{
		{"defaults", Options{}, probe, plain},
		{"greedy D2H", Options{GreedyD2H: true}, Launch{CTAs: 8, Threads: 1024, Kernel: DefaultCopyKernel}, plain},
		{"grid for both", Options{CTAs: 2, Threads: 128}, Launch{CTAs: 2, Threads: 128, Kernel: ProbeCopyKernel, FenceBytes: FenceUnit}, Launch{CTAs: 2, Threads: 128, Kernel: DefaultCopyKernel}},
		{"plain kernel for both, each direction's grid", Options{CopyKernel: DefaultCopyKernel}, Launch{CTAs: 8, Threads: 192, Kernel: DefaultCopyKernel}, plain},
		{"fence and pace", Options{FenceBytes: 2 * FenceUnit, PaceGBps: 40}, Launch{CTAs: 8, Threads: 192, Kernel: ProbeCopyKernel, FenceBytes: 2 * FenceUnit, PaceGBps: 40}, plain},
		{"fenced kernel", Options{CopyKernel: SysFenceCopyKernel}, Launch{CTAs: 8, Threads: 192, Kernel: SysFenceCopyKernel, FenceBytes: DefaultFenceBytes}, Launch{CTAs: 4, Threads: 512, Kernel: SysFenceCopyKernel}},
		{"sys kernel for both", Options{CopyKernel: SysFenceCopyKernel, GreedyD2H: true}, Launch{CTAs: 8, Threads: 1024, Kernel: SysFenceCopyKernel, FenceBytes: DefaultFenceBytes}, Launch{CTAs: 4, Threads: 512, Kernel: SysFenceCopyKernel}},
	}
	// No subtests: the context is current on this test's locked thread only.
	for _, tc := range tests {
		tc.opts.PTX = fakePTX
		c, err := New(drv, 0, tc.opts)
		require.NoError(t, err, tc.name)
		require.Equal(t, tc.d2h, c.Capabilities().D2H, tc.name)
		require.Equal(t, tc.h2d, c.Capabilities().H2D, tc.name)
		require.NoError(t, c.Close())
	}
	require.Equal(t, probe, DefaultLaunch(D2H, false))
	require.Equal(t, plain, DefaultLaunch(D2D, true))
	require.Equal(t, "kvo_copy_sys 4×512 fence 4 KiB pace 40 GB/s", Launch{CTAs: 4, Threads: 512, Kernel: SysFenceCopyKernel, FenceBytes: FenceUnit, PaceGBps: 40}.String())
	require.Equal(t, "kvo_copy_probe 8×192 read-back 4 KiB", DefaultLaunch(D2H, false).String())
}

// The throttled kernels (kvo_copy_sys, kvo_copy_probe) round-trip like
// kvo_copy and get their fence interval, in FenceUnits, and their pace, per
// warp, on device-to-host launches only.
func TestThrottledKernelsFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{MaxDelay: 20_000})
	rec := &launchRecorder{Driver: drv}
	s := newStream(t, drv)
	for _, tc := range []struct {
		kernel      string
		fence, want int
		pace        float64
	}{
		{SysFenceCopyKernel, 0, DefaultFenceBytes / FenceUnit, 0},
		{SysFenceCopyKernel, 5 * FenceUnit, 5, 8.192},
		{ProbeCopyKernel, 0, DefaultFenceBytes / FenceUnit, 0},
		{ProbeCopyKernel, 3 * FenceUnit, 3, 8.192},
	} {
		// 2 CTAs of 2 warps, 7 descriptors per launch: every launch but
		// the last runs 4 warps, each at a quarter of the pace.
		c := newCopier(t, rec, Options{Method: MethodKernel, CopyKernel: tc.kernel, FenceBytes: tc.fence, PaceGBps: tc.pace, PTX: fakePTX, DescCapacity: 7, CTAs: 2, Threads: 64})
		require.Equal(t, Launch{CTAs: 2, Threads: 64, Kernel: tc.kernel, FenceBytes: tc.want * FenceUnit, PaceGBps: tc.pace}, c.Capabilities().D2H)
		require.Equal(t, Launch{CTAs: 2, Threads: 64, Kernel: tc.kernel}, c.Capabilities().H2D)
		rec.args = nil
		l := layerSeparate(3, 4, 16<<10)
		n := l.bytes()
		src, dst, dev := testBuffers(t, drv, n)
		h2d, d2h := l.segments(addr(src), uint64(dev), addr(dst), mrand.New(mrand.NewPCG(uint64(tc.fence), 1)))
		run(t, drv, c, s, H2D, h2d)
		h2dLaunches := len(rec.args)
		run(t, drv, c, s, D2H, d2h)
		require.Equal(t, -1, firstDiff(src, dst))
		require.Greater(t, h2dLaunches, 1, "several launches per batch")
		for i, a := range rec.args {
			require.Len(t, a, 4, "launch %d", i)
			want, pace := uint64(tc.want), uint64(0)
			if tc.pace > 0 {
				pace = 2000 // 4 warps × 4096 B / 8.192 B/ns
			}
			if i < h2dLaunches {
				want, pace = 0, 0
			}
			require.Equal(t, want, binary.LittleEndian.Uint64(a[2]), "launch %d", i)
			if i < len(rec.args)-1 || i < h2dLaunches {
				require.Equal(t, pace, binary.LittleEndian.Uint64(a[3]), "launch %d", i)
			}
		}
	}
}

// The default read-back interval doubles for a D2H batch whose segments
// average under SmallSegmentFenceBytes, unless Options set FenceBytes or
// another kernel; H2D launches carry no throttle.
func TestSmallSegmentFence(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	rec := &launchRecorder{Driver: drv}
	s := newStream(t, drv)
	const n = 256 << 10
	src, dst, dev := testBuffers(t, drv, n)
	segs := func(size uint64, dir Path) []Segment {
		var out []Segment
		for off := uint64(0); off < n; off += size {
			if dir == D2H {
				out = append(out, Segment{Dst: addr(dst) + off, Src: uint64(dev) + off, Len: size})
			} else {
				out = append(out, Segment{Dst: uint64(dev) + off, Src: addr(src) + off, Len: size})
			}
		}
		return out
	}
	mixed := append(segs(4<<10, D2H)[:60:60], Segment{Dst: addr(dst) + 240<<10, Src: uint64(dev) + 240<<10, Len: 16 << 10})
	for _, tc := range []struct {
		name string
		opts Options
		segs []Segment
		want uint64
	}{
		{"4 KiB segments", Options{}, segs(4<<10, D2H), 2},
		{"4 KiB segments, probe named", Options{CopyKernel: ProbeCopyKernel}, segs(4<<10, D2H), 2},
		{"16 KiB segments", Options{}, segs(16<<10, D2H), 1},
		{"8 KiB segments", Options{}, segs(8<<10, D2H), 1},
		{"mean under 8 KiB", Options{}, mixed, 2},
		{"FenceBytes set", Options{FenceBytes: FenceUnit}, segs(4<<10, D2H), 1},
		{"longer FenceBytes kept", Options{FenceBytes: 3 * FenceUnit}, segs(4<<10, D2H), 3},
		{"fence kernel", Options{CopyKernel: SysFenceCopyKernel}, segs(4<<10, D2H), 1},
		{"H2D", Options{}, segs(4<<10, H2D), 0},
	} {
		tc.opts.Method, tc.opts.PTX = MethodKernel, fakePTX
		c := newCopier(t, rec, tc.opts)
		rec.args = nil
		dir := D2H
		if tc.want == 0 {
			dir = H2D
		}
		run(t, drv, c, s, dir, tc.segs)
		require.NotEmpty(t, rec.args, tc.name)
		for i, a := range rec.args {
			got := uint64(0)
			if len(a) == 4 {
				got = binary.LittleEndian.Uint64(a[2])
			}
			require.Equal(t, tc.want, got, "%s: launch %d", tc.name, i)
		}
	}
}

func TestSubmitDeviceToDeviceFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	s := newStream(t, drv)
	c := newCopier(t, drv, Options{Method: MethodKernel, PTX: fakePTX})
	const n = 64 << 10
	a, b := devMem(t, drv, n), devMem(t, drv, n)
	src, back := hostMem(t, drv, n), hostMem(t, drv, n)
	_, _ = rand.Read(src)
	require.NoError(t, drv.Memcpy(a, cuda.DevicePtr(addr(src)), n))
	run(t, drv, c, s, D2D, []Segment{{Dst: uint64(b), Src: uint64(a) + n/2, Len: n / 2}, {Dst: uint64(b) + n/2, Src: uint64(a), Len: n / 2}})
	require.NoError(t, drv.Memcpy(cuda.DevicePtr(addr(back)), b, n))
	require.Equal(t, src[n/2:], back[:n/2])
	require.Equal(t, src[:n/2], back[n/2:])
}

// Without CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM the kernel path needs the
// host range registered with the Copier.
func TestKernelNeedsHostRangeWithoutIdentity(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{Attributes: map[cuda.Attribute]int{cuda.AttrCanUseHostPointerForRegisteredMem: 0}})
	s := newStream(t, drv)
	c := newCopier(t, drv, Options{Method: MethodKernel, PTX: fakePTX})
	require.False(t, c.Capabilities().HostPointerIdentity)
	l := crossLayer(4, 4<<10)
	n := l.bytes()
	src, dst := hostMem(t, drv, n), hostMem(t, drv, n)
	dev := devMem(t, drv, n)
	h2d, d2h := l.segments(addr(src), uint64(dev), addr(dst), mrand.New(mrand.NewPCG(1, 2)))
	_, err := c.Submit(s, H2D, h2d)
	require.ErrorIs(t, err, ErrUnregisteredHost)

	_, _ = rand.Read(src)
	require.NoError(t, c.AddHostRange(uintptr(addr(src)), n))
	require.NoError(t, c.AddHostRange(uintptr(addr(dst)), n))
	require.ErrorIs(t, c.AddHostRange(uintptr(addr(dst))+16, 16), ErrInvalidOption, "overlap")
	run(t, drv, c, s, H2D, h2d)
	run(t, drv, c, s, D2H, d2h)
	require.Equal(t, src, dst)
	require.NoError(t, c.RemoveHostRange(uintptr(addr(src))))
	require.ErrorIs(t, c.RemoveHostRange(uintptr(addr(src))), ErrInvalidOption)
	_, err = c.Submit(s, H2D, h2d)
	require.ErrorIs(t, err, ErrUnregisteredHost)
	require.NoError(t, c.RemoveHostRange(uintptr(addr(dst))))
}

func TestFillAndChecksumFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	s := newStream(t, drv)
	c := newCopier(t, drv, Options{PTX: fakePTX, ChunkBytes: 4096, DescCapacity: 3})
	fillAndChecksum(t, drv, c, s)
}

// fillAndChecksum fills two device ranges with kvo_fill (split in chunks and
// launches), checksums four spans with kvo_checksum and compares both with
// FillPattern and HostChecksum; then checks the helpers' input validation.
func fillAndChecksum(t *testing.T, drv cuda.Driver, c *Copier, s cuda.Stream) {
	const n = 40 << 10
	dev := devMem(t, drv, n)
	out := devMem(t, drv, 8*4)
	fills := []FillSegment{{Dst: uint64(dev), Len: 10 << 10, Seed: 1}, {Dst: uint64(dev) + 10<<10, Len: 30 << 10, Seed: 1 << 40}}
	tk, err := c.Fill(s, fills, 1000)
	require.NoError(t, err)
	waitRetire(t, drv, c, s, tk)
	spans := []Span{{Addr: uint64(dev), Len: 10 << 10}, {Addr: uint64(dev) + 10<<10, Len: 30 << 10}, {Addr: uint64(dev), Len: 8}, {Addr: uint64(dev), Len: n}}
	tk, err = c.Checksum(s, spans, out)
	require.NoError(t, err)
	waitRetire(t, drv, c, s, tk)

	host := hostMem(t, drv, n+32)
	require.NoError(t, drv.Memcpy(cuda.DevicePtr(addr(host)), dev, n))
	require.NoError(t, drv.Memcpy(cuda.DevicePtr(addr(host)+n), out, 32))
	want := make([]byte, n)
	FillPattern(1, want[:10<<10])
	FillPattern(1<<40, want[10<<10:])
	require.Equal(t, want, host[:n])
	for i, sp := range spans {
		off := sp.Addr - uint64(dev)
		require.Equal(t, HostChecksum(want[off:off+sp.Len]), binary.LittleEndian.Uint64(host[n+8*i:]), "span %d", i)
	}

	_, err = c.Fill(s, []FillSegment{{Dst: uint64(dev), Len: 12}}, 0)
	require.ErrorIs(t, err, ErrMisaligned)
	_, err = c.Checksum(s, spans, out+4)
	require.ErrorIs(t, err, ErrMisaligned)
	_, err = c.Checksum(s, nil, out)
	require.ErrorIs(t, err, ErrInvalidSegment)
	_, err = c.Fill(s, []FillSegment{{Dst: 0, Len: 8}}, 0)
	require.ErrorIs(t, err, ErrInvalidSegment)
}

func TestNewErrors(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{NoMemcpyBatch: true})
	tests := []struct {
		name string
		opts Options
		want error
	}{
		{"batch forced without the API", Options{Method: MethodBatch, PTX: fakePTX}, ErrUnavailable},
		{"too many CTAs", Options{CTAs: 133, PTX: fakePTX}, ErrInvalidOption},
		{"threads not a warp multiple", Options{Threads: 100, PTX: fakePTX}, ErrInvalidOption},
		{"negative staged CTAs", Options{StagedCTAs: -1, PTX: fakePTX}, ErrInvalidOption},
		{"too many staged CTAs", Options{StagedCTAs: 133, PTX: fakePTX}, ErrInvalidOption},
		{"chunk too small", Options{ChunkBytes: 256, PTX: fakePTX}, ErrInvalidOption},
		{"chunk misaligned", Options{ChunkBytes: 4100, PTX: fakePTX}, ErrInvalidOption},
		{"bad method", Options{Method: 9}, ErrInvalidOption},
		{"unknown copy kernel", Options{CopyKernel: "kvo_memcpy", PTX: fakePTX}, ErrInvalidOption},
		{"fence bytes with another kernel", Options{CopyKernel: DefaultCopyKernel, FenceBytes: FenceUnit, PTX: fakePTX}, ErrInvalidOption},
		{"fence bytes with the greedy D2H launch", Options{GreedyD2H: true, FenceBytes: FenceUnit, PTX: fakePTX}, ErrInvalidOption},
		{"fence bytes not a unit multiple", Options{CopyKernel: SysFenceCopyKernel, FenceBytes: FenceUnit + 16, PTX: fakePTX}, ErrInvalidOption},
		{"negative fence bytes", Options{CopyKernel: SysFenceCopyKernel, FenceBytes: -FenceUnit, PTX: fakePTX}, ErrInvalidOption},
		{"pace with another kernel", Options{CopyKernel: StreamingCopyKernel, PaceGBps: 50, PTX: fakePTX}, ErrInvalidOption},
		{"negative pace", Options{CopyKernel: SysFenceCopyKernel, PaceGBps: -1, PTX: fakePTX}, ErrInvalidOption},
		{"NaN pace", Options{CopyKernel: SysFenceCopyKernel, PaceGBps: math.NaN(), PTX: fakePTX}, ErrInvalidOption},
		{"streaming kernel absent from the PTX", Options{Method: MethodKernel, CopyKernel: StreamingCopyKernel, PTX: fakePTX}, ErrUnavailable},
		{"bad calibration", Options{Calibration: &Calibration{Entries: []Measurement{{}}}}, ErrInvalidOption},
		{"bad calibration sizes", Options{Calibrate: CalibrationConfig{TotalBytes: 4096, SegSizes: []uint64{8192}}}, ErrInvalidOption},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(drv, 0, tc.opts)
			require.ErrorIs(t, err, tc.want)
		})
	}
	// A module that does not load makes a forced kernel an error...
	drv.FailAt(cuda.OpModuleLoadData, drv.Calls(cuda.OpModuleLoadData)+1, cuda.ErrorInvalidImage)
	_, err := New(drv, 0, Options{Method: MethodKernel})
	require.ErrorIs(t, err, ErrUnavailable)
	require.True(t, cuda.IsCode(err, cuda.ErrorInvalidImage), "%v", err)
	// ...and otherwise leaves the Copier to the DMA methods.
	drv.FailAt(cuda.OpModuleLoadData, drv.Calls(cuda.OpModuleLoadData)+1, cuda.ErrorInvalidImage)
	c := newCopier(t, drv, Options{})
	caps := c.Capabilities()
	require.False(t, caps.Kernel)
	require.False(t, caps.Batch)
	require.Contains(t, caps.KernelError, "CUDA_ERROR_INVALID_IMAGE")
	require.Equal(t, MethodMemcpy, c.Choose(H2D, segsOf(8, 4096, 0)))
	_, err = c.Fill(0, []FillSegment{{Dst: 8, Len: 8}}, 0)
	require.ErrorIs(t, err, ErrUnavailable)
}

// TestStagedLaunch: the staged copies' device-side kernel has a grid of
// its own, StagedCTAs (default DefaultStagedCTAs), which CTAs does not set.
func TestStagedLaunch(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	def := newCopier(t, drv, Options{PTX: fakePTX}).Capabilities()
	require.Equal(t, DefaultStagedCTAs, def.Staged.CTAs)
	require.Equal(t, def.H2D.Threads, def.Staged.Threads)
	require.Equal(t, def.H2D.Kernel, def.Staged.Kernel)
	wide := newCopier(t, drv, Options{StagedCTAs: 32, CTAs: 2, PTX: fakePTX}).Capabilities()
	require.Equal(t, 32, wide.Staged.CTAs)
	require.Equal(t, 2, wide.H2D.CTAs)
	require.Equal(t, DefaultStagedCTAs, newCopier(t, drv, Options{CTAs: 2, PTX: fakePTX}).Capabilities().Staged.CTAs)
}

func TestSubmitValidationEnqueuesNothing(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	s := newStream(t, drv)
	c := newCopier(t, drv, Options{Method: MethodKernel, PTX: fakePTX})
	auto := newCopier(t, drv, Options{PTX: fakePTX})
	before := drv.Calls(cuda.OpMemcpyAsync) + drv.Calls(cuda.OpLaunchKernel)
	good := Segment{Dst: 0x10000, Src: 0x20000, Len: 4096}
	for _, tc := range []struct {
		c    *Copier
		dir  Path
		segs []Segment
		want error
	}{
		{c, H2D, nil, ErrInvalidSegment},
		{c, H2D, []Segment{good, {Dst: 0x10000, Src: 0x20000}}, ErrInvalidSegment},
		{c, H2D, []Segment{good, {Dst: 0x10008, Src: 0x20000, Len: 4096}}, ErrMisaligned},
		{c, Path(0), []Segment{good}, ErrInvalidOption},
		{auto, D2H, []Segment{good, {Src: 0x10000, Len: 8}}, ErrInvalidSegment},
	} {
		_, err := tc.c.Submit(s, tc.dir, tc.segs)
		require.ErrorIs(t, err, tc.want)
	}
	require.Equal(t, before, drv.Calls(cuda.OpMemcpyAsync)+drv.Calls(cuda.OpLaunchKernel))
}

func TestTicketsAndClose(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	s := newStream(t, drv)
	c, err := New(drv, 0, Options{Method: MethodKernel, PTX: fakePTX, DescBuffers: 1, DescCapacity: 2})
	require.NoError(t, err)
	l := crossLayer(5, 4096)
	src, dst := hostMem(t, drv, l.bytes()), hostMem(t, drv, l.bytes())
	dev := devMem(t, drv, l.bytes())
	h2d, _ := l.segments(addr(src), uint64(dev), addr(dst), mrand.New(mrand.NewPCG(3, 4)))

	t1, err := c.Submit(s, H2D, h2d) // 5 descriptors: 3 buffers, 2 allocated on demand
	require.NoError(t, err)
	require.True(t, t1.Holds())
	t2, err := c.Submit(s, H2D, h2d[:1])
	require.NoError(t, err)
	require.ErrorIs(t, c.Close(), ErrInFlight)
	require.NoError(t, drv.StreamSynchronize(s))
	require.NoError(t, c.Retire(t1))
	require.ErrorIs(t, c.Retire(t1), ErrStaleTicket)
	require.ErrorIs(t, c.Retire(Ticket{idx: 99}), ErrStaleTicket)
	require.NoError(t, c.Retire(Ticket{}), "the zero ticket holds nothing")
	// A reused record has a new generation: the old ticket stays stale.
	t3, err := c.Submit(s, H2D, h2d[:1])
	require.NoError(t, err)
	require.NoError(t, drv.StreamSynchronize(s))
	require.ErrorIs(t, c.Retire(t1), ErrStaleTicket)
	require.NoError(t, c.Retire(t2))
	require.NoError(t, c.Retire(t3))
	require.NoError(t, c.Close())
	require.NoError(t, c.Close(), "Close is idempotent")
	_, err = c.Submit(s, H2D, h2d)
	require.ErrorIs(t, err, ErrClosed)
	require.ErrorIs(t, c.AddHostRange(0x1000, 4096), ErrClosed)
}

// A launch that fails part-way returns the zero Ticket; the buffers enqueued
// work may still read are withdrawn, the rest go back, and later batches
// run on fresh buffers.
func TestLaunchFailureWithdrawsBuffers(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	s := newStream(t, drv)
	c := newCopier(t, drv, Options{Method: MethodKernel, PTX: fakePTX, DescBuffers: 3, DescCapacity: 2})
	l := crossLayer(6, 4096)
	src, dst := hostMem(t, drv, l.bytes()), hostMem(t, drv, l.bytes())
	dev := devMem(t, drv, l.bytes())
	h2d, d2h := l.segments(addr(src), uint64(dev), addr(dst), mrand.New(mrand.NewPCG(5, 6)))
	drv.FailAt(cuda.OpLaunchKernel, 2, cuda.ErrorInvalidValue)
	tk, err := c.Submit(s, H2D, h2d)
	require.True(t, cuda.IsCode(err, cuda.ErrorInvalidValue), "%v", err)
	require.False(t, tk.Holds())
	require.NoError(t, drv.StreamSynchronize(s))
	c.mu.Lock()
	free, all := len(c.free), len(c.all)
	c.mu.Unlock()
	require.Equal(t, 3, all)
	require.Equal(t, 1, free, "two buffers had work enqueued")

	_, _ = rand.Read(src)
	run(t, drv, c, s, H2D, h2d)
	run(t, drv, c, s, D2H, d2h)
	require.Equal(t, src, dst)

	drv.FailAt(cuda.OpMemcpyAsync, drv.Calls(cuda.OpMemcpyAsync)+1, cuda.ErrorInvalidValue)
	_, err = c.Submit(s, H2D, h2d)
	require.Error(t, err)
	drv.FailAt(cuda.OpMemHostAlloc, drv.Calls(cuda.OpMemHostAlloc)+1, cuda.ErrorOutOfMemory)
	_, err = c.Submit(s, H2D, h2d)
	require.True(t, cuda.IsCode(err, cuda.ErrorOutOfMemory), "%v", err)
	require.NoError(t, drv.StreamSynchronize(s))
}

func TestMemcpyAndBatchErrorsName(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	s := newStream(t, drv)
	l := crossLayer(4, 4096)
	src, dst := hostMem(t, drv, l.bytes()), hostMem(t, drv, l.bytes())
	dev := devMem(t, drv, l.bytes())
	h2d, _ := l.segments(addr(src), uint64(dev), addr(dst), mrand.New(mrand.NewPCG(7, 8)))
	mc := newCopier(t, drv, Options{Method: MethodMemcpy})
	drv.FailAt(cuda.OpMemcpyAsync, drv.Calls(cuda.OpMemcpyAsync)+3, cuda.ErrorInvalidValue)
	_, err := mc.Submit(s, H2D, h2d)
	require.ErrorContains(t, err, "segment 2 of 4")
	bc := newCopier(t, drv, Options{Method: MethodBatch, BatchMax: 3})
	drv.FailAt(cuda.OpMemcpyBatchAsync, drv.Calls(cuda.OpMemcpyBatchAsync)+2, cuda.ErrorInvalidValue)
	_, err = bc.Submit(s, H2D, h2d)
	require.ErrorContains(t, err, "segments [3, 4) of 4")
	require.NoError(t, drv.StreamSynchronize(s))
}

func TestCalibrateFake(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	s := newStream(t, drv)
	c := newCopier(t, drv, Options{PTX: fakePTX, Calibrate: CalibrationConfig{TotalBytes: 64 << 10, SegSizes: []uint64{4 << 10, 16 << 10}, Reps: 1}})
	require.Nil(t, c.Calibration())
	cal, err := c.Calibrate(s)
	require.NoError(t, err)
	require.Len(t, cal.Entries, 2*2*3, "2 directions x 2 sizes x 3 methods")
	require.NoError(t, cal.Validate())
	for _, e := range cal.Entries {
		require.Positive(t, e.GBps)
	}
	require.Same(t, cal, c.Calibration())
	m := c.Choose(H2D, segsOf(16, 4<<10, 0))
	require.NotEqual(t, MethodAuto, m)
	require.NoError(t, c.SetCalibration(nil))
	require.Equal(t, MethodKernel, c.Choose(H2D, segsOf(16, 4<<10, 0)))
	require.ErrorIs(t, c.SetCalibration(&Calibration{Entries: []Measurement{{Dir: 5}}}), ErrInvalidOption)
}

// nullDriver accepts every call the copy paths make and does nothing, so
// that allocation counts measure the Copier alone.
type nullDriver struct {
	cuda.Driver
	bufs [][]byte
}

func (d *nullDriver) DeviceAttribute(a cuda.Attribute, _ cuda.Device) (int, error) {
	if a == cuda.AttrMultiprocessorCount {
		return 132, nil
	}
	return 1, nil
}
func (d *nullDriver) HasMemcpyBatch() bool                                         { return true }
func (d *nullDriver) ModuleLoadData([]byte) (cuda.Module, error)                   { return 1, nil }
func (d *nullDriver) ModuleGetFunction(cuda.Module, string) (cuda.Function, error) { return 2, nil }
func (d *nullDriver) ModuleUnload(cuda.Module) error                               { return nil }
func (d *nullDriver) MemHostAlloc(n uint64, _ uint32) (unsafe.Pointer, error) {
	b := make([]byte, n)
	d.bufs = append(d.bufs, b)
	return unsafe.Pointer(&b[0]), nil
}
func (d *nullDriver) MemFreeHost(unsafe.Pointer) error        { return nil }
func (d *nullDriver) MemAlloc(uint64) (cuda.DevicePtr, error) { return 0x7000000, nil }
func (d *nullDriver) MemFree(cuda.DevicePtr) error            { return nil }
func (d *nullDriver) MemcpyAsync(_, _ cuda.DevicePtr, _ uint64, _ cuda.Stream) error {
	return nil
}
func (d *nullDriver) MemcpyBatchAsync([]cuda.BatchCopy, cuda.Stream) error { return nil }
func (d *nullDriver) EventCreate(uint32) (cuda.Event, error)               { return 3, nil }
func (d *nullDriver) EventDestroy(cuda.Event) error                        { return nil }
func (d *nullDriver) EventRecord(cuda.Event, cuda.Stream) error            { return nil }
func (d *nullDriver) EventSynchronize(cuda.Event) error                    { return nil }
func (d *nullDriver) StreamCreate(uint32, int) (cuda.Stream, error)        { return 4, nil }
func (d *nullDriver) StreamDestroy(cuda.Stream) error                      { return nil }
func (d *nullDriver) StreamIsCapturing(cuda.Stream) (cuda.CaptureStatus, error) {
	return cuda.CaptureStatusNone, nil
}
func (d *nullDriver) StreamWaitEvent(cuda.Stream, cuda.Event, uint32) error {
	return nil
}
func (d *nullDriver) LaunchKernel(cuda.Function, cuda.Dim3, cuda.Dim3, uint32, cuda.Stream, ...[]byte) error {
	return nil
}

// Steady-state Submit and Retire allocate nothing, for every method.
func TestSubmitDoesNotAllocate(t *testing.T) {
	if raceEnabled {
		t.Skip("sync.Pool drops items at random under -race")
	}
	segs := segsOf(300, 4096, 0)
	for _, m := range []Method{MethodMemcpy, MethodBatch, MethodKernel, MethodAuto} {
		c, err := New(&nullDriver{}, 0, Options{Method: m, DescCapacity: 128, PTX: fakePTX, BatchMax: 64, Calibration: h200Table()})
		require.NoError(t, err)
		var failed error
		allocs := testing.AllocsPerRun(20, func() {
			tk, err := c.Submit(1, H2D, segs)
			failed = errors.Join(failed, err, c.Retire(tk))
		})
		require.NoError(t, failed)
		require.Zero(t, allocs, "method %v", m)
		require.NoError(t, c.Close())
	}
}

// The embedded PTX, when present, holds every kernel New can look up (the
// copy kernels, the default D2H one among them, kvo_fill, kvo_checksum, and
// the marker of 2-D descriptors).
func TestEmbeddedPTX(t *testing.T) {
	b, err := PTX()
	if err != nil {
		require.ErrorIs(t, err, ErrUnavailable)
		return
	}
	names := []string{"kvo_fill", "kvo_checksum", Desc2DKernel}
	for _, k := range copyKernels {
		names = append(names, k.name)
	}
	require.Contains(t, names, DefaultLaunch(D2H, false).Kernel)
	for _, k := range names {
		require.Contains(t, string(b), ".entry "+k+"(")
	}
	require.Contains(t, string(b), ".target sm_80")
}

// A kernel launch's descriptor table is uploaded on the Copier's upload
// stream and the launch waits for it: with copies and kernels delayed at
// random, a launch that ran before its upload would read another batch's
// table (or a blank one) and the round trip would differ. The copy stream
// itself sees only waits and launches; with UploadOnCopyStream the uploads
// are back on it, one before each launch.
func TestKernelLaunchWaitsForItsUpload(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{Seed: 3, CopyMinDelay: 200 * time.Microsecond, CopyMaxDelay: 2 * time.Millisecond})
	rec := &streamLog{Driver: drv}
	s := newStream(t, drv)
	for _, inline := range []bool{false, true} {
		// Four descriptors a table: each batch spans several tables, and
		// every round trip reuses the tables of the one before.
		c := newCopier(t, rec, Options{Method: MethodKernel, PTX: fakePTX, DescCapacity: 4, UploadOnCopyStream: inline})
		for i, l := range []layout{crossLayer(9, 4<<10), layerSeparate(6, 3, 4<<10), crossLayer(5, 12<<10)} {
			rec.ops = nil
			roundTrip(t, drv, c, s, l, uint64(10+i))
			var onS []string
			uploads := 0
			for _, o := range rec.ops {
				if o.op == cuda.OpMemcpyAsync {
					uploads++
				}
				if o.s == s {
					onS = append(onS, o.op)
				}
			}
			require.NotZero(t, uploads)
			for k, op := range onS {
				if op != cuda.OpLaunchKernel {
					continue
				}
				want := cuda.OpStreamWaitEvent
				if inline {
					want = cuda.OpMemcpyAsync
				}
				require.True(t, k > 0 && onS[k-1] == want, "inline %v: launch %d on the copy stream follows %v, want %s: %v", inline, k, onS[max(k-1, 0)], want, onS)
			}
			if !inline {
				require.NotContains(t, onS, cuda.OpMemcpyAsync, "uploads on the copy stream: %v", onS)
			}
		}
	}
}

// On a stream capturing a graph the tables are uploaded in line: a captured
// launch may not wait on work outside the capture (the driver fails it with
// CUDA_ERROR_STREAM_CAPTURE_ISOLATION).
func TestCapturedLaunchUploadsInLine(t *testing.T) {
	drv := cudatest.OpenFake(t, cudafake.Options{})
	rec := &streamLog{Driver: drv}
	s := newStream(t, drv)
	c := newCopier(t, rec, Options{PTX: fakePTX, DescCapacity: 4})
	dev := devMem(t, drv, 64<<10)
	out := devMem(t, drv, 8*16)
	spans := make([]Span, 16)
	for i := range spans {
		spans[i] = Span{Addr: uint64(dev) + uint64(i*4096), Len: 4096}
	}
	require.NoError(t, drv.StreamBeginCapture(s, cuda.CaptureModeRelaxed))
	tk, err := c.Checksum(s, spans, out)
	require.NoError(t, err)
	g, err := drv.StreamEndCapture(s)
	require.NoError(t, err)
	require.NoError(t, drv.GraphDestroy(g))
	var onS []string
	for _, o := range rec.ops {
		require.Equal(t, s, o.s, "%s outside the capturing stream", o.op)
		onS = append(onS, o.op)
	}
	want := []string{}
	for range 4 {
		want = append(want, cuda.OpMemcpyAsync, cuda.OpLaunchKernel)
	}
	require.Equal(t, want, onS)
	require.NoError(t, c.Retire(tk))
}
