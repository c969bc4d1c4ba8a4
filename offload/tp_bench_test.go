package offload

import (
	"context"
	"fmt"
	"github.com/kvoffload/kvoffload/internal/cuda"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
)

// headSlicedRig is the setting of the head-sliced benchmarks: a TP=4 rank
// of an 8-KV-head model (32 layers, bf16, 16-token blocks, token-major
// tensors of the rank's two heads, 1024 blocks) as an engine, and the
// other three ranks as views over it, whose stores make the blocks whole.
type headSlicedRig struct {
	e         *Engine
	others    []*RankView
	rankBytes uint64 // one rank's bytes of all blocks
	keys      []Key
	ids       []int
	gpu       *gpuTiming // nil: no GPU-side timing
	tr        *prTracer  // nil: no trace (KVO_PR_TRACE on the GPU)
}

const hsTP, hsHeads, hsLayers, hsBlocks = 4, 8, 32, 1024

// newHeadSlicedRig allocates the four ranks' tensors (heads of headDim
// elements) on g's driver and makes the engine with newEng; the caller
// closes rig.e before g.
func newHeadSlicedRig(b *testing.B, g *gpuMem, headDim int, newEng func(Config) (*Engine, error)) *headSlicedRig {
	n := hsHeads / hsTP
	seg := uint64(16 * n * headDim * 2) // a rank's K (or V) of one layer of one block
	mk := func(r int) LayoutSpec {
		l := LayoutSpec{Kind: LayoutLayerSeparate, Layers: hsLayers, KVHeads: n, ModelKVHeads: hsHeads, HeadFirst: r * n,
			HeadDim: headDim, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: hsBlocks, Order: OrderTokenMajor}
		for range hsLayers {
			l.LayerTensors = append(l.LayerTensors, LayerTensors{K: g.alloc(seg * hsBlocks), V: g.alloc(seg * hsBlocks), Stride: seg})
		}
		return l
	}
	rig := &headSlicedRig{rankBytes: hsBlocks * hsLayers * 2 * seg, keys: make([]Key, hsBlocks), ids: make([]int, hsBlocks)}
	e, err := newEng(Config{PoolBytes: int64(rig.rankBytes) * hsTP * 5 / 4, Layout: mk(1), Policy: PolicyLRU})
	require.NoError(b, err)
	rig.e = e
	ok := false
	defer func() {
		if !ok {
			_ = e.Close()
		}
	}()
	require.NoError(b, e.WaitGrown(context.Background()))
	for _, r := range []int{0, 2, 3} {
		v, err := e.Rank(mk(r))
		require.NoError(b, err)
		rig.others = append(rig.others, v)
	}
	for i := range rig.ids {
		rig.ids[i] = (i * 7) % hsBlocks
	}
	ok = true
	return rig
}

// headSlicedTimes is one iteration's timings: how long the rank's Store
// and Load took to return (call) and to complete.
// With the rig's gpu timing, also the GPU's side (storeGPU, loadGPU):
// from an event recorded on an idle stream of the caller's just before
// the call to one recorded after that stream waited on the op
// (Op.StreamWait), what a serving stack's compute stream sees, without
// the engine's completion processing that Wait includes.
type headSlicedTimes struct{ storeCall, store, loadCall, load, storeGPU, loadGPU time.Duration }

// gpuTiming is a stream and two timing events of the caller's.
type gpuTiming struct {
	drv    cuda.Driver
	s      cuda.Stream
	e0, e1 cuda.Event
}

// start records e0 on the stream (just before a call); stop makes the
// stream wait on the call's op and records e1; elapsed waits for e1 and
// gives the time between them. All three do nothing on a nil gpuTiming.
func (g *gpuTiming) start(b *testing.B) {
	if g != nil {
		require.NoError(b, g.drv.EventRecord(g.e0, g.s))
	}
}

func (g *gpuTiming) stop(b *testing.B, op *Op) {
	if g != nil {
		require.NoError(b, op.StreamWait(uintptr(g.s)))
		require.NoError(b, g.drv.EventRecord(g.e1, g.s))
	}
}

func (g *gpuTiming) elapsed(b *testing.B) time.Duration {
	if g == nil {
		return 0
	}
	require.NoError(b, g.drv.EventSynchronize(g.e1))
	ms, err := g.drv.EventElapsedTime(g.e0, g.e1)
	require.NoError(b, err)
	return time.Duration(float64(ms) * float64(time.Millisecond))
}

// round stores the other ranks' heads of fresh keys (untimed), then times
// the rank's Store and Load of its heads, and deletes the keys.
func (rig *headSlicedRig) round(b *testing.B, it int) headSlicedTimes {
	ctx := context.Background()
	for i := range rig.keys {
		rig.keys[i] = testKey(1_000_000 + it*hsBlocks + i)
	}
	b.StopTimer()
	for _, v := range rig.others {
		op, err := v.Store(ctx, rig.keys, rig.ids, StoreOptions{})
		require.NoError(b, err)
		require.NoError(b, op.Wait(ctx))
		require.NoError(b, op.Release())
	}
	b.StartTimer()
	var m headSlicedTimes
	rig.gpu.start(b)
	rig.traceArm(b, true)
	t0 := time.Now()
	op, err := rig.e.Store(ctx, rig.keys, rig.ids, StoreOptions{})
	m.storeCall = time.Since(t0)
	require.NoError(b, err)
	rig.gpu.stop(b, op)
	require.NoError(b, op.Wait(ctx))
	m.store = time.Since(t0)
	m.storeGPU = rig.gpu.elapsed(b)
	rig.tr.report(b, fmt.Sprintf("store %d: GPU side %.3f ms", it, m.storeGPU.Seconds()*1e3))
	require.Equal(b, hsBlocks, op.count(OutcomeStored))
	require.NoError(b, op.Release())
	rig.gpu.start(b)
	rig.traceArm(b, false)
	t0 = time.Now()
	op, err = rig.e.Load(ctx, rig.keys, rig.ids, LoadOptions{})
	m.loadCall = time.Since(t0)
	require.NoError(b, err)
	rig.gpu.stop(b, op)
	require.NoError(b, op.Wait(ctx))
	m.load = time.Since(t0)
	m.loadGPU = rig.gpu.elapsed(b)
	rig.tr.report(b, fmt.Sprintf("load %d: GPU side %.3f ms", it, m.loadGPU.Seconds()*1e3))
	require.Equal(b, hsBlocks, op.count(OutcomeLoaded))
	require.NoError(b, op.Release())
	rig.e.Delete(rig.keys)
	return m
}

// traceArm arms the rig's tracer (if any) for the next call, with the GPU
// timing's start event as the trace's origin.
func (rig *headSlicedRig) traceArm(b *testing.B, store bool) {
	if rig.tr != nil && rig.gpu != nil {
		rig.tr.arm(b, rig.gpu.e0, store)
	}
}

// BenchmarkHeadSlicedFake is BenchmarkGPUHeadSliced's store and load of a
// TP=4 rank's heads on the fake driver with 8-element heads: the same
// number of strided segments (two per layer, K/V and block: 131072), few
// bytes, so what it times is the host side of a head-sliced op (building,
// validating and encoding the descriptors).
func BenchmarkHeadSlicedFake(b *testing.B) {
	drv := cudafake.New(cudafake.Options{DeviceMemory: 1 << 30})
	defer drv.Close()
	g := newGPUMem(b, drv, 8)
	defer g.close()
	rig := newHeadSlicedRig(b, g, 8, func(cfg Config) (*Engine, error) {
		return newCUDAEngine(b, drv, cfg, engineHooks{calibrate: true})
	})
	defer func() { require.NoError(b, rig.e.Close()) }()
	var store, load time.Duration
	b.ResetTimer()
	for it := range b.N {
		m := rig.round(b, it)
		store += m.store
		load += m.load
	}
	b.ReportMetric(float64(store.Microseconds())/float64(b.N), "store-µs")
	b.ReportMetric(float64(load.Microseconds())/float64(b.N), "load-µs")
	b.ReportMetric(float64(store.Nanoseconds())/float64(b.N)/float64(hsBlocks*hsLayers*2*hsHeads/hsTP), "store-ns/seg")
}
