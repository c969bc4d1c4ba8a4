package transfer_test

import (
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	. "github.com/kvoffload/kvoffload/transfer"
)

func cpuTime(tb testing.TB) time.Duration {
	var ru unix.Rusage
	require.NoError(tb, unix.Getrusage(unix.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func percentile(d []time.Duration, p float64) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

// BenchmarkGPUCompletion measures, per completion mode: latency from a
// thread spinning on cuEventQuery of the op's event seeing it complete to
// the op's completion callback (median, p99); the process CPU while idle
// for KVO_IDLE_SECONDS (default 10) with the scheduler started (target
// < 0.1% of a core); and the process CPU per wall second while busy with
// back-to-back 1 MiB loads.
func BenchmarkGPUCompletion(b *testing.B) {
	idle := 10 * time.Second
	if v, err := strconv.Atoi(os.Getenv("KVO_IDLE_SECONDS")); err == nil && v > 0 {
		idle = time.Duration(v) * time.Second
	}
	for _, mode := range []Completion{CompletionPoll, CompletionBlocking} {
		b.Run(mode.String(), func(b *testing.B) {
			const n = 1 << 20
			e := newGPUEnv(b, 2*n, Config{Completion: mode})
			// Idle CPU.
			c0, w0 := cpuTime(b), time.Now()
			time.Sleep(idle)
			idlePct := 100 * float64(cpuTime(b)-c0) / float64(time.Since(w0))

			// Latency: a spinner on its own locked thread.
			reps := max(b.N, 2000)
			var lat []time.Duration
			seen := make(chan time.Time, 1)
			for range reps {
				var cbAt atomic.Int64
				op, err := e.s.Submit(Request{Dir: Load, Events: true, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: n}},
					OnComplete: func(*Op, error) { cbAt.Store(time.Now().UnixNano()) }})
				require.NoError(b, err)
				ev, err := op.Event()
				require.NoError(b, err)
				go func() {
					runtime.LockOSThread()
					defer runtime.UnlockOSThread()
					_ = e.g.Drv.CtxSetCurrent(e.g.Ctx)
					for {
						if done, err := e.g.Drv.EventQuery(cuda.Event(ev)); done || err != nil {
							seen <- time.Now()
							return
						}
					}
				}()
				at := <-seen
				require.NoError(b, op.Wait())
				lat = append(lat, time.Duration(max(0, cbAt.Load()-at.UnixNano())))
				require.NoError(b, op.Release())
			}
			// Busy CPU: back-to-back loads, no spinner.
			c0, w0 = cpuTime(b), time.Now()
			for range reps {
				op, err := e.s.Submit(Request{Dir: Load, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: n}}})
				require.NoError(b, err)
				require.NoError(b, op.Wait())
			}
			busyPct := 100 * float64(cpuTime(b)-c0) / float64(time.Since(w0))
			med, p99 := percentile(lat, 0.5), percentile(lat, 0.99)
			b.ReportMetric(float64(med.Microseconds()), "median-µs")
			b.ReportMetric(float64(p99.Microseconds()), "p99-µs")
			b.ReportMetric(idlePct, "idle-cpu-%")
			b.ReportMetric(busyPct, "busy-cpu-%")
			fmt.Printf("| %-8s | median %6.1f µs | p99 %7.1f µs | idle CPU %.4f%% of a core over %v | busy CPU %.1f%% |\n",
				mode, float64(med.Nanoseconds())/1e3, float64(p99.Nanoseconds())/1e3, idlePct, idle, busyPct)
		})
	}
}

// BenchmarkGPUTimeToFirstLayer loads 32 layers × 256 blocks × 16 KiB with
// per-layer events and reports the time until layer 0's event completes
// against the whole load (both from submission, timed with events on a
// caller stream waiting on the op's events).
func BenchmarkGPUTimeToFirstLayer(b *testing.B) {
	const layers, blocks, seg = 32, 256, 16 << 10
	const total = layers * blocks * seg
	e := newGPUEnv(b, total, Config{MaxInFlightBytes: total})
	var segs []Segment
	var ends []int
	for l := range layers {
		for k := range blocks {
			off := uint64(l*blocks+k) * seg
			segs = append(segs, Segment{Dev: e.dev + off, Host: e.host + off, Len: seg})
		}
		ends = append(ends, len(segs))
	}
	cs := e.stream(b)
	mk := func() cuda.Event {
		ev, err := e.g.Drv.EventCreate(cuda.EventDefault)
		require.NoError(b, err)
		b.Cleanup(func() { _ = e.g.Drv.EventDestroy(ev) })
		return ev
	}
	start, first, all := mk(), mk(), mk()
	var firstMs, allMs float64
	b.ResetTimer()
	for range b.N {
		require.NoError(b, e.g.Drv.EventRecord(start, cs))
		op, err := e.s.Submit(Request{Dir: Load, Segments: segs, LayerEnds: ends, Events: true, After: Event(start)})
		require.NoError(b, err)
		l0, err := op.LayerEvent(0)
		require.NoError(b, err)
		whole, err := op.Event()
		require.NoError(b, err)
		require.NoError(b, e.g.Drv.StreamWaitEvent(cs, cuda.Event(l0), 0))
		require.NoError(b, e.g.Drv.EventRecord(first, cs))
		require.NoError(b, e.g.Drv.StreamWaitEvent(cs, cuda.Event(whole), 0))
		require.NoError(b, e.g.Drv.EventRecord(all, cs))
		require.NoError(b, e.g.Drv.StreamSynchronize(cs))
		require.NoError(b, op.Wait())
		require.NoError(b, op.Release())
		f, err := e.g.Drv.EventElapsedTime(start, first)
		require.NoError(b, err)
		a, err := e.g.Drv.EventElapsedTime(start, all)
		require.NoError(b, err)
		firstMs += float64(f)
		allMs += float64(a)
	}
	firstMs /= float64(b.N)
	allMs /= float64(b.N)
	b.ReportMetric(firstMs*1e3, "first-layer-µs")
	b.ReportMetric(allMs*1e3, "whole-load-µs")
	b.ReportMetric(float64(total)/(allMs*1e-3)/1e9, "GB/s")
	fmt.Printf("| %d layers × %d × 16 KiB | first layer %.1f µs | whole load %.1f µs | %.1f GB/s |\n",
		layers, blocks, firstMs*1e3, allMs*1e3, float64(total)/(allMs*1e-3)/1e9)
}
