package offload

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/transfer"
)

// The geometry of bench/realmodel.py, an 8B-class Llama: 32 layers, 8 KV
// heads of 128, bf16, 16-token blocks: K and V of one layer of one block
// are 32 KiB each, 2 MiB a block over all layers.
// prGPUBlocks is the GPU cache's blocks, or twice a row's if more (2048
// blocks, 32k tokens, take 4096: 8 GiB of GPU tensors).
const prLayers, prSeg, prGPUBlocks = 32, 16 * 8 * 128 * 2, 1024

// BenchmarkGPUPagedReload is bench/realmodel.py's reload without the model,
// so that the engine's share of a gap to the link can be taken apart:
// stores of n blocks from random GPU block ids, loads into other random
// ids, each timed on the GPU's side (a caller's stream from an event just
// before the call until it waited on the op), against a contiguous pinned
// copy of the same bytes measured in the same run (best of three, before
// and after the rows; a row over 102% of it marks the run invalid). Beside
// each: how long the call took to return, and for a per-layer load when
// layer 0's event and the last layer's fired on the caller's stream.
// KVO_PR_BLOCKS (default "128 512": 2k and 8k tokens) and KVO_PR_VARIANTS
// (default "auto kernel batch"; the grammar of KVO_HS_VARIANTS) pick the
// rows; KVO_BENCH_OUT receives paged.md. KVO_PR_TRACE=1 logs, per load,
// when the scheduler reached each point of transfer.Config.Trace, on the
// CPU and on the load stream (prTracer).
func BenchmarkGPUPagedReload(b *testing.B) {
	gpu := cudatest.Open(b)
	blocks := []int{128, 512}
	if v := os.Getenv("KVO_PR_BLOCKS"); v != "" {
		blocks = blocks[:0]
		for _, f := range strings.Fields(v) {
			n, err := strconv.Atoi(f)
			require.NoError(b, err)
			require.True(b, n > 0 && n <= 4096, "KVO_PR_BLOCKS: %d is not in [1, 4096]", n)
			blocks = append(blocks, n)
		}
	}
	variants := os.Getenv("KVO_PR_VARIANTS")
	if variants == "" {
		variants = "auto kernel batch"
	}
	var lines []string
	for _, v := range strings.Fields(variants) {
		// This benchmark's own keys, last: after=1 (each Load's After an event recorded on the caller's
		// stream just before the call, as the Python package's
		// load(after=stream) does), legacy=1 (the caller's stream is the
		// legacy default stream, as torch's current stream is by default).
		hv, pr := v, prOptions{}
		for {
			if base, ok := strings.CutSuffix(hv, ":after=1"); ok {
				hv, pr.after = base, true
			} else if base, ok := strings.CutSuffix(hv, ":legacy=1"); ok {
				hv, pr.legacy = base, true
			} else if i := strings.LastIndex(hv, ":idle="); i >= 0 {
				ms, err := strconv.Atoi(hv[i+len(":idle="):])
				require.NoError(b, err, "variant %q: idle=MS", v)
				hv, pr.idle = hv[:i], time.Duration(ms)*time.Millisecond
			} else {
				break
			}
		}
		h, err := hsVariant(hv)
		require.NoError(b, err)
		for _, n := range blocks {
			b.Run(fmt.Sprintf("%s/blocks=%d", v, n), func(b *testing.B) {
				var tr *prTracer
				h := h
				if os.Getenv("KVO_PR_TRACE") != "" {
					tr = &prTracer{drv: gpu.Drv}
					h.trace = tr.point
				}
				defer tr.close(b)
				lines = append(lines, pagedReload(b, gpu.Drv, v, tr.engine(h), n, tr, pr))
			})
		}
	}
	if dir := os.Getenv("KVO_BENCH_OUT"); dir != "" && len(lines) > 0 {
		head := "# Paged reload, bench/realmodel.py's geometry without the model\n\n" +
			"| variant | blocks | H2D link GB/s | load GPU side ms | load/link | load call ms | per-layer: layer 0 / all ms | D2H link GB/s | store GPU side ms | store/link | store call ms |\n" +
			"|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
		_ = os.WriteFile(filepath.Join(dir, "paged.md"), []byte(head+strings.Join(lines, "\n")+"\n"), 0o644)
	}
}

// prOptions are BenchmarkGPUPagedReload's own variant keys (after=1,
// legacy=1, idle=MS).
type prOptions struct {
	after, legacy bool
	idle          time.Duration
}

// loadOptions are a whole load's options: with after, ev recorded on s
// just before the call as its After.
func (pr prOptions) loadOptions(b *testing.B, drv cuda.Driver, ev cuda.Event, s cuda.Stream) LoadOptions {
	if !pr.after {
		return LoadOptions{}
	}
	require.NoError(b, drv.EventRecord(ev, s))
	return LoadOptions{After: uintptr(ev)}
}

// pagedReload runs one row of BenchmarkGPUPagedReload and returns it as a
// table row.
// newEng makes the engine of a config (the CUDA backend's, with the
// variant's hooks).
func pagedReload(b *testing.B, drv cuda.Driver, name string, newEng func(Config) (*Engine, error), n int, tr *prTracer, pr prOptions) string {
	g := newGPUMem(b, drv, 8)
	defer g.close()
	gpuBlocks := max(prGPUBlocks, 2*n)
	l := LayoutSpec{Kind: LayoutLayerSeparate, Layers: prLayers, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: gpuBlocks}
	for range prLayers {
		l.LayerTensors = append(l.LayerTensors, LayerTensors{K: g.alloc(uint64(prSeg * gpuBlocks)), V: g.alloc(uint64(prSeg * gpuBlocks)), Stride: prSeg})
	}
	bytes := uint64(n) * prLayers * 2 * prSeg
	e, err := newEng(Config{PoolBytes: int64(bytes) * 2, Layout: l, Policy: PolicyLRU})
	require.NoError(b, err)
	defer func() { require.NoError(b, e.Close()) }()
	require.NoError(b, e.WaitGrown(context.Background()))

	hostP, err := drv.MemHostAlloc(bytes, cuda.HostAllocPortable)
	require.NoError(b, err)
	defer func() { require.NoError(b, drv.MemFreeHost(hostP)) }()
	devP := g.alloc(bytes)
	own, err := drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(b, err)
	defer func() { require.NoError(b, drv.StreamDestroy(own)) }()
	s := own
	if pr.legacy {
		s = cuda.Stream(1) // CU_STREAM_LEGACY
	}
	evs := make([]cuda.Event, 4)
	for i := range evs {
		evs[i], err = drv.EventCreate(cuda.EventDefault)
		require.NoError(b, err)
	}
	defer func() {
		for _, ev := range evs {
			require.NoError(b, drv.EventDestroy(ev))
		}
	}()
	elapsed := func(a, z cuda.Event) time.Duration {
		require.NoError(b, drv.EventSynchronize(z))
		ms, err := drv.EventElapsedTime(a, z)
		require.NoError(b, err)
		return time.Duration(float64(ms) * float64(time.Millisecond))
	}
	link := contiguousLink(b, drv, s, evs[0], evs[1], hostP, devP, bytes)
	h2d, d2h := link(true), link(false)

	rng := rand.New(rand.NewPCG(uint64(n), 7))
	ctx := context.Background()
	keys := make([]Key, n)
	var storeGPU, storeCall, loadGPU, loadCall, layer0, layerAll []time.Duration
	b.ResetTimer()
	for it := range b.N {
		perm := rng.Perm(gpuBlocks)
		from, into := perm[:n], perm[n:2*n]
		for i := range keys {
			keys[i] = testKey(2_000_000 + it*n + i)
		}
		// timed runs one op: how long its call took, and its GPU side.
		timed := func(call func() (*Op, error), outcome Outcome) (callT, gpuT time.Duration) {
			require.NoError(b, drv.EventRecord(evs[0], s))
			t0 := time.Now()
			op, err := call()
			callT = time.Since(t0)
			require.NoError(b, err)
			require.NoError(b, op.StreamWait(uintptr(s)))
			require.NoError(b, drv.EventRecord(evs[1], s))
			gpuT = elapsed(evs[0], evs[1])
			require.NoError(b, op.Wait(ctx))
			require.Equal(b, n, op.count(outcome))
			require.NoError(b, op.Release())
			return callT, gpuT
		}
		tr.arm(b, evs[0], true)
		c, g := timed(func() (*Op, error) { return e.Store(ctx, keys, from, StoreOptions{}) }, OutcomeStored)
		storeCall, storeGPU = append(storeCall, c), append(storeGPU, g)
		tr.report(b, fmt.Sprintf("%s/%d store %d: call %v, GPU side %v", name, n, it, c, g))
		if pr.idle > 0 {
			time.Sleep(pr.idle)
		}
		tr.arm(b, evs[0], false)
		c, g = timed(func() (*Op, error) { return e.Load(ctx, keys, into, pr.loadOptions(b, drv, evs[3], s)) }, OutcomeLoaded)
		loadCall, loadGPU = append(loadCall, c), append(loadGPU, g)
		tr.report(b, fmt.Sprintf("%s/%d load %d: call %v, GPU side %v", name, n, it, c, g))

		// Per layer: the caller's stream waits on layer 0's event, records,
		// then waits on the last layer's and records again.
		require.NoError(b, drv.EventRecord(evs[0], s))
		tr.arm(b, evs[0], false)
		t0 := time.Now()
		op, err := e.Load(ctx, keys, into, LoadOptions{PerLayer: true})
		plCall := time.Since(t0)
		require.NoError(b, err)
		for i, l := range []int{0, prLayers - 1} {
			ev, err := op.LayerEvent(l)
			require.NoError(b, err)
			require.NoError(b, drv.StreamWaitEvent(s, cuda.Event(ev), 0))
			require.NoError(b, drv.EventRecord(evs[1+i], s))
		}
		layer0 = append(layer0, elapsed(evs[0], evs[1]))
		layerAll = append(layerAll, elapsed(evs[0], evs[2]))
		require.NoError(b, op.Wait(ctx))
		tr.report(b, fmt.Sprintf("%s/%d per-layer load %d: call %v, layer 0 %v, all %v", name, n, it, plCall, layer0[len(layer0)-1], layerAll[len(layerAll)-1]))
		require.NoError(b, op.Release())
		e.Delete(keys)
	}
	b.StopTimer()
	h2d, d2h = max(h2d, link(true)), max(d2h, link(false))
	med := func(d []time.Duration) time.Duration {
		d = slices.Clone(d)
		slices.Sort(d)
		return d[len(d)/2]
	}
	ms := func(d []time.Duration) float64 { return float64(med(d).Microseconds()) / 1e3 }
	ldLink := float64(bytes) / med(loadGPU).Seconds() / 1e9 / h2d
	stLink := float64(bytes) / med(storeGPU).Seconds() / 1e9 / d2h
	b.ReportMetric(ldLink, "load/link")
	b.ReportMetric(stLink, "store/link")
	b.ReportMetric(ms(loadCall), "load-call-ms")
	b.ReportMetric(ms(layer0), "layer0-ms")
	row := fmt.Sprintf("| %s | %d | %.1f | %.2f | %.3f | %.3f | %.2f / %.2f | %.1f | %.2f | %.3f | %.3f |", name, n, h2d, ms(loadGPU), ldLink,
		ms(loadCall), ms(layer0), ms(layerAll), d2h, ms(storeGPU), stLink, ms(storeCall))
	if ldLink > 1.02 || stLink > 1.02 {
		row += " INVALID: a rate beats its reference by more than 2%"
	}
	return row
}

// prTracer takes a load of BenchmarkGPUPagedReload apart (KVO_PR_TRACE):
// the scheduler's trace points (transfer.Config.Trace) as wall-clock times
// from the call, and for the submitting thread's points also CUDA events
// recorded on the engine's load stream, as times from the caller's event
// just before the call: when the stream reached that point.
type prTracer struct {
	mu  sync.Mutex // point runs on the caller's goroutine and the submitter's
	drv cuda.Driver
	// loadStream, storeStream: the engine's; stream: the traced op's.
	loadStream, storeStream, stream cuda.Stream
	on                              atomic.Bool
	t0                              time.Time
	start                           cuda.Event
	names                           []string
	wall                            []time.Duration
	evs                             []cuda.Event // per point; 0 where none was recorded
	pool                            []cuda.Event
}

// arm starts a traced call; start is the caller's event recorded just
// before it, store whether it is a Store (else a Load).
func (t *prTracer) arm(b *testing.B, start cuda.Event, store bool) {
	if t == nil {
		return
	}
	t.stream = t.loadStream
	if store {
		t.stream = t.storeStream
	}
	for len(t.pool) < 16 {
		ev, err := t.drv.EventCreate(cuda.EventDefault)
		require.NoError(b, err)
		t.pool = append(t.pool, ev)
	}
	t.mu.Lock()
	t.names, t.wall, t.evs = t.names[:0], t.wall[:0], t.evs[:0]
	t.start, t.t0 = start, time.Now()
	t.mu.Unlock()
	t.on.Store(true)
}

// point is the scheduler's Trace (and the engine's tracePoint): on the
// submitting thread (every point but callerPoints) it records one of the
// pool's events on the load stream, for the first parts.
func (t *prTracer) point(name string, part int) {
	if !t.on.Load() {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.names) >= 32 {
		return
	}
	if part >= 0 {
		name = fmt.Sprintf("%s%d", name, part)
	}
	var ev cuda.Event
	if !callerPoints[name] && len(t.pool) > 0 && (part <= 2 || name == "issued") {
		ev = t.pool[len(t.pool)-1]
		if t.drv.EventRecord(ev, t.stream) == nil {
			t.pool = t.pool[:len(t.pool)-1]
		} else {
			ev = 0
		}
	}
	t.names, t.wall, t.evs = append(t.names, name), append(t.wall, time.Since(t.t0)), append(t.evs, ev)
}

// callerPoints are the trace points on the calling goroutine (the
// engine's tracePoint and the scheduler's submit): no event is recorded.
var callerPoints = map[string]bool{"checked": true, "load": true, "begun": true, "plan": true, "planned": true, "held": true, "submit": true}

// engine returns the benchmarks' engine maker: the CUDA backend with hooks
// h, and, with a tracer (t not nil), the
// engine's streams for it to record on.
func (t *prTracer) engine(h engineHooks) func(Config) (*Engine, error) {
	return func(cfg Config) (*Engine, error) {
		cfg.Backend = BackendCUDA
		e, err := newEngine(cfg, h)
		if err == nil && t != nil {
			t.loadStream = cuda.Stream(e.dev.(*cudadev.CUDA).Stream(transfer.Load))
			t.storeStream = cuda.Stream(e.dev.(*cudadev.CUDA).Stream(transfer.Store))
		}
		return e, err
	}
}

// report logs the traced call's points once its op completed.
func (t *prTracer) report(b *testing.B, head string) {
	if t == nil {
		return
	}
	t.on.Store(false)
	t.mu.Lock()
	defer t.mu.Unlock()
	var sb strings.Builder
	sb.WriteString(head)
	for i, name := range t.names {
		fmt.Fprintf(&sb, "; %s %.3f", name, t.wall[i].Seconds()*1e3)
		if ev := t.evs[i]; ev != 0 {
			if ms, err := t.drv.EventElapsedTime(t.start, ev); err == nil {
				fmt.Fprintf(&sb, " (GPU %.3f)", ms)
			}
			t.pool = append(t.pool, ev)
		}
	}
	b.Log(sb.String() + " (ms from the call; GPU: the op's engine stream reached it, from the caller's event)")
}

// close destroys the tracer's events (every traced load has reported).
func (t *prTracer) close(b *testing.B) {
	if t == nil {
		return
	}
	for _, ev := range t.pool {
		require.NoError(b, t.drv.EventDestroy(ev))
	}
	t.pool = nil
}
