package offload

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/transfer"
	"github.com/kvoffload/kvoffload/transfer/cudacopy"
)

// BenchmarkGPUHeadSliced: a TP=4 rank of an 8-KV-head model (32 layers,
// head dim 128, bf16, 16-token blocks, token-major tensors of the rank's
// two heads) stores and loads its heads of 1024 blocks: per layer and K/V
// two 2-D copies of 16 rows of 256 bytes a block. The other three ranks
// (views over the same engine) store theirs too, so the blocks become
// loadable. Each rate is compared with a contiguous pinned copy of the same
// bytes in the same run (best of three, before and after the rows); a
// rate over 102% of its reference marks the run invalid. Sub-benchmarks:
// the copy method chosen automatically (auto, what the engine does) and
// the kernel forced (kernel; the batch method, a DMA copy per 256-byte row,
// ran at 1% of the link), each also reporting how long Store and Load took
// to return (the host's share: building and submitting the descriptors).
func BenchmarkGPUHeadSliced(b *testing.B) {
	gpu := cudatest.Open(b)
	var lines []string
	for _, m := range []struct {
		name   string
		method cudacopy.Method
	}{{"auto", cudacopy.MethodAuto}, {"kernel", cudacopy.MethodKernel}} {
		b.Run(m.name, func(b *testing.B) { lines = append(lines, headSliced(b, gpu.Drv, m.name, m.method)) })
	}
	if dir := os.Getenv("KVO_BENCH_OUT"); dir != "" && len(lines) > 0 {
		_ = os.WriteFile(filepath.Join(dir, "headsliced.md"), []byte("# Head-sliced stores and loads\n\n"+strings.Join(lines, "\n\n")+"\n"), 0o644)
	}
}

// headSliced runs one variant of BenchmarkGPUHeadSliced and returns its
// verdict line.
func headSliced(b *testing.B, drv cuda.Driver, name string, method cudacopy.Method) string {
	const tp, heads, layers, blocks = 4, 8, 32, 1024
	g := newGPUMem(b, drv, 8)
	defer g.close()
	n := heads / tp
	seg := uint64(16 * n * 128 * 2) // a rank's K (or V) of one layer of one block
	mk := func(r int) LayoutSpec {
		l := LayoutSpec{Kind: LayoutLayerSeparate, Layers: layers, KVHeads: n, ModelKVHeads: heads, HeadFirst: r * n,
			HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: blocks, Order: OrderTokenMajor}
		for range layers {
			l.LayerTensors = append(l.LayerTensors, LayerTensors{K: g.alloc(seg * blocks), V: g.alloc(seg * blocks), Stride: seg})
		}
		return l
	}
	l1 := mk(1)
	rankBytes := uint64(blocks) * uint64(layers) * 2 * seg
	e, err := newEngine(Config{Backend: BackendCUDA, PoolBytes: int64(rankBytes) * tp * 5 / 4, Layout: l1, Policy: PolicyLRU},
		engineHooks{copyOptions: transfer.CopyOptions{Method: method}})
	require.NoError(b, err)
	defer func() { require.NoError(b, e.Close()) }()
	require.NoError(b, e.WaitGrown(context.Background()))
	var others []*RankView
	for _, r := range []int{0, 2, 3} {
		v, err := e.Rank(mk(r))
		require.NoError(b, err)
		others = append(others, v)
	}
	// The reference: contiguous copies of rankBytes between a pinned buffer
	// and one device allocation, timed with events on a stream of our own.
	hostP, err := drv.MemHostAlloc(rankBytes, cuda.HostAllocPortable)
	require.NoError(b, err)
	defer func() { require.NoError(b, drv.MemFreeHost(hostP)) }()
	devP := g.alloc(rankBytes)
	s, err := drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(b, err)
	defer func() { require.NoError(b, drv.StreamDestroy(s)) }()
	ev0, err := drv.EventCreate(cuda.EventDefault)
	require.NoError(b, err)
	ev1, err := drv.EventCreate(cuda.EventDefault)
	require.NoError(b, err)
	link := func(h2d bool) float64 {
		best := 0.0
		for range 3 {
			require.NoError(b, drv.EventRecord(ev0, s))
			if h2d {
				require.NoError(b, drv.MemcpyAsync(cuda.DevicePtr(devP), cuda.DevicePtr(uintptr(hostP)), rankBytes, s))
			} else {
				require.NoError(b, drv.MemcpyAsync(cuda.DevicePtr(uintptr(hostP)), cuda.DevicePtr(devP), rankBytes, s))
			}
			require.NoError(b, drv.EventRecord(ev1, s))
			require.NoError(b, drv.EventSynchronize(ev1))
			ms, err := drv.EventElapsedTime(ev0, ev1)
			require.NoError(b, err)
			best = max(best, float64(rankBytes)/float64(ms)/1e6)
		}
		return best
	}
	h2d, d2h := link(true), link(false)
	ctx := context.Background()
	keys := make([]Key, blocks)
	ids := make([]int, blocks)
	for i := range ids {
		ids[i] = (i * 7) % blocks
	}
	var store, load, storeCall, loadCall []time.Duration
	b.ResetTimer()
	for it := range b.N {
		for i := range keys {
			keys[i] = testKey(1_000_000 + it*blocks + i)
		}
		for _, v := range others {
			op, err := v.Store(ctx, keys, ids, StoreOptions{})
			require.NoError(b, err)
			require.NoError(b, op.Wait(ctx))
			require.NoError(b, op.Release())
		}
		t0 := time.Now()
		op, err := e.Store(ctx, keys, ids, StoreOptions{})
		storeCall = append(storeCall, time.Since(t0))
		require.NoError(b, err)
		require.NoError(b, op.Wait(ctx))
		store = append(store, time.Since(t0))
		require.Equal(b, blocks, op.Count(OutcomeStored))
		require.NoError(b, op.Release())
		t0 = time.Now()
		op, err = e.Load(ctx, keys, ids, LoadOptions{})
		loadCall = append(loadCall, time.Since(t0))
		require.NoError(b, err)
		require.NoError(b, op.Wait(ctx))
		load = append(load, time.Since(t0))
		require.Equal(b, blocks, op.Count(OutcomeLoaded))
		require.NoError(b, op.Release())
		e.Delete(keys)
	}
	b.StopTimer()
	h2d, d2h = max(h2d, link(true)), max(d2h, link(false))
	rate := func(d []time.Duration) float64 {
		return float64(rankBytes) / slices.Min(d).Seconds() / 1e9
	}
	st, ld := rate(store), rate(load)
	b.ReportMetric(st, "store-GB/s")
	b.ReportMetric(ld, "load-GB/s")
	b.ReportMetric(d2h, "d2h-link-GB/s")
	b.ReportMetric(h2d, "h2d-link-GB/s")
	b.ReportMetric(st/d2h, "store/link")
	b.ReportMetric(ld/h2d, "load/link")
	ms := func(d []time.Duration) float64 { return float64(slices.Min(d).Microseconds()) / 1e3 }
	b.ReportMetric(ms(storeCall), "store-call-ms")
	b.ReportMetric(ms(loadCall), "load-call-ms")
	verdict := fmt.Sprintf("%s: head-sliced TP=%d rank, %d blocks of %d KiB (the rank's heads): store %.1f GB/s = %.1f%% of D2H %.1f "+
		"(call returned after %.2f ms of %.2f); load %.1f GB/s = %.1f%% of H2D %.1f (call returned after %.2f ms of %.2f) (target ≥ 90%% each)",
		name, tp, blocks, rankBytes/blocks>>10, st, 100*st/d2h, d2h, ms(storeCall), ms(store), ld, 100*ld/h2d, h2d, ms(loadCall), ms(load))
	if st/d2h > 1.02 || ld/h2d > 1.02 {
		verdict = "INVALID (a rate beats its reference by more than 2%: the reference is broken): " + verdict
	}
	b.Log(verdict)
	return verdict
}
