package offload

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
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
	variants := os.Getenv("KVO_HS_VARIANTS")
	if variants == "" {
		variants = "auto kernel"
	}
	for _, v := range strings.Fields(variants) {
		h, err := hsVariant(v)
		require.NoError(b, err)
		b.Run(v, func(b *testing.B) { lines = append(lines, headSliced(b, gpu.Drv, v, h)) })
	}
	if dir := os.Getenv("KVO_BENCH_OUT"); dir != "" && len(lines) > 0 {
		_ = os.WriteFile(filepath.Join(dir, "headsliced.md"), []byte("# Head-sliced stores and loads\n\n"+strings.Join(lines, "\n\n")+"\n"), 0o644)
	}
}

// hsVariant parses a variant of BenchmarkGPUHeadSliced (KVO_HS_VARIANTS:
// space-separated, each a method, auto, kernel, batch or memcpy, then :key=value pairs
// of ctas, sctas (cudacopy.Options.StagedCTAs), threads, part (segments a part), builders, chunk (bytes), inline
// (inline=1: descriptor tables uploaded on the copy stream, see
// cudacopy.Options.UploadOnCopyStream), growth
// (partGrowthEnv's parts that grow) and notmpl (notmpl=1: no template requests)).
func hsVariant(v string) (engineHooks, error) {
	fs := strings.Split(v, ":")
	var h engineHooks
	switch fs[0] {
	case "auto":
	case "kernel":
		h.copyOptions.Method = cudacopy.MethodKernel
	case "batch":
		h.copyOptions.Method = cudacopy.MethodBatch
	case "memcpy":
		h.copyOptions.Method = cudacopy.MethodMemcpy
	default:
		return h, fmt.Errorf("variant %q: method %q is not auto, kernel, batch or memcpy", v, fs[0])
	}
	for _, kv := range fs[1:] {
		k, val, _ := strings.Cut(kv, "=")
		n, err := strconv.Atoi(val)
		if err != nil || n <= 0 {
			return h, fmt.Errorf("variant %q: %q is not key=positive integer", v, kv)
		}
		switch k {
		case "ctas":
			h.copyOptions.CTAs = n
		case "sctas":
			h.copyOptions.StagedCTAs = n
		case "threads":
			h.copyOptions.Threads = n
		case "part":
			h.partSegments = n
		case "builders":
			h.builders = n
		case "chunk":
			h.copyOptions.ChunkBytes = n
		case "growth":
			h.partGrowth = n // growth=N: parts that grow (partGrowthEnv)
		case "notmpl":
			h.noTemplates = true // notmpl=1: no template requests (parts of segments, as before them)
		case "inline":
			h.copyOptions.UploadOnCopyStream = true // inline=1: each table uploaded on the copy stream before its launch
		default:
			return h, fmt.Errorf("variant %q: unknown key %q", v, k)
		}
	}
	return h, nil
}

// headSliced runs one variant of BenchmarkGPUHeadSliced and returns its
// verdict line.
func headSliced(b *testing.B, drv cuda.Driver, name string, h engineHooks) string {
	g := newGPUMem(b, drv, 8)
	defer g.close()
	var tr *prTracer
	if os.Getenv("KVO_PR_TRACE") != "" {
		tr = &prTracer{drv: drv}
		h.trace = tr.point
	}
	defer tr.close(b)
	rig := newHeadSlicedRig(b, g, 128, tr.engine(h))
	defer func() { require.NoError(b, rig.e.Close()) }()
	rig.tr = tr
	rankBytes := rig.rankBytes
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
	link := contiguousLink(b, drv, s, ev0, ev1, hostP, devP, rankBytes)
	h2d, d2h := link(true), link(false)
	ts, err := drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(b, err)
	defer func() { require.NoError(b, drv.StreamDestroy(ts)) }()
	rig.gpu = &gpuTiming{drv: drv, s: ts, e0: ev0, e1: ev1}
	var store, load, storeCall, loadCall, storeGPU, loadGPU []time.Duration
	b.ResetTimer()
	for it := range b.N {
		m := rig.round(b, it)
		storeCall, store = append(storeCall, m.storeCall), append(store, m.store)
		loadCall, load = append(loadCall, m.loadCall), append(load, m.load)
		storeGPU, loadGPU = append(storeGPU, m.storeGPU), append(loadGPU, m.loadGPU)
	}
	b.StopTimer()
	h2d, d2h = max(h2d, link(true)), max(d2h, link(false))
	rate := func(d []time.Duration) float64 {
		return float64(rankBytes) / slices.Min(d).Seconds() / 1e9
	}
	st, ld := rate(store), rate(load)
	stG, ldG := rate(storeGPU), rate(loadGPU)
	b.ReportMetric(stG/d2h, "store-gpu/link")
	b.ReportMetric(ldG/h2d, "load-gpu/link")
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
		"(call returned after %.2f ms of %.2f); load %.1f GB/s = %.1f%% of H2D %.1f (call returned after %.2f ms of %.2f); "+
		"GPU side (a caller's stream from before the call until it waited on the op): store %.1f%%, load %.1f%% (target ≥ 90%% each)",
		name, hsTP, hsBlocks, rankBytes/hsBlocks>>10, st, 100*st/d2h, d2h, ms(storeCall), ms(store), ld, 100*ld/h2d, h2d, ms(loadCall), ms(load),
		100*stG/d2h, 100*ldG/h2d)
	if st/d2h > 1.02 || ld/h2d > 1.02 || stG/d2h > 1.02 || ldG/h2d > 1.02 {
		verdict = "INVALID (a rate beats its reference by more than 2%: the reference is broken): " + verdict
	}
	b.Log(verdict)
	return verdict
}

// contiguousLink returns the benchmarks' link reference: the best of three
// contiguous copies of n bytes between the pinned hostP and the device
// allocation devP, each way, on the caller's stream s timed with ev0 and
// ev1, in GB/s.
func contiguousLink(b *testing.B, drv cuda.Driver, s cuda.Stream, ev0, ev1 cuda.Event, hostP unsafe.Pointer, devP, n uint64) func(h2d bool) float64 {
	return func(h2d bool) float64 {
		best := 0.0
		for range 3 {
			require.NoError(b, drv.EventRecord(ev0, s))
			if h2d {
				require.NoError(b, drv.MemcpyAsync(cuda.DevicePtr(devP), cuda.DevicePtr(uintptr(hostP)), n, s))
			} else {
				require.NoError(b, drv.MemcpyAsync(cuda.DevicePtr(uintptr(hostP)), cuda.DevicePtr(devP), n, s))
			}
			require.NoError(b, drv.EventRecord(ev1, s))
			require.NoError(b, drv.EventSynchronize(ev1))
			ms, err := drv.EventElapsedTime(ev0, ev1)
			require.NoError(b, err)
			best = max(best, float64(n)/float64(ms)/1e6)
		}
		return best
	}
}
