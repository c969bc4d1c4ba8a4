package transfer

import (
	"math/rand"
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
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
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
					op, err := e.s.Submit(Request{Dir: dir, Events: w%2 == 0, Segments: segs})
					if err == nil {
						err = op.Wait()
						_ = op.Release()
					}
					if err != nil {
						errs <- err
						return
					}
				}
			}
		}()
	}
	workersWithin(t, &wg, errs, 20*time.Second, "concurrent submits")
	require.Equal(t, src, e.deviceBytes(t, n))
	require.Positive(t, e.s.issuedHere.Load())
}
