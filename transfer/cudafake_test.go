package transfer_test

import (
	"bytes"
	"math/rand"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	. "github.com/kvoffload/kvoffload/internal/cudadev"
	. "github.com/kvoffload/kvoffload/transfer"
)

// fakeEnv is the CUDA Device over the fake driver, with one device
// allocation and one registered host buffer known to a Scheduler.
type fakeEnv struct {
	drv       *cudafake.Driver
	cu        *CUDA
	s         *Scheduler
	dev, host uint64
	hostBuf   []byte
	size      uint64
}

func newFakeEnv(t *testing.T, size uint64, method cudacopy.Method, opts cudafake.Options) *fakeEnv {
	t.Helper()
	return newFakeEnvCopier(t, size, cudacopy.Options{Method: method}, opts)
}

func newFakeEnvCopier(t *testing.T, size uint64, copts cudacopy.Options, opts cudafake.Options) *fakeEnv {
	t.Helper()
	return newFakeEnvBuilders(t, size, copts, opts, 1)
}

// newFakeEnvBuilders is newFakeEnvCopier with the scheduler's builders
// given (the others: one, so that parts are built in order).
func newFakeEnvBuilders(t *testing.T, size uint64, copts cudacopy.Options, opts cudafake.Options, builders int) *fakeEnv {
	t.Helper()
	return newFakeEnvConfig(t, size, copts, opts, Config{Builders: builders})
}

// newFakeEnvConfig is newFakeEnvBuilders with the scheduler's Config given
// (its Tracker and poll timings are the env's).
func newFakeEnvConfig(t testing.TB, size uint64, copts cudacopy.Options, opts cudafake.Options, cfg Config) *fakeEnv {
	t.Helper()
	opts.CheckContext = true
	d := cudafake.New(opts)
	runtime.LockOSThread()
	ctx, err := d.PrimaryCtxRetain(0)
	require.NoError(t, err)
	require.NoError(t, d.CtxSetCurrent(ctx))
	hb, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	require.NoError(t, err)
	p := unsafe.Pointer(&hb[0])
	require.NoError(t, d.MemHostRegister(p, size, cuda.HostRegisterPortable|cuda.HostRegisterDeviceMap))
	dp, err := d.MemAlloc(size)
	require.NoError(t, err)
	cu, err := NewOn(d, 0, ctx, copts)
	require.NoError(t, err)
	tr := NewTracker(nil)
	host := uint64(uintptr(p))
	require.NoError(t, tr.Live(host, size))
	cfg.Tracker, cfg.PollSpin, cfg.PollMaxSleep = tr, time.Microsecond, 50*time.Microsecond
	s, err := New(cu, cfg)
	require.NoError(t, err)
	require.NoError(t, s.AddHostRange(host, size))
	require.NoError(t, s.AddDeviceRange(uint64(dp), size))
	t.Cleanup(func() {
		defer runtime.UnlockOSThread()
		require.NoError(t, s.Close())
		require.Empty(t, tr.Violations())
		if err := cu.Close(); err != nil && !cuda.IsSticky(err) {
			require.NoError(t, err)
		}
		_ = d.MemFree(dp)
		_ = d.MemHostUnregister(p)
		require.NoError(t, unix.Munmap(hb))
		_ = d.PrimaryCtxRelease(0)
		require.NoError(t, d.Close())
	})
	return &fakeEnv{drv: d, cu: cu, s: s, dev: uint64(dp), host: host, hostBuf: hb, size: size}
}

func TestCUDAOverFakeRoundTrip(t *testing.T) {
	for _, m := range []cudacopy.Method{cudacopy.MethodMemcpy, cudacopy.MethodBatch, cudacopy.MethodKernel, cudacopy.MethodAuto} {
		t.Run(m.String(), func(t *testing.T) {
			const seg, n = 4096, 64
			e := newFakeEnv(t, 2*seg*n, m, cudafake.Options{Seed: 1, MaxDelay: 20 * time.Microsecond})
			r := rand.New(rand.NewSource(2))
			src := randBytes(r, seg*n)
			// Stage through the upper half of the registered host buffer.
			copy(e.hostBuf[seg*n:], src)
			require.NoError(t, e.drv.Memcpy(cuda.DevicePtr(e.dev), cuda.DevicePtr(e.host+seg*n), seg*n))
			perm := r.Perm(n)
			var st, ld []Segment
			for b := range n {
				slot := uint64(perm[b]) * seg
				st = append(st, Segment{Dev: e.dev + uint64(b)*seg, Host: e.host + slot, Len: seg})
				ld = append(ld, Segment{Dev: e.dev + seg*n + uint64(b)*seg, Host: e.host + slot, Len: seg})
			}
			var ops []*Op
			for i := 0; i < n; i += 8 {
				op, err := e.s.Submit(Request{Dir: Store, Segments: st[i : i+8]})
				require.NoError(t, err)
				ops = append(ops, op)
			}
			for _, op := range ops {
				require.NoError(t, op.Wait())
			}
			op, err := e.s.Submit(Request{Dir: Load, Segments: ld, LayerEnds: []int{n / 2, n}, Events: true})
			require.NoError(t, err)
			require.NoError(t, op.Wait())
			require.NoError(t, op.Release())
			clear(e.hostBuf[seg*n:])
			require.NoError(t, e.drv.Memcpy(cuda.DevicePtr(e.host+seg*n), cuda.DevicePtr(e.dev+seg*n), seg*n))
			require.True(t, bytes.Equal(src, e.hostBuf[seg*n:]))
		})
	}
}

// TestCUDAOverFakeSticky: a store held behind a caller event that never
// completes; the context is lost; the store fails with the driver's error
// and new work is refused with it.
func TestCUDAOverFakeSticky(t *testing.T) {
	e := newFakeEnv(t, 1<<20, cudacopy.MethodMemcpy, cudafake.Options{})
	cs, err := e.drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(t, err)
	defer func() { _ = e.drv.StreamDestroy(cs) }()
	ev, err := e.drv.EventCreate(cuda.EventDisableTiming)
	require.NoError(t, err)
	defer func() { _ = e.drv.EventDestroy(ev) }()
	e.drv.HangAt(cuda.OpEventRecord, e.drv.Calls(cuda.OpEventRecord)+1)
	require.NoError(t, e.drv.EventRecord(ev, cs))
	op, err := e.s.Submit(Request{Dir: Store, After: Event(ev), AfterStream: streamPtr(cs), Segments: []Segment{{Dev: e.dev, Host: e.host, Len: 4096}}})
	require.NoError(t, err)
	e.drv.MakeSticky(cuda.ErrorIllegalAddress)
	err = op.Wait()
	require.ErrorIs(t, err, ErrDeviceLost)
	require.True(t, cuda.IsCode(err, cuda.ErrorIllegalAddress), "the driver's error: %v", err)
	_, err = e.s.Submit(Request{Dir: Load, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: 4096}}})
	require.ErrorIs(t, err, ErrDeviceLost)
}

// TestCUDAOverFakeCapture: the test thread captures its stream in global
// mode while the engine stores, loads and polls; the capture must survive
// (engine threads are in relaxed mode), and a capturing After stream is
// refused.
func TestCUDAOverFakeCapture(t *testing.T) {
	e := newFakeEnv(t, 1<<20, cudacopy.MethodAuto, cudafake.Options{Seed: 3, MaxDelay: 10 * time.Microsecond})
	cs, err := e.drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(t, err)
	defer func() { _ = e.drv.StreamDestroy(cs) }()
	ev, err := e.drv.EventCreate(cuda.EventDisableTiming)
	require.NoError(t, err)
	defer func() { _ = e.drv.EventDestroy(ev) }()
	require.NoError(t, e.drv.StreamBeginCapture(cs, cuda.CaptureModeGlobal))
	require.NoError(t, e.drv.EventRecord(ev, cs))
	_, err = e.s.Submit(Request{Dir: Store, After: Event(ev), AfterStream: streamPtr(cs), Segments: []Segment{{Dev: e.dev, Host: e.host, Len: 4096}}})
	require.ErrorIs(t, err, ErrCapturing)
	for i := range 20 {
		seg := []Segment{{Dev: e.dev + uint64(i)*4096, Host: e.host + uint64(i)*4096, Len: 4096}}
		st, err := e.s.Submit(Request{Dir: Store, Segments: seg})
		require.NoError(t, err)
		ld, err := e.s.Submit(Request{Dir: Load, Segments: seg, Events: true})
		require.NoError(t, err)
		require.NoError(t, st.Wait())
		require.NoError(t, ld.Wait())
		require.NoError(t, ld.Release())
	}
	g, err := e.drv.StreamEndCapture(cs)
	require.NoError(t, err, "the engine invalidated a global-mode capture")
	require.NoError(t, e.drv.GraphDestroy(g))
}

// TestCUDAOverFakeGatheredStore: stores of whole blocks (16 segments of
// 16 KiB from different device tensors, back to back in the block's host
// slot) are gathered on the device and copied to the host in one DMA per
// block, after the caller's event (Request.After) even when the producer
// behind it is slow, and arrive byte-exact.
func TestCUDAOverFakeGatheredStore(t *testing.T) {
	const seg, per, blocks = 16 << 10, 16, 12
	const n = seg * per * blocks
	e := newFakeEnvCopier(t, 2*n, cudacopy.Options{Calibration: &cudacopy.Calibration{}, GatherChunkBytes: 1 << 20},
		cudafake.Options{Seed: 3, MaxDelay: 20 * time.Microsecond})
	r := rand.New(rand.NewSource(4))
	want := make([]byte, n)
	clear(e.hostBuf)
	require.NoError(t, e.drv.MemsetD8(cuda.DevicePtr(e.dev), 0xDD, n))
	require.NoError(t, e.drv.CtxSynchronize())
	p, fill, ev := slowProducer(t, e, n)
	cudacopy.FillPattern(0, want)
	st := wholeBlocks(e, r, seg, per, blocks)
	copier := e.cu.Copier()
	require.True(t, copier.Gatherable(toCopier(st[:4*per])), "whole blocks gather")
	submitAfter(t, e, Store, st, 4*per, ev)
	require.NoError(t, e.drv.StreamSynchronize(p))
	require.NoError(t, copier.Retire(fill))
	for _, sg := range st {
		off := sg.Dev - e.dev
		h := sg.Host - e.host
		require.Equal(t, want[off:off+seg], e.hostBuf[h:h+seg], "device offset %d", off)
	}
	require.Positive(t, copier.Gathers(), "the stores were gathered")
}

// TestCUDAOverFakeScatteredLoad: loads of whole blocks (16 segments of
// 16 KiB, back to back in the block's host slot, to different device
// tensors) are copied into device staging in one DMA per block and
// scattered on the device, after the caller's event (Request.After): a slow
// fill of the destination behind that event must not overwrite them.
func TestCUDAOverFakeScatteredLoad(t *testing.T) {
	const seg, per, blocks = 16 << 10, 16, 12
	const n = seg * per * blocks
	e := newFakeEnvCopier(t, 2*n, cudacopy.Options{Calibration: &cudacopy.Calibration{}, GatherChunkBytes: 1 << 20},
		cudafake.Options{Seed: 5, MaxDelay: 20 * time.Microsecond})
	r := rand.New(rand.NewSource(6))
	_, _ = r.Read(e.hostBuf[:n])
	p, fill, ev := slowProducer(t, e, n)
	ld := wholeBlocks(e, r, seg, per, blocks)
	copier := e.cu.Copier()
	before := e.cu.BounceCopies()
	require.True(t, copier.Scatterable(toCopierLoad(ld[:4*per])), "whole blocks scatter")
	submitAfter(t, e, Load, ld, 4*per, ev)
	require.NoError(t, e.drv.StreamSynchronize(p))
	require.NoError(t, copier.Retire(fill))
	back := e.hostBuf[n : 2*n]
	require.NoError(t, e.drv.Memcpy(cuda.DevicePtr(e.host+n), cuda.DevicePtr(e.dev), n))
	for _, sg := range ld {
		off, h := sg.Dev-e.dev, sg.Host-e.host
		require.Equal(t, e.hostBuf[h:h+seg], back[off:off+seg], "device offset %d", off)
	}
	require.Greater(t, e.cu.BounceCopies(), before, "the loads were scattered")
}

// wholeBlocks is blocks layer-separate blocks of per segments of seg
// bytes: block b's segment k lives in device tensor k at row dperm[b] and in
// host slot hperm[b] at k*seg, both permutations drawn from r.
func wholeBlocks(e *fakeEnv, r *rand.Rand, seg uint64, per, blocks int) []Segment {
	hperm, dperm := r.Perm(blocks), r.Perm(blocks)
	var segs []Segment
	for b := range blocks {
		for k := range per {
			segs = append(segs, Segment{Dev: e.dev + uint64(k*blocks+dperm[b])*seg, Host: e.host + uint64(hperm[b]*per+k)*seg, Len: seg})
		}
	}
	return segs
}

// submitAfter submits segs in dir as requests of per segments, each after
// ev, and waits for them all.
func submitAfter(t *testing.T, e *fakeEnv, dir Direction, segs []Segment, per int, ev cuda.Event) {
	t.Helper()
	var ops []*Op
	for i := 0; i < len(segs); i += per {
		op, err := e.s.Submit(Request{Dir: dir, Segments: segs[i:min(i+per, len(segs))], After: Event(ev)})
		require.NoError(t, err)
		ops = append(ops, op)
	}
	for _, op := range ops {
		require.NoError(t, op.Wait())
	}
}

// toCopierLoad turns load segments into the copier's H2D form.
func toCopierLoad(segs []Segment) []cudacopy.Segment {
	out := make([]cudacopy.Segment, len(segs))
	for i, g := range segs {
		out[i] = cudacopy.Segment{Dst: g.Dev, Src: g.Host, Len: g.Len}
	}
	return out
}

// slowProducer starts what stores wait for: a spinning fill of the first n
// bytes of e's device buffer on a stream p of the test's, and an event ev
// recorded after it. The caller synchronizes p and retires fill; p and ev
// are destroyed at cleanup.
func slowProducer(t *testing.T, e *fakeEnv, n uint64) (p cuda.Stream, fill cudacopy.Ticket, ev cuda.Event) {
	t.Helper()
	p, err := e.drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, e.drv.StreamDestroy(p)) })
	fill, err = e.cu.Copier().Fill(p, []cudacopy.FillSegment{{Dst: e.dev, Len: n}}, 1<<26)
	require.NoError(t, err)
	ev, err = e.drv.EventCreate(cuda.EventDisableTiming)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, e.drv.EventDestroy(ev)) })
	require.NoError(t, e.drv.EventRecord(ev, p))
	return p, fill, ev
}

// toCopier turns store segments into the copier's D2H form.
func toCopier(segs []Segment) []cudacopy.Segment {
	out := make([]cudacopy.Segment, len(segs))
	for i, g := range segs {
		out[i] = cudacopy.Segment{Dst: g.Host, Src: g.Dev, Len: g.Len}
	}
	return out
}

// TestCUDAOverFakePartialCopyFailure: a gathered store whose second DMA
// call fails after the first chunk's DMA was queued (behind a slow
// producer) reports the failure only once nothing it queued can still
// write the host slots.
func TestCUDAOverFakePartialCopyFailure(t *testing.T) {
	const seg, per, blocks = 16 << 10, 32, 8
	const n = seg * per * blocks
	e := newFakeEnvCopier(t, 2*n, cudacopy.Options{Calibration: &cudacopy.Calibration{}, GatherChunkBytes: 1 << 20},
		cudafake.Options{Seed: 7})
	clear(e.hostBuf)
	p, fill, ev := slowProducer(t, e, n)
	var st []Segment
	for b := range blocks {
		for k := range per {
			st = append(st, Segment{Dev: e.dev + uint64(k*blocks+b)*seg, Host: e.host + uint64(b*per+k)*seg, Len: seg})
		}
	}
	e.drv.FailAt(cuda.OpMemcpyBatchAsync, e.drv.Calls(cuda.OpMemcpyBatchAsync)+2, cuda.ErrorInvalidValue)
	op, err := e.s.Submit(Request{Dir: Store, Segments: st, After: Event(ev)})
	require.NoError(t, err)
	require.Error(t, op.Wait())
	seen := append([]byte(nil), e.hostBuf[:n]...)
	require.NoError(t, e.drv.StreamSynchronize(p))
	require.NoError(t, e.drv.CtxSynchronize())
	require.NoError(t, e.cu.Copier().Retire(fill))
	require.Equal(t, seen, e.hostBuf[:n], "host slots written after the failed store was reported")
}

// TestCUDACloseInFlight: Close with a copy not yet retired refuses and
// keeps everything; once the ticket is retired, Close frees it all.
func TestCUDACloseInFlight(t *testing.T) {
	d := cudafake.New(cudafake.Options{CheckContext: true})
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ctx, err := d.PrimaryCtxRetain(0)
	require.NoError(t, err)
	require.NoError(t, d.CtxSetCurrent(ctx))
	cu, err := NewOn(d, 0, ctx, cudacopy.Options{Method: cudacopy.MethodKernel})
	require.NoError(t, err)
	a, err := d.MemAlloc(1 << 20)
	require.NoError(t, err)
	b, err := d.MemAlloc(1 << 20)
	require.NoError(t, err)
	tk, err := cu.Copier().Submit(cuda.Stream(cu.Stream(Load)), cudacopy.D2D, []cudacopy.Segment{{Dst: uint64(b), Src: uint64(a), Len: 1 << 20}, {Dst: uint64(a), Src: uint64(b) + 4096, Len: 4096}})
	require.NoError(t, err)
	require.ErrorIs(t, cu.Close(), cudacopy.ErrInFlight)
	require.NoError(t, cu.SyncStream(Load))
	require.NoError(t, cu.Copier().Retire(tk))
	require.NoError(t, cu.Close())
	require.NoError(t, d.MemFree(a))
	require.NoError(t, d.MemFree(b))
	require.NoError(t, d.PrimaryCtxRelease(0))
	require.True(t, d.Live().IsZero(), "leaked: %+v", d.Live())
	require.NoError(t, d.Close())
}

// streamPtr is a driver stream as Request.AfterStream takes it.
func streamPtr(s cuda.Stream) *Stream {
	p := Stream(s)
	return &p
}

// TestCUDAOverFakeStrided: 2-D segments go through cudacopy.Submit2D with
// every method (the kernel's 2-D descriptors on the fake driver), mixed
// with contiguous ones in one batch, byte-exact both ways.
func TestCUDAOverFakeStrided(t *testing.T) {
	for _, m := range []cudacopy.Method{cudacopy.MethodMemcpy, cudacopy.MethodBatch, cudacopy.MethodKernel, cudacopy.MethodAuto} {
		t.Run(m.String(), func(t *testing.T) {
			const rows, row, heads = 16, 256, 4
			const blk = rows * row * heads // one block: 4 heads interleaved by token
			const n = 8
			e := newFakeEnv(t, 4*blk*n, m, cudafake.Options{Seed: 3, MaxDelay: 10 * time.Microsecond})
			r := rand.New(rand.NewSource(4))
			src := randBytes(r, blk*n)
			copy(e.hostBuf[3*blk*n:], src)
			require.NoError(t, e.drv.Memcpy(cuda.DevicePtr(e.dev), cuda.DevicePtr(e.host+3*blk*n), blk*n))
			var st, ld []Segment
			for b := uint64(0); b < n; b++ {
				for h := uint64(0); h < heads; h++ {
					host := e.host + b*blk + h*rows*row
					if h == 0 && b%2 == 0 {
						// A contiguous segment in the batch: the first row only.
						st = append(st, Segment{Dev: e.dev + b*blk, Host: host, Len: row})
						ld = append(ld, Segment{Dev: e.dev + blk*n + b*blk, Host: host, Len: row})
						st = append(st, Segment{Dev: e.dev + b*blk + heads*row, Host: host + row, Len: (rows - 1) * row,
							Rows: rows - 1, RowLen: row, DevPitch: heads * row, HostPitch: row})
						ld = append(ld, Segment{Dev: e.dev + blk*n + b*blk + heads*row, Host: host + row, Len: (rows - 1) * row,
							Rows: rows - 1, RowLen: row, DevPitch: heads * row, HostPitch: row})
						continue
					}
					st = append(st, Segment{Dev: e.dev + b*blk + h*row, Host: host, Len: rows * row, Rows: rows, RowLen: row, DevPitch: heads * row, HostPitch: row})
					ld = append(ld, Segment{Dev: e.dev + blk*n + b*blk + h*row, Host: host, Len: rows * row, Rows: rows, RowLen: row, DevPitch: heads * row, HostPitch: row})
				}
			}
			op, err := e.s.Submit(Request{Dir: Store, Segments: st})
			require.NoError(t, err)
			require.NoError(t, op.Wait())
			require.NoError(t, op.Release())
			for b := 0; b < n; b++ {
				for h := 0; h < heads; h++ {
					for k := 0; k < rows; k++ {
						want := src[b*blk+(k*heads+h)*row:][:row]
						got := e.hostBuf[b*blk+(h*rows+k)*row:][:row]
						require.True(t, bytes.Equal(want, got), "block %d head %d row %d", b, h, k)
					}
				}
			}
			require.NoError(t, e.drv.MemsetD8(cuda.DevicePtr(e.dev+blk*n), 0xAB, blk*n))
			op, err = e.s.Submit(Request{Dir: Load, Segments: ld, Events: true})
			require.NoError(t, err)
			require.NoError(t, op.Wait())
			require.NoError(t, op.Release())
			clear(e.hostBuf[3*blk*n:])
			require.NoError(t, e.drv.Memcpy(cuda.DevicePtr(e.host+3*blk*n), cuda.DevicePtr(e.dev+blk*n), blk*n))
			require.True(t, bytes.Equal(src, e.hostBuf[3*blk*n:]), "loaded blocks differ")
		})
	}
}

// TestCUDAOverFakeScatterJoin: the parts of a lazy load of whole blocks
// are scattered copies of their own, and the load stream is left unjoined
// to their scatters (SubmitScatterOpen) so that its DMAs run on; what must
// follow them still does. With every copy and kernel slow and random on
// the fake, the op's completion (its event, recorded on the load stream)
// must find every block on the device, and a later load into the same
// device memory that is not scattered (a lone segment: a plain copy on the
// load stream) must land after the scatter, not under it.
func TestCUDAOverFakeScatterJoin(t *testing.T) {
	const seg, per, blocks, perPart = 16 << 10, 16, 8, 2
	const n = seg * per * blocks
	for round := range 6 {
		e := newFakeEnvCopier(t, 2*n, cudacopy.Options{Calibration: &cudacopy.Calibration{}, GatherChunkBytes: 1 << 20},
			cudafake.Options{Seed: uint64(40 + round), MaxDelay: 20 * time.Microsecond, CopyMinDelay: 50 * time.Microsecond, CopyMaxDelay: 400 * time.Microsecond})
		r := rand.New(rand.NewSource(int64(round)))
		_, _ = r.Read(e.hostBuf[:2*n])
		ld := wholeBlocks(e, r, seg, per, blocks)
		before := e.cu.BounceCopies()
		op, err := e.s.Submit(Request{Dir: Load, Parts: blocks / perPart, Bytes: n, Build: func(p int, dst []Segment) ([]Segment, error) {
			return append(dst, ld[p*perPart*per:(p+1)*perPart*per]...), nil
		}})
		require.NoError(t, err)
		// Then a plain load of the first block's first segment from the
		// other half of the host buffer (a different content).
		first := ld[0]
		// Lazy too: a batch copies its ops' plain segments before the
		// lazy ops' parts, and its lazy parts in the order of their ops.
		last, err := e.s.Submit(Request{Dir: Load, Parts: 1, Bytes: seg, Build: func(_ int, dst []Segment) ([]Segment, error) {
			return append(dst, Segment{Dev: first.Dev, Host: e.host + n, Len: seg}), nil
		}})
		require.NoError(t, err)
		bp, err := e.drv.MemHostAlloc(seg, cuda.HostAllocPortable)
		require.NoError(t, err)
		back := unsafe.Slice((*byte)(bp), seg)
		require.NoError(t, op.Wait())
		// The blocks as the op's completion finds them; segment 0 may
		// already hold the plain load's bytes (it follows).
		for _, sg := range ld[1:] {
			require.NoError(t, e.drv.Memcpy(cuda.DevicePtr(uintptr(bp)), cuda.DevicePtr(sg.Dev), seg))
			h := sg.Host - e.host
			require.Equal(t, e.hostBuf[h:h+seg], back, "round %d: device offset %d at the op's completion", round, sg.Dev-e.dev)
		}
		require.NoError(t, last.Wait())
		require.NoError(t, e.drv.Memcpy(cuda.DevicePtr(uintptr(bp)), cuda.DevicePtr(first.Dev), seg))
		require.Equal(t, e.hostBuf[n:n+seg], back, "round %d: the plain load after the scattered one wins", round)
		require.NoError(t, e.drv.MemFreeHost(bp))
		require.Equal(t, before+blocks/perPart, e.cu.BounceCopies(), "each part was scattered")
	}
}
