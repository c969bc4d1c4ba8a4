package main

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/offload"
)

// TestServingDuringGrowth measures what background growth of the pool costs
// the serving loop: the demo's request rate while the pool grows against
// its rate once the pool is full (the same run, the same trace), the
// longest gap between two requests while it grows, and how long after its
// --duration a demo returns while growth is still running (its Close
// included). It is a measurement, not a unit test: it maps and prefaults
// the pool asked for and runs for tens of seconds, so it runs only when
// KVO_GROWTH_BENCH gives the pool size:
//
//	KVO_GROWTH_BENCH=8GiB go test -run TestServingDuringGrowth -v -count=1 ./cmd/kvoffload
//
// KVO_GROWTH_THREADS sets --prefault-threads (0 or unset: the default),
// KVO_GROWTH_NICE --prefault-nice.
// The demo is the one of issue 19: --layout tiny --gpu-blocks 64, host
// backend, no pinning. The results of a run are in
// bench/results/cpu/growth-serving.md.
func TestServingDuringGrowth(t *testing.T) {
	spec := os.Getenv("KVO_GROWTH_BENCH")
	if spec == "" {
		t.Skip("set KVO_GROWTH_BENCH to a pool size (e.g. 8GiB) to run this measurement")
	}
	pool, err := parseSize(spec)
	require.NoError(t, err)
	threads := 0
	if s := os.Getenv("KVO_GROWTH_THREADS"); s != "" {
		threads, err = strconv.Atoi(s)
		require.NoError(t, err)
	}
	cfg := defaultDemoConfig()
	cfg.layoutName, cfg.gpuBlocks, cfg.poolBytes = "tiny", 64, pool
	cfg.backend, cfg.pinning, cfg.prefaultThreads = offload.BackendHost, string(offload.PinNone), threads
	if s := os.Getenv("KVO_GROWTH_NICE"); s != "" {
		cfg.prefaultNice, err = strconv.Atoi(s)
		require.NoError(t, err)
	}
	shown := threads
	if shown == 0 {
		shown = mmapmem.DefaultPrefaultThreads()
	}
	t.Logf("pool %s, %d CPUs, prefault threads %d", formatSize(pool), runtime.NumCPU(), shown)

	// The rates: serve until the pool has been full for afterFull.
	const afterFull = 5 * time.Second
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var (
		eng     *offload.Engine
		done    []time.Time // completion of each request
		fullAt  time.Time
		started = time.Now() // before New: Stats' durations count from New
	)
	cfg.duration = 10 * time.Minute
	cfg.afterRequest = func(e *offload.Engine, _ []offload.Key) error {
		now := time.Now()
		eng = e
		done = append(done, now)
		if fullAt.IsZero() && len(done)%8 == 0 {
			if full := e.Stats().Pool.FullPool; full > 0 {
				fullAt = started.Add(full)
			}
		}
		if !fullAt.IsZero() && now.Sub(fullAt) >= afterFull {
			cancel()
		}
		return nil
	}
	_, err = runDemo(ctx, cfg, nil, noNotice)
	require.NoError(t, err)
	require.NotNil(t, eng)
	require.False(t, fullAt.IsZero(), "the pool never became full")
	st := eng.Stats()
	serveFrom := started.Add(st.Pool.FirstSlot)
	var during, after int
	var gap time.Duration
	prev := serveFrom
	for _, d := range done {
		switch {
		case d.Before(fullAt):
			during++
			gap = max(gap, d.Sub(prev))
		case d.Sub(fullAt) <= afterFull:
			after++
		}
		prev = d
	}
	fullPool := st.Pool.FullPool
	growSecs := fullAt.Sub(serveFrom).Seconds()
	rateDuring := float64(during) / growSecs
	rateAfter := float64(after) / afterFull.Seconds()
	t.Logf("growth: first slot %v, full pool %v", st.Pool.FirstSlot.Round(time.Millisecond), st.Pool.FullPool.Round(time.Millisecond))
	t.Logf("while growing: %d requests in %.2f s = %.0f req/s, longest gap between requests %v", during, growSecs, rateDuring, gap.Round(time.Millisecond))
	t.Logf("pool full:     %d requests in %.2f s = %.0f req/s", after, afterFull.Seconds(), rateAfter)
	t.Logf("ratio while growing / full: %.0f%%", 100*rateDuring/rateAfter)

	// --duration while growth runs: a fresh engine, a run shorter than
	// the growth; the time runDemo takes beyond New and the duration is
	// the last request and Close.
	const short = time.Second
	cfg = defaultDemoConfig()
	cfg.layoutName, cfg.gpuBlocks, cfg.poolBytes = "tiny", 64, pool
	cfg.backend, cfg.pinning, cfg.prefaultThreads = offload.BackendHost, string(offload.PinNone), threads
	if s := os.Getenv("KVO_GROWTH_NICE"); s != "" {
		cfg.prefaultNice, err = strconv.Atoi(s)
		require.NoError(t, err)
	}
	cfg.duration = short
	eng = nil
	cfg.afterRequest = func(e *offload.Engine, _ []offload.Key) error { eng = e; return nil }
	t0 := time.Now()
	rep, err := runDemo(context.Background(), cfg, nil, noNotice)
	took := time.Since(t0)
	require.NoError(t, err)
	require.NotNil(t, eng)
	st = eng.Stats()
	over := took - st.Pool.FirstSlot - short
	t.Logf("--duration %v: %d requests, runDemo returned %v after New, %v past the duration (growing: %v; Close and the last request)",
		short, rep.Requests, (took - st.Pool.FirstSlot).Round(time.Millisecond), over.Round(time.Millisecond), st.Pool.FullPool == 0 || st.Pool.FullPool > st.Pool.FirstSlot+short)
	fmt.Fprintf(os.Stderr, "summary: pool %s threads %d full %.2fs during %.0f req/s after %.0f req/s ratio %.0f%% gap %v over-duration %v\n",
		formatSize(pool), shown, fullPool.Seconds(), rateDuring, rateAfter, 100*rateDuring/rateAfter, gap.Round(time.Millisecond), over.Round(time.Millisecond))
}
