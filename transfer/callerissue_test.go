package transfer

import (
	"math/rand"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/transfer/cudacopy"
)

// TestCallerIssues: without early events, a Submit of an op with events
// issues it on the caller's own thread (the fake driver checks that the
// context is current on every thread that calls it), unless
// Config.NoCallerIssue; when the caller's thread cannot take the context,
// the submitting thread issues the op instead. Each way the bytes arrive.
func TestCallerIssues(t *testing.T) {
	const seg, n = 4096, 8 * 4096
	for _, tc := range []struct {
		name       string
		noCaller   bool
		failSwitch bool // the caller's cuCtxSetCurrent fails
		wantHere   bool
	}{
		{"caller", false, false, true},
		{"NoCallerIssue", true, false, false},
		{"caller without the context", false, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnvConfig(t, 2*n, cudacopy.Options{Method: cudacopy.MethodMemcpy}, cudafake.Options{Seed: 3},
				Config{Builders: 2, NoEarlyEvents: true, NoCallerIssue: tc.noCaller})
			require.Nil(t, e.s.early)
			rng := rand.New(rand.NewSource(4))
			for round := range 3 {
				src := randBytes(rng, n)
				copy(e.hostBuf, src)
				if tc.failSwitch {
					e.drv.FailAt(cuda.OpCtxSetCurrent, e.drv.Calls(cuda.OpCtxSetCurrent)+1, cuda.ErrorInvalidContext)
				}
				op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
				require.NoError(t, err)
				waitWithin(t, op, 5*time.Second)
				require.NoError(t, op.Release())
				require.Equal(t, src, e.deviceBytes(t, n), "round %d", round)
			}
			if tc.wantHere {
				require.Positive(t, e.s.issuedHere.Load(), "no Submit issued on its caller's thread")
			} else {
				require.Zero(t, e.s.issuedHere.Load(), "a Submit issued on its caller's thread")
			}
		})
	}
}

// TestCallerIssuesConcurrently: callers issuing their own ops, loads and
// stores from several goroutines at once, beside ops without events queued
// behind the batch bound (which the submitting thread or a caller's round
// takes later): every op completes and each round trip is byte-exact.
func TestCallerIssuesConcurrently(t *testing.T) {
	const seg, per, workers = 4096, 4, 6
	n := uint64(seg * per * workers)
	e := newFakeEnvConfig(t, 2*n, cudacopy.Options{Method: cudacopy.MethodMemcpy}, cudafake.Options{Seed: 9},
		Config{Builders: 2, NoEarlyEvents: true, MaxInFlightBytes: 2 * n, MaxBatchesInFlight: 1})
	rng := rand.New(rand.NewSource(10))
	src := randBytes(rng, n)
	copy(e.hostBuf, src)
	runWorkers(t, workers, 20*time.Second, "concurrent submits", func(w int) error {
		base := uint64(w * seg * per)
		seg := func(i uint64) []Segment {
			return []Segment{{Dev: e.dev + base + i*seg, Host: e.host + base + i*seg, Len: seg}}
		}
		for range 10 {
			for _, dir := range []Direction{Load, Store} {
				var segs []Segment
				for i := range uint64(per) {
					segs = append(segs, seg(i)...)
				}
				if err := submitWait(e.s, Request{Dir: dir, Events: w%2 == 0, Segments: segs}); err != nil {
					return err
				}
			}
		}
		return nil
	})
	require.Equal(t, src, e.deviceBytes(t, n))
	require.Positive(t, e.s.issuedHere.Load())
}

// TestCallerIssuesOnlyItsOwn: a caller issuing its own Load returns once
// its op is enqueued, without issuing a Store submitted meanwhile (whose
// Build here blocks until the test lets it go): that one goes to the
// submitting thread. Issuing until nothing was left held the Load's
// caller until the Store's parts were built.
func TestCallerIssuesOnlyItsOwn(t *testing.T) {
	const seg, n = 4096, 4 * 4096
	e := newFakeEnvConfig(t, 2*n, cudacopy.Options{Method: cudacopy.MethodMemcpy}, cudafake.Options{Seed: 11},
		Config{Builders: 1, NoEarlyEvents: true})
	rng := rand.New(rand.NewSource(12))
	src := randBytes(rng, n)
	copy(e.hostBuf, src)
	inLoad, loadGate, storeGate := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var once sync.Once
	load := Request{Dir: Load, Events: true, Parts: 4, Bytes: n,
		Build: func(p int, dst []Segment) ([]Segment, error) {
			if p == 1 {
				once.Do(func() { close(inLoad) })
				<-loadGate
			}
			off := uint64(p) * seg
			return append(dst, Segment{Dev: e.dev + off, Host: e.host + off, Len: seg}), nil
		}}
	store := Request{Dir: Store, Events: true, Parts: 1, Bytes: seg,
		Build: func(p int, dst []Segment) ([]Segment, error) {
			<-storeGate
			return append(dst, Segment{Dev: e.dev + n, Host: e.host + n, Len: seg}), nil
		}}
	type result struct {
		op  *Op
		err error
	}
	loaded, stored := make(chan result, 1), make(chan result, 1)
	go func() { op, err := e.s.Submit(load); loaded <- result{op, err} }()
	select {
	case <-inLoad:
	case <-time.After(5 * time.Second):
		t.Fatal("the load's parts were not built")
	}
	go func() { op, err := e.s.Submit(store); stored <- result{op, err} }()
	time.Sleep(20 * time.Millisecond) // the store waits in s.immediate
	close(loadGate)
	var l result
	select {
	case l = <-loaded:
	case <-time.After(2 * time.Second):
		close(storeGate)
		t.Fatal("the load's Submit waited for the store submitted after it")
	}
	require.NoError(t, l.err)
	waitWithin(t, l.op, 5*time.Second)
	require.NoError(t, l.op.Release())
	require.Equal(t, src, e.deviceBytes(t, n))
	select {
	case <-stored:
		t.Fatal("the store was issued before its Build could run")
	default:
	}
	close(storeGate)
	var st result
	select {
	case st = <-stored:
	case <-time.After(5 * time.Second):
		t.Fatal("the store's Submit did not return")
	}
	require.NoError(t, st.err)
	waitWithin(t, st.op, 5*time.Second)
	require.NoError(t, st.op.Release())
}

// BenchmarkSubmitAfterIdle: how long a Submit of a 4-part op with events
// takes to return (its copies enqueued) after the engine's threads idled
// for KVO_IDLE_MS (default 20) ms, with the caller issuing its own op and
// with the hand-over to the submitting thread (NoCallerIssue), alternated
// op by op on the fake driver. The idle time is outside the timer.
func BenchmarkSubmitAfterIdle(b *testing.B) {
	idle := 20 * time.Millisecond
	if v := os.Getenv("KVO_IDLE_MS"); v != "" {
		ms, err := strconv.Atoi(v)
		require.NoError(b, err)
		idle = time.Duration(ms) * time.Millisecond
	}
	const seg, n = 4096, 4 * 4096
	for _, noCaller := range []bool{false, true} {
		b.Run(map[bool]string{false: "caller", true: "handover"}[noCaller], func(b *testing.B) {
			e := newFakeEnvConfig(b, n, cudacopy.Options{Method: cudacopy.MethodMemcpy}, cudafake.Options{Seed: 1},
				Config{Builders: 1, NoEarlyEvents: true, NoCallerIssue: noCaller})
			var total time.Duration
			for range b.N {
				time.Sleep(idle)
				t0 := time.Now()
				op, err := e.s.Submit(lazyLoad(e, n, seg, false, -1, nil))
				total += time.Since(t0)
				require.NoError(b, err)
				require.NoError(b, op.Wait())
				require.NoError(b, op.Release())
			}
			b.ReportMetric(float64(total.Microseconds())/float64(b.N), "submit-µs")
		})
	}
}
