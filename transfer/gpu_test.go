package transfer_test

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand"
	"runtime"
	"slices"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	. "github.com/kvoffload/kvoffload/internal/cudadev"
	. "github.com/kvoffload/kvoffload/transfer"
)

// gpuEnv is a Scheduler over the real driver with one registered host
// buffer and one device allocation of the same size.
type gpuEnv struct {
	g         *cudatest.GPU
	cu        *CUDA
	s         *Scheduler
	dev, host uint64
	hostBuf   []byte
	size      uint64
}

func newGPUEnv(tb testing.TB, size uint64, cfg Config) *gpuEnv {
	tb.Helper()
	g := cudatest.Open(tb)
	hb, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	require.NoError(tb, err)
	p := unsafe.Pointer(&hb[0])
	require.NoError(tb, g.Drv.MemHostRegister(p, size, cuda.HostRegisterPortable|cuda.HostRegisterDeviceMap))
	dp, err := g.Drv.MemAlloc(size)
	require.NoError(tb, err)
	cu, err := NewOn(g.Drv, g.Dev, g.Ctx, cudacopy.Options{})
	require.NoError(tb, err)
	s, err := New(cu, cfg)
	require.NoError(tb, err)
	host := uint64(uintptr(p))
	require.NoError(tb, s.AddHostRange(host, size))
	require.NoError(tb, s.AddDeviceRange(uint64(dp), size))
	tb.Cleanup(func() {
		require.NoError(tb, s.Close())
		require.NoError(tb, cu.Close())
		require.NoError(tb, g.Drv.MemFree(dp))
		require.NoError(tb, g.Drv.MemHostUnregister(p))
		require.NoError(tb, unix.Munmap(hb))
	})
	return &gpuEnv{g: g, cu: cu, s: s, dev: uint64(dp), host: host, hostBuf: hb, size: size}
}

func (e *gpuEnv) stream(tb testing.TB) cuda.Stream {
	tb.Helper()
	s, err := e.g.Drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(tb, err)
	tb.Cleanup(func() { require.NoError(tb, e.g.Drv.StreamDestroy(s)) })
	return s
}

func (e *gpuEnv) event(tb testing.TB) cuda.Event {
	tb.Helper()
	ev, err := e.g.Drv.EventCreate(cuda.EventDisableTiming)
	require.NoError(tb, err)
	tb.Cleanup(func() { require.NoError(tb, e.g.Drv.EventDestroy(ev)) })
	return ev
}

// fill runs kvo_fill on s (after spinning spin cycles) and returns a func
// that retires its ticket once s is synchronised.
func (e *gpuEnv) fill(tb testing.TB, s cuda.Stream, segs []cudacopy.FillSegment, spin uint64) func() {
	tb.Helper()
	tk, err := e.cu.Copier().Fill(s, segs, spin)
	require.NoError(tb, err)
	return func() {
		require.NoError(tb, e.g.Drv.StreamSynchronize(s))
		require.NoError(tb, e.cu.Copier().Retire(tk))
	}
}

// gpuLayout is a list of blocks' segments on the device and in host slots.
type gpuLayout struct {
	segs   []Segment // store direction; load uses Dev+loadOff
	blocks int
}

// layout builds nblocks blocks of segsPerBlock segments of segLen bytes:
// device blocks at random block indices (segments of one block spread like
// separate layers), host slots at random slot indices.
func layout(r *rand.Rand, dev, host uint64, nblocks, segsPerBlock int, segLen uint64) gpuLayout {
	var l gpuLayout
	l.blocks = nblocks
	devPerm, hostPerm := r.Perm(nblocks), r.Perm(nblocks)
	blockBytes := uint64(segsPerBlock) * segLen
	for b := range nblocks {
		for k := range segsPerBlock {
			// Layer-separate-like: segment k of every block lives in layer
			// k's array; cross-layer-like when segsPerBlock is 1.
			d := dev + uint64(k)*uint64(nblocks)*segLen + uint64(devPerm[b])*segLen
			h := host + uint64(hostPerm[b])*blockBytes + uint64(k)*segLen
			l.segs = append(l.segs, Segment{Dev: d, Host: h, Len: segLen})
		}
	}
	return l
}

func TestGPURoundTrip(t *testing.T) {
	const total = 64 << 20
	e := newGPUEnv(t, 2*total, Config{})
	for _, segLen := range []uint64{4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20} {
		for _, perBlock := range []int{1, 8} {
			name := fmt.Sprintf("seg=%s/layers=%d", cudacopy.FormatBytes(segLen), perBlock)
			t.Run(name, func(t *testing.T) {
				e.g.Lock(t)
				r := rand.New(rand.NewSource(int64(segLen) + int64(perBlock)))
				nblocks := int(total / (segLen * uint64(perBlock)))
				l := layout(r, e.dev, e.host, nblocks, perBlock, segLen)
				src := randBytes(r, total)
				copy(e.hostBuf[total:], src)
				require.NoError(t, e.g.Drv.Memcpy(cuda.DevicePtr(e.dev), cuda.DevicePtr(e.host+total), total))
				clear(e.hostBuf[:total])
				staged := e.cu.Copier().Gathers()
				runConcurrent(t, e.s, Store, l.segs, 0, 16)
				// Load into the upper half of the device allocation.
				require.NoError(t, e.g.Drv.MemsetD8(cuda.DevicePtr(e.dev+total), 0xEE, total))
				runConcurrent(t, e.s, Load, l.segs, total, 16)
				clear(e.hostBuf[total:])
				require.NoError(t, e.g.Drv.Memcpy(cuda.DevicePtr(e.host+total), cuda.DevicePtr(e.dev+total), total))
				require.True(t, bytes.Equal(src, e.hostBuf[total:]), "round trip of %s differs", name)
				// Which sizes go staged depends on the device's calibration
				// (only where the kernel would be chosen); say how many did.
				t.Logf("%s: %d staged copies (gathered stores, scattered loads)", name, e.cu.Copier().Gathers()-staged)
			})
		}
	}
}

// runConcurrent submits segs (device side shifted by devOff) as many
// requests from workers goroutines and waits for all.
func runConcurrent(t *testing.T, s *Scheduler, dir Direction, segs []Segment, devOff uint64, workers int) {
	t.Helper()
	per := max(1, len(segs)/(workers*8))
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w * per; i < len(segs); i += workers * per {
				part := slices.Clone(segs[i:min(i+per, len(segs))])
				for k := range part {
					part[k].Dev += devOff
				}
				op, err := submitRetry(s, Request{Dir: dir, Segments: part})
				if err == nil {
					err = op.Wait()
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

const spinCycles = 200_000_000 // ~0.1 s at H200 clocks

// TestGPUStoreAfterProducer: kvo_fill (after a long spin) writes the blocks
// on the caller's stream; the store waits only on the caller's event. The
// variant without the wait must read stale bytes, proving the check bites.
func TestGPUStoreAfterProducer(t *testing.T) {
	for _, wait := range []bool{true, false} {
		t.Run(fmt.Sprintf("wait=%v", wait), func(t *testing.T) {
			const n = 8 << 20
			e := newGPUEnv(t, 2*n, Config{})
			cs, ev := e.stream(t), e.event(t)
			require.NoError(t, e.g.Drv.MemsetD8(cuda.DevicePtr(e.dev), 0, n))
			retire := e.fill(t, cs, []cudacopy.FillSegment{{Dst: e.dev, Len: n, Seed: 42}}, spinCycles)
			require.NoError(t, e.g.Drv.EventRecord(ev, cs))
			req := Request{Dir: Store, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: n}}}
			if wait {
				req.After, req.AfterStream = Event(ev), streamPtr(cs)
			}
			op, err := e.s.Submit(req)
			require.NoError(t, err)
			require.NoError(t, op.Wait())
			want := make([]byte, n)
			cudacopy.FillPattern(42, want)
			same := bytes.Equal(want, e.hostBuf[:n])
			retire()
			if wait {
				require.True(t, same, "the store did not see the producer's bytes")
			} else {
				require.False(t, same, "without the wait the store must read stale bytes")
			}
		})
	}
}

// TestGPUWriteAfterRead: the caller overwrites the blocks right after the
// store, its stream waiting only on the store's event; the host keeps the
// old bytes. Without the wait (the store held back behind a spinning
// kernel) the overwrite reaches the host.
func TestGPUWriteAfterRead(t *testing.T) {
	for _, wait := range []bool{true, false} {
		t.Run(fmt.Sprintf("wait=%v", wait), func(t *testing.T) {
			const n = 8 << 20
			e := newGPUEnv(t, 2*n, Config{})
			cs, hold, holdEv := e.stream(t), e.stream(t), e.event(t)
			e.fill(t, cs, []cudacopy.FillSegment{{Dst: e.dev, Len: n, Seed: 1}}, 0)()
			retireHold := e.fill(t, hold, []cudacopy.FillSegment{{Dst: e.dev + n, Len: 4096, Seed: 9}}, spinCycles)
			require.NoError(t, e.g.Drv.EventRecord(holdEv, hold))
			op, err := e.s.Submit(Request{Dir: Store, After: Event(holdEv), Events: true, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: n}}})
			require.NoError(t, err)
			if wait {
				sev, err := op.Event()
				require.NoError(t, err)
				require.NoError(t, e.g.Drv.StreamWaitEvent(cs, cuda.Event(sev), 0))
			}
			retire := e.fill(t, cs, []cudacopy.FillSegment{{Dst: e.dev, Len: n, Seed: 2}}, 0)
			require.NoError(t, op.Wait())
			retire()
			retireHold()
			old := make([]byte, n)
			cudacopy.FillPattern(1, old)
			same := bytes.Equal(old, e.hostBuf[:n])
			require.NoError(t, op.Release())
			if wait {
				require.True(t, same, "the overwrite reached the host before the store read the blocks")
			} else {
				require.False(t, same, "without the wait the overwrite must win")
			}
		})
	}
}

// TestGPULayerLoad: a load of 32 layers with per-layer events; one
// kvo_checksum per layer on a caller stream waits on that layer's event.
func TestGPULayerLoad(t *testing.T) {
	const layers, blocks, seg = 32, 64, 16 << 10
	const total = layers * blocks * seg
	e := newGPUEnv(t, 2*total, Config{})
	r := rand.New(rand.NewSource(5))
	data := randBytes(r, total)
	copy(e.hostBuf, data)
	var segs []Segment
	var ends []int
	for l := range layers {
		for b := range blocks {
			off := uint64(l*blocks+b) * seg
			segs = append(segs, Segment{Dev: e.dev + off, Host: e.host + off, Len: seg})
		}
		ends = append(ends, len(segs))
	}
	require.NoError(t, e.g.Drv.MemsetD8(cuda.DevicePtr(e.dev), 0, total))
	out, err := e.g.Drv.MemAlloc(8 * layers)
	require.NoError(t, err)
	defer func() { require.NoError(t, e.g.Drv.MemFree(out)) }()
	op, err := e.s.Submit(Request{Dir: Load, Segments: segs, LayerEnds: ends, Events: true})
	require.NoError(t, err)
	cs := e.stream(t)
	var tickets []cudacopy.Ticket
	for l := range layers {
		lev, err := op.LayerEvent(l)
		require.NoError(t, err)
		require.NoError(t, e.g.Drv.StreamWaitEvent(cs, cuda.Event(lev), 0))
		off := uint64(l*blocks) * seg
		tk, err := e.cu.Copier().Checksum(cs, []cudacopy.Span{{Addr: e.dev + off, Len: blocks * seg}}, out+cuda.DevicePtr(8*l))
		require.NoError(t, err)
		tickets = append(tickets, tk)
	}
	require.NoError(t, e.g.Drv.StreamSynchronize(cs))
	for _, tk := range tickets {
		require.NoError(t, e.cu.Copier().Retire(tk))
	}
	require.NoError(t, op.Wait())
	require.NoError(t, op.Release())
	require.NoError(t, e.g.Drv.Memcpy(cuda.DevicePtr(e.host+total), out, 8*layers))
	for l := range layers {
		got := *(*uint64)(unsafe.Pointer(&e.hostBuf[total+8*l]))
		want := cudacopy.HostChecksum(data[l*blocks*seg : (l+1)*blocks*seg])
		require.Equal(t, want, got, "layer %d checksum", l)
	}
}

// TestGPUCapture: a thread captures a graph in global mode that waits on a
// caller-owned event through an external event-wait node and checksums the
// loaded blocks; it replays it 1000 times, each after a load of new bytes
// that signals the event, while other goroutines store and load through the
// engine and a second thread keeps capturing in global mode. No capture may
// fail (the engine's threads are relaxed) and every replay must see its
// load's bytes. The replaying thread itself is relaxed while the second
// thread captures: CUDA prohibits a global-mode thread's synchronising calls
// (cuStreamSynchronize) during another thread's global capture.
func TestGPUCapture(t *testing.T) {
	const n = 256 << 10
	e := newGPUEnv(t, 8*n, Config{})
	sig := e.event(t)
	cs := e.stream(t)
	out, err := e.g.Drv.MemAlloc(8)
	require.NoError(t, err)
	defer func() { require.NoError(t, e.g.Drv.MemFree(out)) }()
	// A first load records sig so that the captured wait has a record.
	op, err := e.s.Submit(Request{Dir: Load, Signal: Event(sig), Segments: []Segment{{Dev: e.dev, Host: e.host, Len: n}}})
	require.NoError(t, err)
	require.NoError(t, op.Wait())
	require.NoError(t, e.g.Drv.StreamBeginCapture(cs, cuda.CaptureModeGlobal))
	require.NoError(t, e.g.Drv.StreamWaitEvent(cs, sig, cuda.EventWaitExternal))
	tk, err := e.cu.Copier().Checksum(cs, []cudacopy.Span{{Addr: e.dev, Len: n}}, out)
	require.NoError(t, err)
	graph, err := e.g.Drv.StreamEndCapture(cs)
	require.NoError(t, err)
	exec, err := e.g.Drv.GraphInstantiate(graph)
	require.NoError(t, err)
	defer func() {
		require.NoError(t, e.g.Drv.GraphExecDestroy(exec))
		require.NoError(t, e.g.Drv.GraphDestroy(graph))
		require.NoError(t, e.cu.Copier().Retire(tk))
	}()

	prevMode, err := e.g.Drv.ThreadExchangeStreamCaptureMode(cuda.CaptureModeRelaxed)
	require.NoError(t, err)
	defer func() {
		_, err := e.g.Drv.ThreadExchangeStreamCaptureMode(prevMode)
		require.NoError(t, err)
	}()

	stop := make(chan struct{})
	var bg sync.WaitGroup
	// Each background goroutine reports at most one error, then returns.
	bgErrs := make(chan error, 3)
	// halt stops the background goroutines; deferred so that a failure of
	// the main loop stops them before the scheduler closes.
	halt := sync.OnceFunc(func() {
		close(stop)
		bg.Wait()
	})
	defer halt()
	for w := range 2 {
		bg.Go(func() {
			seg := []Segment{{Dev: e.dev + uint64(2+w)*n, Host: e.host + uint64(2+w)*n, Len: n}}
			for {
				select {
				case <-stop:
					return
				default:
				}
				for _, d := range []Direction{Store, Load} {
					op, err := submitRetry(e.s, Request{Dir: d, Segments: seg})
					if err == nil {
						err = op.Wait()
					}
					if err != nil {
						bgErrs <- fmt.Errorf("background %v: %w", d, err)
						return
					}
				}
			}
		})
	}
	// A second capture thread keeps capturing in global mode meanwhile.
	bg.Go(func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := e.g.Drv.CtxSetCurrent(e.g.Ctx); err != nil {
			bgErrs <- err
			return
		}
		s2, err := e.g.Drv.StreamCreate(cuda.StreamNonBlocking, 0)
		if err != nil {
			bgErrs <- err
			return
		}
		defer func() { _ = e.g.Drv.StreamDestroy(s2) }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := e.g.Drv.StreamBeginCapture(s2, cuda.CaptureModeGlobal); err != nil {
				bgErrs <- err
				return
			}
			// A device-to-device copy: a caller's capture of its own work
			// (not the engine's copier, whose descriptor pool may grow with
			// an allocation that is unsafe on a capturing thread).
			cerr := e.g.Drv.MemcpyAsync(cuda.DevicePtr(e.dev+6*n), cuda.DevicePtr(e.dev+5*n), 4096, s2)
			g, err := e.g.Drv.StreamEndCapture(s2)
			if cerr != nil || err != nil {
				bgErrs <- fmt.Errorf("a global-mode capture failed while the engine ran: %w", errors.Join(cerr, err))
				return
			}
			if err := e.g.Drv.GraphDestroy(g); err != nil {
				bgErrs <- err
				return
			}
		}
	})

	res := e.hostBuf[7*n:]
	for i := range 1000 {
		cudacopy.FillPattern(uint64(i), e.hostBuf[:n])
		op, err := e.s.Submit(Request{Dir: Load, Signal: Event(sig), Segments: []Segment{{Dev: e.dev, Host: e.host, Len: n}}})
		require.NoError(t, err)
		// Submit returns before the op is issued: the graph's wait node
		// waits on sig's record as of the launch, so launch only once
		// this load has recorded it (Event returns the Signal then).
		got, err := op.Event()
		require.NoError(t, err)
		require.Equal(t, Event(sig), got)
		require.NoError(t, e.g.Drv.GraphLaunch(exec, cs))
		// The read-back stays on cs (a non-blocking stream): the legacy
		// stream must not be used while another thread captures.
		require.NoError(t, e.g.Drv.MemcpyAsync(cuda.DevicePtr(e.host+7*uint64(n)), out, 8, cs))
		require.NoError(t, e.g.Drv.StreamSynchronize(cs))
		require.NoError(t, op.Wait())
		sum := *(*uint64)(unsafe.Pointer(&res[0]))
		require.Equal(t, cudacopy.HostChecksum(e.hostBuf[:n]), sum, "replay %d", i)
	}
	halt()
	close(bgErrs)
	for err := range bgErrs {
		require.NoError(t, err)
	}
}

// TestGPUFreeWhileIssuing is TestFreeWhileIssuing on the GPU: 10,000
// stores and loads of 4 MiB (every other one in 64 layers), each waited
// on by a stream of the test's, while another thread allocates and frees
// device memory (cuMemFree, which may wait for the device to go idle) in a
// loop. It never hangs, and the bytes are right after.
func TestGPUFreeWhileIssuing(t *testing.T) {
	const seg, n = 64 << 10, 4 << 20
	e := newGPUEnv(t, 2*n, Config{})
	src := randBytes(rand.New(rand.NewSource(23)), n)
	copy(e.hostBuf, src)
	freeWhileIssuing(t, e.g.Drv, e.s, e.dev, e.host, n, seg, 10000)
	require.NoError(t, e.g.Drv.Memcpy(cuda.DevicePtr(e.host+n), cuda.DevicePtr(e.dev), n))
	require.True(t, bytes.Equal(src, e.hostBuf[n:2*n]), "the device bytes differ after the loads")
}
