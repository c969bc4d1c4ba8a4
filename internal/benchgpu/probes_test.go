package benchgpu

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
)

// openProbe opens the GPU and a bench of 2 GiB per direction at sizes,
// timed reps times, with the contiguous link measured; the bench is closed
// at the test's end.
func openProbe(t *testing.T, sizes []uint64, reps int) (*cudatest.GPU, *bench, ThroughputResults) {
	t.Helper()
	g := cudatest.Open(t)
	b := &bench{drv: g.Drv, cfg: ThroughputConfig{TotalBytes: 2 << 30, SegSizes: sizes, CTAs: []int{1}, Reps: reps}.withDefaults()}
	t.Cleanup(func() { require.NoError(t, b.close()) })
	require.NoError(t, b.setupBase())
	tr := ThroughputResults{Link: map[string]float64{}}
	require.NoError(t, b.link(&tr))
	return g, b, tr
}

// TestParallelBatch (KVO_BENCH_PARBATCH=1) asks whether the batch API's
// CPU cost per segment (about 0.45 µs on the H200, so 9 GB/s of 4 KiB
// segments from one thread) spreads over several submitting threads: a
// direction's 2 GiB of scattered segments is cut into n parts, each
// submitted by its own goroutine (locked to its thread, the context
// current) on its own stream, and timed on the wall clock from the first
// submission to the last stream's end, CPU cost included. "both" runs the
// other direction as the engine's default kernel launch beside it.
func TestParallelBatch(t *testing.T) {
	if os.Getenv("KVO_BENCH_PARBATCH") != "1" {
		t.Skip("set KVO_BENCH_PARBATCH=1 to measure the batch API submitted from several threads")
	}
	g, b, tr := openProbe(t, []uint64{4 << 10, 16 << 10}, 1)
	batch, err := b.newCopier(g.Dev, cudacopy.Options{Method: cudacopy.MethodBatch})
	require.NoError(t, err)
	b.onClose(batch.Close)
	kernel, err := b.newCopier(g.Dev, cudacopy.Options{Method: cudacopy.MethodKernel})
	require.NoError(t, err)
	b.onClose(kernel.Close)
	_, greatest, err := g.Drv.StreamPriorityRange()
	require.NoError(t, err)
	const maxThreads = 8
	var streams []cuda.Stream
	for range maxThreads {
		s, err := g.Drv.StreamCreate(cuda.StreamNonBlocking, greatest)
		require.NoError(t, err)
		b.onClose(func() error { return g.Drv.StreamDestroy(s) })
		streams = append(streams, s)
	}

	// run submits segs in dir over n threads (and, with other, the other
	// direction's segments through the kernel on b.s) and returns the wall
	// time to the end of every stream and the submit threads' mean CPU time.
	run := func(dir cudacopy.Path, segs []cudacopy.Segment, n int, other []cudacopy.Segment) (time.Duration, time.Duration, error) {
		var wg sync.WaitGroup
		errs := make([]error, n+1)
		busy := make([]time.Duration, n)
		t0 := time.Now()
		for i := range n {
			part := segs[i*len(segs)/n : (i+1)*len(segs)/n]
			wg.Go(func() {
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				if errs[i] = g.Drv.CtxSetCurrent(g.Ctx); errs[i] != nil {
					return
				}
				s0 := time.Now()
				var tks []cudacopy.Ticket
				for lo := 0; lo < len(part); lo += dmaPart {
					x, err := batch.Submit(streams[i], dir, part[lo:min(lo+dmaPart, len(part))])
					if err != nil {
						errs[i] = err
						break
					}
					tks = append(tks, x)
				}
				busy[i] = time.Since(s0)
				errs[i] = errors.Join(errs[i], g.Drv.StreamSynchronize(streams[i]))
				for _, x := range tks {
					errs[i] = errors.Join(errs[i], batch.Retire(x))
				}
			})
		}
		if other != nil {
			od, s := cudacopy.H2D, b.s[1]
			if dir == cudacopy.H2D {
				od, s = cudacopy.D2H, b.s[0]
			}
			x, err := kernel.Submit(s, od, other)
			if err == nil {
				err = errors.Join(g.Drv.StreamSynchronize(s), kernel.Retire(x))
			}
			errs[n] = err
		}
		wg.Wait()
		wall := time.Since(t0)
		var sum time.Duration
		for _, d := range busy {
			sum += d
		}
		return wall, sum / time.Duration(n), errors.Join(errs...)
	}

	var md strings.Builder
	if rollup, err := os.ReadFile("/proc/self/smaps_rollup"); err == nil {
		for _, l := range strings.Split(string(rollup), "\n") {
			if strings.HasPrefix(l, "Rss:") || strings.HasPrefix(l, "AnonHugePages:") {
				md.WriteString(strings.Join(strings.Fields(l), " ") + "; ")
			}
		}
	}
	fmt.Fprintf(&md, "Link: d2h %.1f GB/s, h2d %.1f GB/s, both %.1f GB/s. Batch API from n threads, one stream each, wall clock incl. CPU cost, best of 3; \"both\": the other direction by the default kernel launch.\n\n", tr.Link["d2h"], tr.Link["h2d"], tr.Link["both"])
	md.WriteString("| segment | batch side | other side | threads | GB/s | % of link | submit CPU per thread (ms) |\n|---|---|---|---:|---:|---:|---:|\n")
	for _, size := range b.cfg.SegSizes {
		ss := b.segments(size)
		for _, c := range []struct {
			dir   cudacopy.Path
			segs  []cudacopy.Segment
			other []cudacopy.Segment
			link  string
		}{
			{cudacopy.D2H, ss.d2h, nil, "d2h"},
			{cudacopy.H2D, ss.h2d, nil, "h2d"},
			{cudacopy.D2H, ss.d2h, ss.h2d, "both"},
			{cudacopy.H2D, ss.h2d, ss.d2h, "both"},
		} {
			for _, n := range []int{1, 2, 4, 8} {
				bytes := b.cfg.TotalBytes
				if c.other != nil {
					bytes *= 2
				}
				best, cpu := time.Duration(1<<62), time.Duration(0)
				for rep := range 4 {
					wall, busy, err := run(c.dir, c.segs, n, c.other)
					require.NoError(t, err)
					if rep > 0 && wall < best {
						best, cpu = wall, busy
					}
				}
				rate := float64(bytes) / best.Seconds() / 1e9
				other := "–"
				if c.other != nil {
					other = "kernel"
				}
				fmt.Fprintf(&md, "| %s | %v | %s | %d | %.1f | %.0f%% | %.1f |\n", cudacopy.FormatBytes(size), c.dir, other, n, rate, 100*rate/tr.Link[c.link], cpu.Seconds()*1e3)
			}
		}
	}
	writeBenchOut(t, "parallel_batch", md.String(), nil)
}

// TestMixedBound (KVO_BENCH_PARBATCH=1) bounds a CPU-staged path for both
// directions at once: one direction's scattered segments by the default
// kernel launch while the other moves 2 GiB contiguously by the copy
// engine (what it would move after a CPU gather into a staging area), each
// side timed by its own stream's end; then how fast n threads gather the
// scattered 4 and 16 KiB host segments into one contiguous area.
func TestMixedBound(t *testing.T) {
	if os.Getenv("KVO_BENCH_PARBATCH") != "1" {
		t.Skip("set KVO_BENCH_PARBATCH=1 to measure the bounds of a CPU-staged path")
	}
	g, b, tr := openProbe(t, []uint64{4 << 10, 16 << 10}, 3)
	kernel, err := b.newCopier(g.Dev, cudacopy.Options{Method: cudacopy.MethodKernel})
	require.NoError(t, err)
	b.onClose(kernel.Close)
	n := b.cfg.TotalBytes
	var md strings.Builder
	fmt.Fprintf(&md, "Link: d2h %.1f GB/s, h2d %.1f GB/s, both %.1f GB/s.\n\n", tr.Link["d2h"], tr.Link["h2d"], tr.Link["both"])
	md.WriteString("| segment | kernel side | contiguous side | kernel GB/s | contiguous GB/s | both GB/s | % of both link |\n|---|---|---|---:|---:|---:|---:|\n")
	for _, size := range b.cfg.SegSizes {
		ss := b.segments(size)
		for _, kd := range []cudacopy.Path{cudacopy.D2H, cudacopy.H2D} {
			enqueue := func(tks *[]tk) error {
				if kd == cudacopy.D2H {
					x, err := kernel.Submit(b.s[0], cudacopy.D2H, ss.d2h)
					*tks = append(*tks, tk{kernel, x})
					return errors.Join(err, b.drv.MemcpyAsync(b.devB, cuda.DevicePtr(b.hostB.addr()), n, b.s[1]))
				}
				x, err := kernel.Submit(b.s[1], cudacopy.H2D, ss.h2d)
				*tks = append(*tks, tk{kernel, x})
				return errors.Join(err, b.drv.MemcpyAsync(cuda.DevicePtr(b.hostA.addr()), b.devA, n, b.s[0]))
			}
			tm, err := b.reps(enqueue, true)
			require.NoError(t, err)
			d2h, h2d := gbps(n, tm.bestSides[0]), gbps(n, tm.bestSides[1])
			k, c := d2h, h2d
			if kd == cudacopy.H2D {
				k, c = h2d, d2h
			}
			both := gbps(2*n, tm.best)
			fmt.Fprintf(&md, "| %s | %v | %v | %.1f | %.1f | %.1f | %.0f%% |\n", cudacopy.FormatBytes(size), kd, map[bool]string{true: "H2D", false: "D2H"}[kd == cudacopy.D2H], k, c, both, 100*both/tr.Link["both"])
		}
	}
	md.WriteString("\nCPU gather of the scattered H2D host segments into one contiguous area (the D2H host region), wall clock, best of 3:\n\n| segment | threads | GB/s |\n|---|---:|---:|\n")
	for _, size := range b.cfg.SegSizes {
		segs := b.segments(size).h2d
		base := b.hostB.addr()
		for _, threads := range []int{1, 2, 4, 8, 12} {
			best := time.Duration(1 << 62)
			for range 3 {
				var wg sync.WaitGroup
				t0 := time.Now()
				for i := range threads {
					part := segs[i*len(segs)/threads : (i+1)*len(segs)/threads]
					off := uint64(i*len(segs)/threads) * size
					wg.Go(func() {
						for j, s := range part {
							src := b.hostB.mem[s.Src-base : s.Src-base+s.Len]
							copy(b.hostA.mem[off+uint64(j)*size:off+uint64(j+1)*size], src)
						}
					})
				}
				wg.Wait()
				best = min(best, time.Since(t0))
			}
			fmt.Fprintf(&md, "| %s | %d | %.1f |\n", cudacopy.FormatBytes(size), threads, float64(n)/best.Seconds()/1e9)
		}
	}
	writeBenchOut(t, "mixed_bound", md.String(), nil)
}

// TestStagedLoadProbe (KVO_BENCH_PARBATCH=1) looks for what holds
// SubmitScatter (one DMA per block into device staging, then the kernel
// scatters it) near 72% of the H2D link in the block benchmark, where
// SubmitGather reaches 93–96% D2H: the same loads with the scatter stream
// at the least or greatest priority, a deeper ring of larger chunks, a
// larger scatter grid, and the DMA alone (each block's host run into one
// contiguous device area, no scatter).
func TestStagedLoadProbe(t *testing.T) {
	if os.Getenv("KVO_BENCH_PARBATCH") != "1" {
		t.Skip("set KVO_BENCH_PARBATCH=1 to probe the staged load path")
	}
	g, b, tr := openProbe(t, []uint64{4 << 10}, 3)
	least, greatest, err := g.Drv.StreamPriorityRange()
	require.NoError(t, err)
	aux := map[string]cuda.Stream{}
	for name, prio := range map[string]int{"least": least, "greatest": greatest, "least gather": least, "greatest gather": greatest} {
		s, err := g.Drv.StreamCreate(cuda.StreamNonBlocking, prio)
		require.NoError(t, err)
		b.onClose(func() error { return g.Drv.StreamDestroy(s) })
		aux[name] = s
	}
	copier := func(o cudacopy.Options) *cudacopy.Copier {
		c, err := b.newCopier(g.Dev, o)
		require.NoError(t, err)
		b.onClose(c.Close)
		return c
	}
	def := copier(cudacopy.Options{})
	deep := copier(cudacopy.Options{GatherRing: 8, GatherChunkBytes: 32 << 20})
	wide := copier(cudacopy.Options{CTAs: 8, Threads: 1024})
	batch := copier(cudacopy.Options{Method: cudacopy.MethodBatch})
	var md strings.Builder
	fmt.Fprintf(&md, "Link: h2d %.1f GB/s, both %.1f GB/s. Loads of whole blocks (32 segments each, back to back in a host slot), 2 GiB at random slots, gated, best of 3 (both: %% of the bidirectional link).\n\n", tr.Link["h2d"], tr.Link["both"])
	md.WriteString("| segment | block | variant | GB/s | % of link |\n|---|---|---|---:|---:|\n")
	for _, size := range []uint64{4 << 10, 16 << 10} {
		const per = 32
		d2h, h2d := b.blockSegs(size, per, 1)
		// scatter loads h2d staged with c, its scatter on the aux stream
		// named prio.
		scatter := func(c *cudacopy.Copier, prio string) func(*[]tk) error {
			return func(t *[]tk) error {
				x, err := c.SubmitScatter(b.s[1], aux[prio], h2d)
				*t = append(*t, tk{c, x})
				return err
			}
		}
		// both: the store gathered as cudadev.CUDA does (the gather stream
		// waits for the run's start), the load staged.
		both := func(prio string) func(*[]tk) error {
			return func(t *[]tk) error {
				if err := b.drv.StreamWaitEvent(aux[prio+" gather"], b.ev[0], 0); err != nil {
					return err
				}
				x, err := def.SubmitGather(aux[prio+" gather"], b.s[0], d2h)
				*t = append(*t, tk{def, x})
				if err != nil {
					return err
				}
				return scatter(def, prio)(t)
			}
		}
		// submit loads segs with c's Submit.
		submit := func(c *cudacopy.Copier, segs []cudacopy.Segment) func(*[]tk) error {
			return func(t *[]tk) error {
				x, err := c.Submit(b.s[1], cudacopy.H2D, segs)
				*t = append(*t, tk{c, x})
				return err
			}
		}
		// The DMA alone: each block's host run into the next slot of one
		// contiguous device area.
		var runs []cudacopy.Segment
		for i := 0; i < len(h2d); i += per {
			runs = append(runs, cudacopy.Segment{Dst: uint64(b.devB) + uint64(i)*size, Src: h2d[i].Src, Len: per * size})
		}
		for _, v := range []struct {
			name string
			f    func(*[]tk) error
		}{
			{"staged, scatter stream at least priority", scatter(def, "least")},
			{"staged, scatter stream at greatest priority", scatter(def, "greatest")},
			{"staged, ring 8 × 32 MiB", scatter(deep, "least")},
			{"staged, scatter on 8 × 1024", scatter(wide, "least")},
			{"batch API, one copy per block, no scatter", submit(batch, runs)},
			{"both: staged each way, aux streams at least priority", both("least")},
			{"both: staged each way, aux streams at greatest priority", both("greatest")},
			{"kernel (Submit)", submit(def, h2d)},
		} {
			tm, err := b.reps(v.f, true)
			require.NoError(t, err, v.name)
			mark := ""
			if !tm.held {
				mark = "†"
			}
			bytes, link := b.cfg.TotalBytes, tr.Link["h2d"]
			if strings.HasPrefix(v.name, "both") {
				bytes, link = 2*bytes, tr.Link["both"]
			}
			r := gbps(bytes, tm.best)
			fmt.Fprintf(&md, "| %s | %s | %s | %.1f%s | %.0f%% |\n", cudacopy.FormatBytes(size), cudacopy.FormatBytes(per*size), v.name, r, mark, 100*r/link)
		}
	}
	writeBenchOut(t, "staged_load_probe", md.String(), nil)
}
