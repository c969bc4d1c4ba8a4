package transfer_test

import (
	"math/rand"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	. "github.com/kvoffload/kvoffload/transfer"
)

// TestPrewake: requests submitted after a Prewake (the engine's threads
// polling for them), after a Prewake whose poll ran out (the threads
// asleep again), and from several goroutines that Prewake and Submit at
// once, all complete with the right bytes. A request the polling threads
// dropped, or a kick they swallowed, leaves Wait hanging and fails the
// test; Close after a Prewake with nothing submitted must not hang either
// (the cleanup), nor leave a goroutine (goleak).
func TestPrewake(t *testing.T) {
	{
		t.Run("submitter", func(t *testing.T) {
			const seg, n = 4096, 8 * 4096
			e := newFakeEnvConfig(t, 2*n, cudacopy.Options{Method: cudacopy.MethodMemcpy}, cudafake.Options{Seed: 5},
				Config{Builders: 2, PrewakeSpin: 20 * time.Millisecond})
			require.True(t, e.s.PrewakesOn())
			rng := rand.New(rand.NewSource(6))
			round := func(t *testing.T) {
				src := randBytes(rng, n)
				copy(e.hostBuf, src)
				op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
				require.NoError(t, err)
				waitWithin(t, op, 5*time.Second)
				require.NoError(t, op.Release())
				require.Equal(t, src, e.deviceBytes(t, n))
			}
			for range 3 {
				e.s.Prewake() // never blocks, however many
			}
			round(t)
			for range 3 {
				e.s.PrewakeDone()
			}
			e.s.Prewake()
			time.Sleep(50 * time.Millisecond) // the poll runs out
			round(t)
			e.s.PrewakeDone()
			// Several callers at once (the bytes they load are the same).
			runWorkers(t, 4, 10*time.Second, "concurrent Prewake and Submit", func(int) error {
				for range 10 {
					e.s.Prewake()
					err := submitWait(e.s, lazyLoad(e, n, seg, false, -1, nil))
					e.s.PrewakeDone()
					if err != nil {
						return err
					}
				}
				return nil
			})
			round(t)
			e.s.Prewake() // and nothing follows
			e.s.PrewakeDone()
			require.Zero(t, e.s.AnnouncedPrewakes())
		})
	}
}

// waitWithin waits for op, failing the test after d.
// submitWait submits req, waits for the op and releases it: the first
// error of the three.
func submitWait(s *Scheduler, req Request) error {
	op, err := s.Submit(req)
	if err == nil {
		err = op.Wait()
		_ = op.Release()
	}
	return err
}

// runWorkers runs f(w) for w in [0, n) on n goroutines and waits up to d
// for them (what they do: what), failing on the first error one returned.
func runWorkers(t *testing.T, n int, d time.Duration, what string, f func(w int) error) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for w := range n {
		wg.Go(func() {
			if err := f(w); err != nil {
				errs <- err
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s did not finish within %v", what, d)
	}
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

func waitWithin(t *testing.T, op *Op, d time.Duration) {
	t.Helper()
	ch := make(chan error, 1)
	go func() { ch <- op.Wait() }()
	select {
	case err := <-ch:
		require.NoError(t, err)
	case <-time.After(d):
		t.Fatalf("op did not complete within %v", d)
	}
}
