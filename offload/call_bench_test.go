package offload

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// callBench is the workload of the call-time benchmarks: blocks blocks of
// 2×layers segments (a layer-separate layout), stored from randomly drawn
// GPU block ids and loaded into others, as an allocator hands them out.
type callBench struct {
	layers, heads, headDim, blocks int
	// verify writes random contents into the stored blocks and checks
	// every loaded block against them (tests); maxDevice, if set, is the
	// copier's MaxDeviceBytes (fake driver only).
	verify    bool
	maxDevice int64
	// partSegments, if set, is the engine's part size in segments (fake
	// driver only): small parts cut a load's first layer into many.
	partSegments int
	// stats, if set, receives the engine's Stats before it closes.
	stats *Stats
	// tracer, if set, traces the engine's calls and its scheduler's points
	// (fake driver only).
	tracer *callTracer
}

// callTimes are run's medians: calls[k] how long Store, Load and a
// per-layer Load (k = 0, 1, 2) took to return, dones[k] until each op was
// done, layer0 from the per-layer Load's call until its LayerEvent(0)
// returned.
type callTimes struct {
	calls, dones [3]time.Duration
	layer0       time.Duration
}

// run measures, per iteration, how long Store, Load and a per-layer Load
// take to return (the calls), how long until a per-layer Load's layer 0
// event is handed out, and how long until each op is done, and returns
// the medians.
func (cb callBench) run(b testing.TB, n int, drv cuda.Driver, real bool) callTimes {
	seg0 := 16 * cb.heads * cb.headDim * 2
	g := newGPUMem(b, drv, 2*cb.layers*seg0)
	defer g.close()
	seg := uint64(16 * cb.heads * cb.headDim * 2)
	numBlocks := 2 * cb.blocks
	l := LayoutSpec{Kind: LayoutLayerSeparate, Layers: cb.layers, KVHeads: cb.heads, HeadDim: cb.headDim, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: numBlocks}
	for range l.Layers {
		l.LayerTensors = append(l.LayerTensors, LayerTensors{K: g.alloc(seg * uint64(numBlocks)), V: g.alloc(seg * uint64(numBlocks)), Stride: seg})
	}
	slot := int64(seg) * int64(2*cb.layers)
	cfg := Config{PoolBytes: slot * int64(cb.blocks) * 5 / 4, Layout: l, Policy: PolicyLRU}
	var e *Engine
	var err error
	if real {
		cfg.Backend = BackendCUDA
		e, err = New(cfg)
	} else {
		h := engineHooks{calibrate: true}
		h.copyOptions.MaxDeviceBytes = cb.maxDevice
		h.partSegments = cb.partSegments
		if cb.tracer != nil {
			h.trace = cb.tracer.point
		}
		e, err = newCUDAEngine(b, drv, cfg, h)
		if err == nil && cb.tracer != nil {
			e.calls = cb.tracer
		}
	}
	require.NoError(b, err)
	defer func() {
		if cb.stats != nil {
			*cb.stats = e.Stats()
		}
		require.NoError(b, e.Close())
	}()
	require.NoError(b, e.WaitGrown(context.Background()))
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))
	keys := make([]Key, cb.blocks)
	var calls, dones [3][]time.Duration
	var layer0 []time.Duration
	if bb, ok := b.(*testing.B); ok {
		bb.ResetTimer()
	}
	var contents [][]byte
	for it := range n {
		for i := range keys {
			keys[i] = testKey(it*cb.blocks + i)
		}
		ids := rng.Perm(numBlocks)
		src, dst := ids[:cb.blocks], ids[cb.blocks:]
		if cb.verify {
			contents = randomContents(rand.New(rand.NewPCG(uint64(it), 3)), cb.blocks, e.slot)
			for i, id := range src {
				g.write(e, id, contents[i])
			}
		}
		t0 := time.Now()
		op, err := e.Store(ctx, keys, src, StoreOptions{})
		calls[0] = append(calls[0], time.Since(t0))
		require.NoError(b, err)
		require.NoError(b, op.Wait(ctx))
		dones[0] = append(dones[0], time.Since(t0))
		require.Equal(b, cb.blocks, op.count(OutcomeStored))
		require.NoError(b, op.Release())
		for k, perLayer := range []bool{false, true} {
			if cb.verify {
				poison := bytes.Repeat([]byte{0xa5 ^ byte(k)}, int(e.slot))
				for _, id := range dst {
					g.write(e, id, poison)
				}
			}
			t0 = time.Now()
			op, err = e.Load(ctx, keys, dst, LoadOptions{PerLayer: perLayer})
			calls[1+k] = append(calls[1+k], time.Since(t0))
			require.NoError(b, err)
			if perLayer {
				_, err := op.LayerEvent(0)
				require.NoError(b, err)
				layer0 = append(layer0, time.Since(t0))
			}
			require.NoError(b, op.Wait(ctx))
			dones[1+k] = append(dones[1+k], time.Since(t0))
			require.Equal(b, cb.blocks, op.count(OutcomeLoaded))
			require.NoError(b, op.Release())
			if cb.verify {
				for i, id := range dst {
					require.Equal(b, contents[i], g.read(e, id), "block %d (per layer %v)", i, perLayer)
				}
			}
		}
		e.Delete(keys)
	}
	med := func(d []time.Duration) time.Duration {
		s := slices.Clone(d)
		slices.Sort(s)
		return s[len(s)/2]
	}
	var out callTimes
	for k := range 3 {
		out.calls[k], out.dones[k] = med(calls[k]), med(dones[k])
	}
	out.layer0 = med(layer0)
	return out
}

// callMax and layer0Max are issue 51's bounds on the calls from Go and on
// a per-layer Load's LayerEvent(0), from the call.
const callMax, layer0Max = time.Millisecond, time.Millisecond

// report reports run's medians as a benchmark's metrics, and logs a
// PASS/FAIL line for each bound (callMax, layer0Max).
func (cb callBench) report(b *testing.B, m callTimes) {
	b.StopTimer()
	for k, name := range []string{"store", "load", "load-per-layer"} {
		b.ReportMetric(float64(m.calls[k].Microseconds()), name+"-call-µs")
		b.ReportMetric(float64(m.dones[k].Microseconds()), name+"-done-µs")
	}
	b.ReportMetric(float64(m.layer0.Microseconds()), "layer0-event-µs")
	verdict := func(ok bool) string {
		if ok {
			return "PASS"
		}
		return "FAIL"
	}
	b.Logf("%s: %d blocks: store() returned after %v, load() %v, per-layer load() %v [<= %v]",
		verdict(max(m.calls[0], m.calls[1], m.calls[2]) <= callMax), cb.blocks, m.calls[0], m.calls[1], m.calls[2], callMax)
	b.Logf("%s: %d blocks: LayerEvent(0) returned %v after the per-layer load() was called [<= %v]",
		verdict(m.layer0 <= layer0Max), cb.blocks, m.layer0, layer0Max)
	b.ReportMetric(float64(cb.blocks*2*cb.layers), "segments/op")
}

// BenchmarkCallTimeFake: the call times on the fake driver (CPU only): 2048
// blocks of 64 segments of 256 bytes, what the calls' own work costs.
func BenchmarkCallTimeFake(b *testing.B) {
	drv := cudafake.New(cudafake.Options{DeviceMemory: 1 << 30})
	defer drv.Close()
	cb := callBench{layers: 32, heads: 1, headDim: 4, blocks: 2048}
	cb.report(b, cb.run(b, b.N, drv, false))
}

// BenchmarkGPUCallTime: Engine.Store and Engine.Load of 128, 512 and 2048
// blocks of an 8B-class model (32 layers, 8 KV heads of 128, 16-token
// blocks, bf16: 64 segments of 32 KiB a block) on the GPU, at the default
// MaxDeviceBytes; with -test.v a PASS/FAIL line for each bound.
func BenchmarkGPUCallTime(b *testing.B) {
	gpu := cudatest.Open(b)
	for _, n := range []int{128, 512, 2048} {
		b.Run(fmt.Sprintf("blocks=%d", n), func(b *testing.B) {
			cb := callBench{layers: 32, heads: 8, headDim: 128, blocks: n}
			cb.report(b, cb.run(b, b.N, gpu.Drv, true))
		})
	}
}

// BenchmarkCallTimeFakeBig: 8B-class blocks (2 MiB, 64 segments of 32 KiB)
// on the fake driver, few of them: the bounced (gathered, scattered) paths.
func BenchmarkCallTimeFakeBig(b *testing.B) {
	drv := cudafake.New(cudafake.Options{DeviceMemory: 2 << 30})
	defer drv.Close()
	cb := callBench{layers: 32, heads: 8, headDim: 128, blocks: 192}
	cb.report(b, cb.run(b, b.N, drv, false))
}

// TestCUDAFakeFirstLayerParts: a per-layer load whose first layer is cut
// into seven parts (parts of 16 segments: 1, 1, 1, 2, 4, 8 and 7 of its 24
// blocks) and a store and load in parts of one block, byte for byte.
func TestCUDAFakeFirstLayerParts(t *testing.T) {
	drv := fakeDriver(t, cudafake.Options{DeviceMemory: 1 << 30, SyncingFree: true})
	cb := callBench{layers: 4, heads: 2, headDim: 16, blocks: 24, verify: true, partSegments: 16}
	cb.run(t, 2, drv, false)
}

// TestCUDAFakeTraceCalls: a traced call's line goes on past its return
// to the submitting thread's points for its op, up to layer 0's events
// (KVOFFLOAD_TRACE_CALLS), for a store, a load and a per-layer load.
func TestCUDAFakeTraceCalls(t *testing.T) {
	drv := fakeDriver(t, cudafake.Options{DeviceMemory: 1 << 30, SyncingFree: true})
	var buf bytes.Buffer
	tr := newCallTracer(&buf, 3)
	cb := callBench{layers: 4, heads: 2, headDim: 16, blocks: 24, partSegments: 16, tracer: tr}
	cb.run(t, 1, drv, false)
	lines := strings.Split(strings.TrimSuffix(buf.String(), "\n"), "\n")
	require.Len(t, lines, 3, buf.String())
	for i, kind := range []string{"Store", "Load", "Load"} {
		require.Regexp(t, `^kvoffload trace: `+kind+` of 24 blocks entered at [0-9]+ ns \(CLOCK_MONOTONIC\), returned after [0-9.]+ ms: checked [0-9.]+ .*\(ms from the call's entry\)$`, lines[i])
		for _, p := range []string{"submit", "returned", "issue", "layer0"} {
			require.Len(t, regexp.MustCompile(` `+p+` [0-9]`).FindAllString(lines[i], -1), 1, "%q in %s", p, lines[i])
		}
	}
}

// TestCUDAFakeBigBlocks: 8B-class blocks stored and loaded (whole and
// per layer), byte for byte, on a fake driver whose MemFree waits for the
// device to go idle (as cuMemFree can) and a copier bound so small that
// tables and staging chunks compete for it.
func TestCUDAFakeBigBlocks(t *testing.T) {
	drv := fakeDriver(t, cudafake.Options{DeviceMemory: 1 << 30, SyncingFree: true})
	var st Stats
	cb := callBench{layers: 32, heads: 8, headDim: 128, blocks: 24, verify: true, maxDevice: 40 << 20, stats: &st}
	done := make(chan struct{})
	go func() {
		defer close(done)
		cb.run(t, 3, drv, false)
	}()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("stores and loads did not finish (a deadlock)")
	}
	// The per-layer loads' layers (64 KiB of each of 24 consecutive slots)
	// went by pitched DMA, checked byte for byte above.
	require.Positive(t, st.Copies.Pitched, "per-layer loads by pitched DMA")
	// 40 MiB of device memory for 48 MiB ops: copies waited for earlier
	// ones to free theirs, and Stats counts it.
	require.Positive(t, st.Copies.BudgetWaits, "copies waited for device memory")
}

// KVOFFLOAD_GATHER_CHUNK_MIB (a comparison switch): a value outside 0 to
// 64 is an error from New naming it; 32 gives the copier 32 MiB staging
// chunks, and 8B-class blocks stored and loaded (whole and per layer)
// through them come back byte for byte, the layers by pitched DMA.
func TestCUDAFakeGatherChunkEnv(t *testing.T) {
	withComparisonSwitches(t)
	drv := fakeDriver(t, cudafake.Options{DeviceMemory: 1 << 30, SyncingFree: true})
	g := newGPUMem(t, drv, 8<<10)
	defer g.close()
	cfg := Config{PoolBytes: 1 << 20, Layout: g.layout(LayoutLayerSeparate, 16)}
	for _, v := range []string{"65", "-1", "x"} {
		t.Setenv(gatherChunkEnv, v)
		_, err := newCUDAEngine(t, drv, cfg, engineHooks{})
		require.ErrorIs(t, err, ErrInvalidConfig, v)
		require.ErrorContains(t, err, gatherChunkEnv+`="`+v+`": want 0 to 64 MiB`, v)
	}
	t.Setenv(gatherChunkEnv, "32")
	e, err := newCUDAEngine(t, drv, cfg, engineHooks{})
	require.NoError(t, err)
	require.Equal(t, 32<<20, e.cudaDev.Copier().Options().GatherChunkBytes)
	require.NoError(t, e.Close())

	var st Stats
	cb := callBench{layers: 32, heads: 8, headDim: 128, blocks: 24, verify: true, stats: &st}
	cb.run(t, 2, drv, false)
	require.Positive(t, st.Copies.Pitched, "per-layer loads by pitched DMA")
}
