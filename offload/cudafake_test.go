package offload

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	"github.com/kvoffload/kvoffload/internal/cudadev"
)

// gpuMem is a serving stack's side of a CUDA test: a driver with the
// primary context current on the test's locked thread, a KV cache in
// device memory, and a pinned bounce buffer to read and write it.
type gpuMem struct {
	t      testing.TB
	drv    cuda.Driver
	dev    cuda.Device
	ctx    cuda.Context
	allocs []cuda.DevicePtr
	bounce unsafe.Pointer
	buf    []byte
}

// newGPUMem makes the context current on the calling goroutine's OS thread
// (locked until the test ends) and allocates a bounce buffer of n bytes.
func newGPUMem(t testing.TB, drv cuda.Driver, n int) *gpuMem {
	t.Helper()
	runtime.LockOSThread()
	dev, err := drv.DeviceGet(0)
	require.NoError(t, err)
	ctx, err := drv.PrimaryCtxRetain(dev)
	require.NoError(t, err)
	require.NoError(t, drv.CtxSetCurrent(ctx))
	p, err := drv.MemHostAlloc(uint64(n), cuda.HostAllocPortable)
	require.NoError(t, err)
	return &gpuMem{t: t, drv: drv, dev: dev, ctx: ctx, bounce: p, buf: unsafe.Slice((*byte)(p), n)}
}

// close frees what newGPUMem and the layouts allocated.
func (g *gpuMem) close() {
	for _, a := range g.allocs {
		require.NoError(g.t, g.drv.MemFree(a))
	}
	require.NoError(g.t, g.drv.MemFreeHost(g.bounce))
	require.NoError(g.t, g.drv.PrimaryCtxRelease(g.dev))
	runtime.UnlockOSThread()
}

func (g *gpuMem) alloc(n uint64) uint64 {
	p, err := g.drv.MemAlloc(n)
	require.NoError(g.t, err)
	g.allocs = append(g.allocs, p)
	return uint64(p)
}

// layout allocates a KV cache of blocks blocks in device memory: 2 layers,
// K and V of 1 head × 64 × bf16 × 16 tokens per layer and block (8 KiB a
// block), layer-separate or cross-layer.
func (g *gpuMem) layout(kind LayoutKind, blocks int) LayoutSpec {
	l := LayoutSpec{Kind: kind, Layers: 2, KVHeads: 1, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: blocks}
	seg := uint64(2048)
	if kind == LayoutCrossLayer {
		l.Stride = 4 * seg
		l.Base = g.alloc(l.Stride * uint64(blocks))
		return l
	}
	for range l.Layers {
		l.LayerTensors = append(l.LayerTensors, LayerTensors{K: g.alloc(seg * uint64(blocks)), V: g.alloc(seg * uint64(blocks)), Stride: seg})
	}
	return l
}

// write copies content into GPU block id of e's layout.
func (g *gpuMem) write(e *Engine, id int, content []byte) {
	copy(g.buf, content)
	segs, err := e.layout.Segments(id, nil)
	require.NoError(g.t, err)
	for _, s := range segs {
		require.NoError(g.t, g.drv.Memcpy(cuda.DevicePtr(s.Dev), cuda.DevicePtr(uintptr(g.bounce)+uintptr(s.Off)), s.Len))
	}
}

// read returns GPU block id of e's layout.
func (g *gpuMem) read(e *Engine, id int) []byte {
	segs, err := e.layout.Segments(id, nil)
	require.NoError(g.t, err)
	for _, s := range segs {
		require.NoError(g.t, g.drv.Memcpy(cuda.DevicePtr(uintptr(g.bounce)+uintptr(s.Off)), cuda.DevicePtr(s.Dev), s.Len))
	}
	return append([]byte(nil), g.buf[:e.slot]...)
}

// newCUDAEngine starts an engine on the CUDA backend over drv.
func newCUDAEngine(t testing.TB, drv cuda.Driver, cfg Config, h engineHooks) (*Engine, error) {
	t.Helper()
	if cfg.Backend == "" {
		cfg.Backend = BackendCUDA
	}
	cfg.SkipMemoryCheck = true
	h.loadDriver = func() (*cudadev.Driver, error) { return driverOf(drv), nil }
	if h.copyOptions.Method == cudacopy.MethodAuto && h.copyOptions.Calibration == nil && !h.calibrate {
		// Tests run with the uncalibrated rule; TestCUDAFakeCalibration
		// covers the background calibration.
		h.copyOptions.Calibration = &cudacopy.Calibration{}
	}
	return newEngine(cfg, h)
}

// storeAll stores keys from GPU blocks ids and requires every block stored.
func storeAll(t testing.TB, e *Engine, keys []Key, ids []int, opts StoreOptions) {
	t.Helper()
	op, err := e.Store(context.Background(), keys, ids, opts)
	require.NoError(t, err)
	require.NoError(t, op.Wait(context.Background()))
	require.Equal(t, len(keys), op.count(OutcomeStored), "outcomes %v", mustOutcomes(op.Outcomes()))
	require.NoError(t, op.Release())
}

// loadCheck loads keys into GPU blocks ids and checks them byte for byte.
func loadCheck(t testing.TB, e *Engine, g *gpuMem, keys []Key, ids []int, contents [][]byte, opts LoadOptions) *Op {
	t.Helper()
	op, err := e.Load(context.Background(), keys, ids, opts)
	require.NoError(t, err)
	require.NoError(t, op.Wait(context.Background()))
	require.Equal(t, len(keys), op.count(OutcomeLoaded), "outcomes %v", mustOutcomes(op.Outcomes()))
	for i, id := range ids {
		require.Equal(t, contents[i], g.read(e, id), "block %d (key %v)", id, keys[i])
	}
	return op
}

func randomContents(rng *rand.Rand, n int, size int64) [][]byte {
	out := make([][]byte, n)
	for i := range out {
		out[i] = make([]byte, size)
		for j := range out[i] {
			out[i][j] = byte(rng.Uint32())
		}
	}
	return out
}

// storeOverwriteLoad is the scenario the CPU and GPU tests share: random
// content stored from blocks 0..n-1, those GPU blocks overwritten, then
// loaded into other block ids (also per layer, with a Signal event) and
// checked byte for byte.
func storeOverwriteLoad(t *testing.T, e *Engine, g *gpuMem, n int, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 1))
	contents := randomContents(rng, n, e.slot)
	keys := make([]Key, n)
	src, dst := make([]int, n), make([]int, n)
	for i := range n {
		keys[i] = testKey(int(seed)*1000 + i)
		src[i], dst[i] = i, n+i
		g.write(e, i, contents[i])
	}
	storeAll(t, e, keys, src, StoreOptions{})
	for i := range n {
		g.write(e, i, make([]byte, e.slot))
	}
	op := loadCheck(t, e, g, keys, dst, contents, LoadOptions{})
	ev, err := op.Event()
	require.NoError(t, err)
	require.NotZero(t, ev, "CUDA ops carry an event")
	require.NoError(t, op.Release())

	sig, err := g.drv.EventCreate(cuda.EventDisableTiming)
	require.NoError(t, err)
	defer func() { require.NoError(t, g.drv.EventDestroy(sig)) }()
	op = loadCheck(t, e, g, keys, src, contents, LoadOptions{PerLayer: true, Signal: uintptr(sig)})
	if LayoutKind(e.layout.Kind().String()) != LayoutCrossLayer {
		for l := range 2 {
			lev, err := op.LayerEvent(l)
			require.NoError(t, err)
			require.NotZero(t, lev)
		}
	}
	done, err := g.drv.EventQuery(cuda.Event(sig))
	require.NoError(t, err)
	require.True(t, done, "the Signal event completed with the load")
	s, err := g.drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(t, err)
	require.NoError(t, op.StreamWait(uintptr(s)))
	require.NoError(t, g.drv.StreamSynchronize(s))
	require.NoError(t, g.drv.StreamDestroy(s))
	require.NoError(t, op.Release())
}

func fakeDriver(t *testing.T, opts cudafake.Options) *cudafake.Driver {
	t.Helper()
	opts.CheckContext = true
	d := cudafake.New(opts)
	t.Cleanup(func() {
		require.True(t, d.Live().IsZero(), "nothing left allocated, registered or created: %+v", d.Live())
		require.NoError(t, d.Close())
		goleak.VerifyNone(t)
	})
	return d
}

func TestCUDAFakeRoundTrip(t *testing.T) {
	for _, kind := range []LayoutKind{LayoutLayerSeparate, LayoutCrossLayer} {
		t.Run(string(kind), func(t *testing.T) {
			d := fakeDriver(t, cudafake.Options{Seed: 1, MaxDelay: 50 * time.Microsecond})
			g := newGPUMem(t, d, 8<<10)
			defer g.close()
			slot := int64(8 << 10)
			e, err := newCUDAEngine(t, d, Config{PoolBytes: 32 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
				StagingBytes: 64 << 10, Layout: g.layout(kind, 16), Policy: PolicyLRU}, engineHooks{rangeLimit: 16 << 10})
			require.NoError(t, err)
			name, reason := e.Backend()
			require.Equal(t, BackendCUDA, name)
			require.Contains(t, reason, "cuda")
			require.NoError(t, e.WaitGrown(context.Background()))
			st := e.Stats()
			require.Equal(t, 4, st.Pool.Regions)
			require.Equal(t, int64(32), st.Pool.SlotsTotal, "regions of 8 slots in ranges of 2 slots: no slot lost")
			require.Positive(t, st.Pool.FirstSlot)
			require.GreaterOrEqual(t, st.Pool.FullPool, st.Pool.FirstSlot)

			stg, err := e.Staging("out", 100)
			require.NoError(t, err)
			require.NotZero(t, stg.DevicePtr())

			storeOverwriteLoad(t, e, g, 6, 1)
			res, err := e.Trim(context.Background(), 8*slot)
			require.NoError(t, err)
			require.Equal(t, 8*slot, res.FreedBytes)
			storeOverwriteLoad(t, e, g, 6, 2)
			require.NoError(t, e.Close())
		})
	}
}

// Stores and loads of whole blocks whose host runs reach
// Options.GatherMinRun go staged through device memory (gathered,
// scattered), count in Stats.Copies.Bounced, and round-trip byte-exact.
func TestCUDAFakeStagedRoundTrip(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{Seed: 2, MaxDelay: 50 * time.Microsecond})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	slot := int64(8 << 10)
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 32 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
		Layout: g.layout(LayoutLayerSeparate, 16), Policy: PolicyLRU}, engineHooks{copyOptions: cudacopy.Options{GatherMinRun: int(slot)}})
	require.NoError(t, err)
	require.NoError(t, e.WaitGrown(context.Background()))
	require.Zero(t, e.Stats().Copies.Bounced)
	const n = 6
	contents := randomContents(rand.New(rand.NewPCG(3, 1)), n, e.slot)
	keys, src, dst := make([]Key, n), make([]int, n), make([]int, n)
	for i := range n {
		keys[i], src[i], dst[i] = testKey(3000+i), i, n+i
		g.write(e, i, contents[i])
	}
	storeAll(t, e, keys, src, StoreOptions{})
	stores := e.Stats().Copies.Bounced
	require.Positive(t, stores, "the store was staged")
	require.NoError(t, loadCheck(t, e, g, keys, dst, contents, LoadOptions{}).Release())
	staged := e.Stats().Copies.Bounced
	require.Greater(t, staged, stores, "the load was staged")
	st := e.Stats()
	require.EqualValues(t, cudacopy.DefaultMaxDeviceBytes, st.Copies.MaxDeviceBytes)
	require.Positive(t, st.Copies.DeviceBytes, "staging chunks and descriptor tables are reported")
	require.LessOrEqual(t, st.Copies.DeviceBytes, st.Copies.MaxDeviceBytes)
	require.NoError(t, e.Close())
	require.Equal(t, staged, e.Stats().Copies.Bounced, "readable after Close")
}

// Config.MaxDeviceBytes reaches the copier: with room for one staging
// chunk and a few descriptor tables, staged stores and loads still
// round-trip and the copy layer's device memory stays under the bound.
func TestCUDAFakeMaxDeviceBytes(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{Seed: 4, MaxDelay: 50 * time.Microsecond})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	slot := int64(8 << 10)
	base := d.Live().DeviceBytes
	const bound = 1<<20 + 4*64*32
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 32 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
		Layout: g.layout(LayoutLayerSeparate, 16), Policy: PolicyLRU, MaxDeviceBytes: 12 << 20},
		engineHooks{copyOptions: cudacopy.Options{GatherMinRun: int(slot), GatherChunkBytes: 1 << 20, DescCapacity: 64, MaxDeviceBytes: bound}})
	require.NoError(t, err)
	require.NoError(t, e.WaitGrown(context.Background()))
	require.EqualValues(t, 12<<20, e.Stats().Copies.MaxDeviceBytes, "Config.MaxDeviceBytes overrides the copier option")
	const n = 6
	contents := randomContents(rand.New(rand.NewPCG(5, 1)), n, e.slot)
	keys, src, dst := make([]Key, n), make([]int, n), make([]int, n)
	for i := range n {
		keys[i], src[i], dst[i] = testKey(4000+i), i, n+i
		g.write(e, i, contents[i])
	}
	storeAll(t, e, keys, src, StoreOptions{})
	require.NoError(t, loadCheck(t, e, g, keys, dst, contents, LoadOptions{}).Release())
	st := e.Stats()
	require.Positive(t, st.Copies.Bounced)
	require.LessOrEqual(t, st.Copies.DeviceBytes, st.Copies.MaxDeviceBytes)
	require.NoError(t, e.Close())
	require.LessOrEqual(t, d.PeakDeviceBytes()-base, uint64(12<<20))
}

func TestCUDAFakeAutoBackend(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 64 << 10, Layout: g.layout(LayoutCrossLayer, 4), Backend: BackendAuto}, engineHooks{})
	require.NoError(t, err)
	name, reason := e.Backend()
	require.Equal(t, BackendCUDA, name)
	require.Contains(t, reason, "auto: libcuda loaded, device 0")
	require.NoError(t, e.Close())

	e, err = newCUDAEngine(t, d, Config{PoolBytes: 64 << 10, Layout: smallLayout(4), Backend: BackendAuto}, engineHooks{})
	require.NoError(t, err)
	name, reason = e.Backend()
	require.Equal(t, BackendHost, name)
	require.Contains(t, reason, "no device addresses")
	require.NoError(t, e.Close())
}

// TestCUDAFakeGrowthFailure: registration failing at range 1 of the third
// region during background growth stops growth with the driver's error;
// the engine keeps serving from the regions it has.
func TestCUDAFakeGrowthFailure(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	slot := int64(8 << 10)
	// Ranges of 2 slots: staging (16 KiB) 1 call, each 8-slot region 4 calls;
	// call 1+4+4+2 is range 1 of region 2.
	d.FailAt(cuda.OpMemHostRegister, 1+4+4+2, cuda.ErrorOutOfMemory)
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 32 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
		StagingBytes: 16 << 10, Layout: g.layout(LayoutLayerSeparate, 16), Policy: PolicyLRU}, engineHooks{rangeLimit: 16 << 10})
	require.NoError(t, err)
	err = e.WaitGrown(context.Background())
	require.ErrorContains(t, err, "CUDA_ERROR_OUT_OF_MEMORY")
	require.ErrorContains(t, err, "range 1")
	st := e.Stats()
	require.Equal(t, 2, st.Pool.Regions)
	require.Equal(t, 16*slot, st.Pool.OwnedBytes)
	require.Contains(t, st.Pool.GrowthError, "CUDA_ERROR_OUT_OF_MEMORY")
	require.Zero(t, st.Pool.FullPool)
	storeOverwriteLoad(t, e, g, 5, 3)
	require.NoError(t, e.Close())
}

// TestCUDAFakeFirstRegionFailure: New fails when the first region cannot
// be pinned, and leaves nothing registered, allocated or running.
func TestCUDAFakeFirstRegionFailure(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	d.FailAt(cuda.OpMemHostRegister, 2, cuda.ErrorOutOfMemory)
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 64 << 10, StagingBytes: 16 << 10, Layout: g.layout(LayoutCrossLayer, 4)}, engineHooks{})
	require.Nil(t, e)
	require.ErrorContains(t, err, "CUDA_ERROR_OUT_OF_MEMORY")
}

// TestCUDAFakeCopyFailure: a copy failing fails only the op it belongs to,
// with the driver's error; every ready block stays readable and later ops
// work.
func TestCUDAFakeCopyFailure(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	slot := int64(8 << 10)
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 16 * slot, Layout: g.layout(LayoutLayerSeparate, 16), Policy: PolicyLRU},
		engineHooks{copyOptions: cudacopy.Options{Method: cudacopy.MethodMemcpy}})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	rng := rand.New(rand.NewPCG(5, 5))
	contents := randomContents(rng, 3, slot)
	keys := []Key{testKey(1), testKey(2), testKey(3)}
	for i := range 3 {
		g.write(e, i, contents[i])
	}
	storeAll(t, e, keys[:2], []int{0, 1}, StoreOptions{})

	d.FailAt(cuda.OpMemcpyAsync, d.Calls(cuda.OpMemcpyAsync)+1, cuda.ErrorInvalidValue)
	op, err := e.Store(context.Background(), keys[2:], []int{2}, StoreOptions{})
	require.NoError(t, err)
	require.ErrorContains(t, op.Wait(context.Background()), "CUDA_ERROR_INVALID_VALUE")
	require.Equal(t, []Outcome{OutcomeFailed}, mustOutcomes(op.Outcomes()))
	require.NoError(t, op.Release())
	res, err := e.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 2, res.Hits, "the failed block is not visible")

	require.NoError(t, loadCheck(t, e, g, keys[:2], []int{10, 11}, contents[:2], LoadOptions{}).Release())
	storeAll(t, e, keys[2:], []int{2}, StoreOptions{})
	require.NoError(t, loadCheck(t, e, g, keys, []int{12, 13, 14}, contents, LoadOptions{}).Release())
	st := e.Stats()
	require.Equal(t, int64(1), st.Outcome(OutcomeFailed))
}

// TestCUDAFakeStickyError: a sticky error fails the op in flight and makes
// the engine refuse new work, saying why.
func TestCUDAFakeStickyError(t *testing.T) {
	// A lost context cannot free anything: close the fake without the
	// leak check (its Close unmaps what is left).
	d := cudafake.New(cudafake.Options{CheckContext: true})
	t.Cleanup(func() {
		require.NoError(t, d.Close())
		goleak.VerifyNone(t)
	})
	g := newGPUMem(t, d, 8<<10)
	defer runtime.UnlockOSThread()
	slot := int64(8 << 10)
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 16 * slot, Layout: g.layout(LayoutLayerSeparate, 16), Policy: PolicyLRU},
		engineHooks{copyOptions: cudacopy.Options{Method: cudacopy.MethodMemcpy}})
	require.NoError(t, err)
	d.FailAt(cuda.OpMemcpyAsync, d.Calls(cuda.OpMemcpyAsync)+1, cuda.ErrorIllegalAddress)
	op, err := e.Store(context.Background(), []Key{testKey(1)}, []int{0}, StoreOptions{})
	require.NoError(t, err)
	<-op.Done()
	require.Equal(t, []Outcome{OutcomeFailed}, mustOutcomes(op.Outcomes()))
	require.ErrorContains(t, op.Err(), "CUDA_ERROR_ILLEGAL_ADDRESS")
	require.NoError(t, op.Release())
	for _, call := range []func() error{
		func() error {
			_, err := e.Store(context.Background(), []Key{testKey(2)}, []int{1}, StoreOptions{})
			return err
		},
		func() error {
			_, err := e.Load(context.Background(), []Key{testKey(2)}, []int{1}, LoadOptions{})
			return err
		},
	} {
		err := call()
		require.ErrorIs(t, err, ErrDeviceLost)
		require.ErrorContains(t, err, "CUDA_ERROR_ILLEGAL_ADDRESS")
	}
	require.ErrorContains(t, e.Close(), "CUDA_ERROR_ILLEGAL_ADDRESS", "Close reports what it could not release")
	_, err = e.Store(context.Background(), []Key{testKey(2)}, []int{1}, StoreOptions{})
	require.ErrorIs(t, err, ErrClosed)
}

// TestCUDAFakeNewFromAnyGoroutine: New, called from another goroutine than
// the one using the engine, on a device that cannot use registered host
// pointers directly (the copier looks up each range's device pointer, on
// a thread with the context current), serves byte-exact round trips.
func TestCUDAFakeNewFromAnyGoroutine(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{Attributes: map[cuda.Attribute]int{cuda.AttrCanUseHostPointerForRegisteredMem: 0}})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	slot := int64(8 << 10)
	layout := g.layout(LayoutLayerSeparate, 16)
	type result struct {
		e   *Engine
		err error
	}
	ch := make(chan result)
	go func() {
		e, err := newCUDAEngine(t, d, Config{PoolBytes: 16 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
			Layout: layout, Policy: PolicyLRU}, engineHooks{})
		ch <- result{e, err}
	}()
	r := <-ch
	require.NoError(t, r.err)
	require.NoError(t, r.e.WaitGrown(context.Background()))
	storeOverwriteLoad(t, r.e, g, 4, 41)
	require.NoError(t, r.e.Close())
}

// TestCUDAFakeGrowthDuringGlobalCapture: background growth pins regions
// while the stack captures a graph in global mode on its own thread; the
// capture is not invalidated (the engine's threads are relaxed) and the
// graph replays. Growth paused around the capture works too.
func TestCUDAFakeGrowthDuringGlobalCapture(t *testing.T) {
	for _, pause := range []bool{false, true} {
		t.Run(fmt.Sprintf("paused=%v", pause), func(t *testing.T) {
			d := fakeDriver(t, cudafake.Options{})
			g := newGPUMem(t, d, 8<<10)
			defer g.close()
			slot := int64(8 << 10)
			atRegion1, proceed := make(chan struct{}), make(chan struct{})
			e, err := newCUDAEngine(t, d, Config{PoolBytes: 32 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
				Layout: g.layout(LayoutLayerSeparate, 16), Policy: PolicyLRU}, engineHooks{beforeGrow: func(i int) {
				if i == 1 {
					close(atRegion1)
					<-proceed
				}
			}})
			require.NoError(t, err)
			defer func() { require.NoError(t, e.Close()) }()
			stg, err := e.Staging("out", 256)
			require.NoError(t, err)
			src := g.alloc(256)
			s, err := d.StreamCreate(cuda.StreamNonBlocking, 0)
			require.NoError(t, err)
			defer func() { require.NoError(t, d.StreamDestroy(s)) }()
			<-atRegion1
			if pause {
				e.PauseGrowth()
			}
			require.NoError(t, d.StreamBeginCapture(s, cuda.CaptureModeGlobal))
			require.NoError(t, d.MemcpyAsync(cuda.DevicePtr(stg.DevicePtr()), cuda.DevicePtr(src), 256, s))
			close(proceed)
			if !pause {
				require.NoError(t, e.WaitGrown(context.Background()), "pinning during a global capture on another thread")
			}
			graph, err := d.StreamEndCapture(s)
			require.NoError(t, err, "the capture was not invalidated by the engine")
			if pause {
				e.ResumeGrowth()
				require.NoError(t, e.WaitGrown(context.Background()))
			}
			exec, err := d.GraphInstantiate(graph)
			require.NoError(t, err)
			copy(g.buf, bytes.Repeat([]byte{0x42}, 256))
			require.NoError(t, d.Memcpy(cuda.DevicePtr(src), cuda.DevicePtr(uintptr(g.bounce)), 256))
			require.NoError(t, d.GraphLaunch(exec, s))
			require.NoError(t, d.StreamSynchronize(s))
			require.Equal(t, bytes.Repeat([]byte{0x42}, 256), stg.Bytes())
			require.NoError(t, d.GraphExecDestroy(exec))
			require.NoError(t, d.GraphDestroy(graph))
			require.Equal(t, 4, e.Stats().Pool.Regions)
		})
	}
}

// TestCUDAFakeCalibration: with the automatic method and no saved table,
// the copy methods are calibrated in the background after New, and the
// engine serves meanwhile.
func TestCUDAFakeCalibration(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	slot := int64(8 << 10)
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 16 * slot, StagingBytes: 64 << 10, Layout: g.layout(LayoutCrossLayer, 16), Policy: PolicyLRU},
		engineHooks{calibrate: true, copyOptions: cudacopy.Options{Calibrate: cudacopy.CalibrationConfig{
			TotalBytes: 1 << 20, SegSizes: []uint64{16 << 10}, Pieces: 1, Reps: 1}}})
	require.NoError(t, err)
	storeOverwriteLoad(t, e, g, 4, 51)
	require.NoError(t, e.WaitGrown(context.Background()))
	st := e.Stats()
	require.Contains(t, st.Copies.Calibration, "calibrated in")
	require.NotNil(t, e.cudaDev.Copier().Calibration())
	require.NotEmpty(t, e.cudaDev.Copier().Calibration().Entries)
	storeOverwriteLoad(t, e, g, 4, 52)
	require.NoError(t, e.Close())
}

// TestCUDAFakeGreedyStores: engineHooks.greedyStores puts device-to-host copies
// on the copy kernel's unthrottled launch; loads keep the default one, and
// blocks round-trip either way.
func TestCUDAFakeGreedyStores(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	slot := int64(8 << 10)
	for _, greedy := range []bool{false, true} {
		e, err := newCUDAEngine(t, d, Config{PoolBytes: 16 * slot, StagingBytes: -1, Layout: g.layout(LayoutCrossLayer, 16), Policy: PolicyLRU},
			engineHooks{copyOptions: cudacopy.Options{Method: cudacopy.MethodKernel}, greedyStores: greedy})
		require.NoError(t, err)
		caps := e.cudaDev.Copier().Capabilities()
		require.Equal(t, cudacopy.DefaultLaunch(cudacopy.D2H, greedy), caps.D2H, "greedy %v", greedy)
		require.Equal(t, cudacopy.DefaultLaunch(cudacopy.H2D, greedy), caps.H2D, "greedy %v", greedy)
		storeOverwriteLoad(t, e, g, 4, 61)
		require.NoError(t, e.Close())
	}
	require.NotEqual(t, cudacopy.DefaultLaunch(cudacopy.D2H, false), cudacopy.DefaultLaunch(cudacopy.D2H, true))
}

// driverOf is drv (a fake, or the real driver) as the engine loads it.
func driverOf(drv cuda.Driver) *cudadev.Driver { return cudadev.WrapDriver(drv) }

// loader is load as engineHooks.loadDriver.
func loader(load func() (cuda.Driver, error)) func() (*cudadev.Driver, error) {
	return func() (*cudadev.Driver, error) {
		drv, err := load()
		if err != nil {
			return nil, err
		}
		return driverOf(drv), nil
	}
}
