package transfer

import (
	"errors"
	"math/rand"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/transfer/cudacopy"
)

// newHeadEnv is a fake-driver env with early events and Config.EarlyHead
// head, two builders.
func newHeadEnv(t *testing.T, size, seed uint64, head time.Duration) *fakeEnv {
	t.Helper()
	e := newFakeEnvConfig(t, size, cudacopy.Options{Method: cudacopy.MethodMemcpy}, cudafake.Options{Seed: seed},
		Config{Builders: 2, EarlyHead: head})
	require.NotNil(t, e.s.early, e.cu.EarlyEventsOff())
	return e
}

// holdSubmitter stops the submitting thread before it next takes issueMu
// (it may be past that point for a wake already taken: the tests hold it
// before their first Submit); the function returned lets it go (once).
func (e *fakeEnv) holdSubmitter(t *testing.T) (release func()) {
	t.Helper()
	h := make(chan struct{})
	e.s.holdSubmitter.Store(&h)
	var once sync.Once
	release = func() {
		once.Do(func() {
			e.s.holdSubmitter.Store(nil)
			close(h)
		})
	}
	t.Cleanup(release)
	return release
}

// TestEarlyHead: with early events and EarlyHead, a Submit of a lazy op
// builds and copies the op's first parts on the caller's thread before it
// returns, and writes the counter value of each layer it completes: with
// the submitting thread held, a head with time to spare issues the whole
// op (every layer's event completes, the bytes arrive), and a head of one
// part completes layer 0 only. Released, the submitting thread issues
// the rest and completes the op, byte-exact. Without the head's counter
// writes the layer events could not complete while the thread is held.
func TestEarlyHead(t *testing.T) {
	const seg, n = 4096, 3 * 4096
	for _, tc := range []struct {
		name      string
		head      time.Duration
		wantParts int64
		wantDone  int // layers whose events complete with the thread held
	}{
		{"whole op", time.Minute, 3, 3},
		{"one part", time.Nanosecond, 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newHeadEnv(t, 2*n, 21, tc.head)
			src := randBytes(rand.New(rand.NewSource(22)), n)
			copy(e.hostBuf, src)
			release := e.holdSubmitter(t)
			op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, true, -1, nil), 5*time.Second)
			require.NoError(t, err)
			require.Equal(t, tc.wantParts, e.s.headParts.Load(), "parts the caller issued")
			mine := e.callerWaitsLayers(t, op, 3)
			for l := range tc.wantDone {
				require.NoError(t, e.drv.EventSynchronize(mine[l]), "layer %d", l)
			}
			require.Equal(t, src[:tc.wantDone*seg], e.deviceBytes(t, uint64(tc.wantDone*seg)))
			time.Sleep(20 * time.Millisecond)
			for l := tc.wantDone; l < 3; l++ {
				require.False(t, e.done(t, mine[l]), "layer %d's event completed before the submitting thread issued it", l)
			}
			release()
			require.NoError(t, e.drv.EventSynchronize(mine[2]))
			waitWithin(t, op, 5*time.Second)
			require.NoError(t, op.Release())
			require.Equal(t, src, e.deviceBytes(t, n))

			// The engine goes on: a store and a load after it.
			copy(e.hostBuf, make([]byte, n))
			st, err := submitWithin(t, e.s, Request{Dir: Store, Events: true, Segments: []Segment{{Dev: e.dev, Host: e.host, Len: n}}}, 5*time.Second)
			require.NoError(t, err)
			waitWithin(t, st, 5*time.Second)
			require.NoError(t, st.Release())
			require.Equal(t, src, e.hostBuf[:n])
		})
	}
}

// TestEarlyHeadParts: a head stops once the submitting thread waits to
// take over (takeover, set here by hand with the thread held) and
// EarlyHeadParts parts are issued: 1 (also the default, 0) or 3 of 5.
func TestEarlyHeadParts(t *testing.T) {
	const seg, n = 4096, 5 * 4096
	for _, tc := range []struct{ parts, want int }{{0, 1}, {1, 1}, {3, 3}} {
		e := newFakeEnvConfig(t, 2*n, cudacopy.Options{Method: cudacopy.MethodMemcpy}, cudafake.Options{Seed: 29},
			Config{Builders: 2, EarlyHead: time.Minute, EarlyHeadParts: tc.parts})
		require.NotNil(t, e.s.early)
		src := randBytes(rand.New(rand.NewSource(30)), n)
		copy(e.hostBuf, src)
		release := e.holdSubmitter(t)
		e.s.takeover.Store(true)
		op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
		require.NoError(t, err)
		require.Equal(t, int64(tc.want), e.s.headParts.Load(), "EarlyHeadParts %d", tc.parts)
		e.s.takeover.Store(false)
		release()
		waitWithin(t, op, 5*time.Second)
		require.NoError(t, op.Release())
		require.Equal(t, src, e.deviceBytes(t, n))
	}
	_, err := New(nil, Config{EarlyHeadParts: -1})
	require.ErrorIs(t, err, ErrInvalidRequest)
	_, err = New(nil, Config{EarlyHead: -time.Second})
	require.ErrorIs(t, err, ErrInvalidRequest)
}

// TestEarlyHeadWaitsItsTurn: a Submit does not issue a head while an
// earlier op of its direction waits to be issued: its counter values are
// greater, and writing them first would complete the earlier op's events
// before its copies. With the submitting thread held, an op without a
// head (segments given) waits; a lazy op submitted after it issues
// nothing on its caller's thread, and the first op's event stays pending
// until the thread is released. Both then complete, byte-exact.
func TestEarlyHeadWaitsItsTurn(t *testing.T) {
	const seg, n = 4096, 4 * 4096
	e := newHeadEnv(t, 4*n, 23, time.Minute)
	rng := rand.New(rand.NewSource(24))
	src := randBytes(rng, 2*n)
	copy(e.hostBuf, src)
	release := e.holdSubmitter(t)
	first, err := submitWithin(t, e.s, Request{Dir: Load, Events: true, Segments: []Segment{{Dev: e.dev + n, Host: e.host + n, Len: n}}}, 5*time.Second)
	require.NoError(t, err)
	firstEv, err := first.Event()
	require.NoError(t, err)
	firstMine := e.callerWaits(t, firstEv)
	second, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
	require.NoError(t, err)
	require.Zero(t, e.s.headParts.Load(), "a head was issued before an earlier op of its direction")
	time.Sleep(20 * time.Millisecond)
	require.False(t, e.done(t, firstMine), "the first op's event completed before its copies were issued")
	release()
	require.NoError(t, e.drv.EventSynchronize(firstMine))
	waitWithin(t, first, 5*time.Second)
	waitWithin(t, second, 5*time.Second)
	require.NoError(t, first.Release())
	require.NoError(t, second.Release())
	require.Equal(t, src, e.deviceBytes(t, 2*n))

	// Its turn come, the next lazy op issues a head.
	op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
	require.NoError(t, err)
	waitWithin(t, op, 5*time.Second)
	require.NoError(t, op.Release())
	require.Positive(t, e.s.headParts.Load())
}

// TestEarlyHeadFailure: a head whose first part fails to build still
// returns the op from Submit (its events are promised); the op fails with
// the build's error once the submitting thread takes it, its event
// completes, and the engine goes on serving.
func TestEarlyHeadFailure(t *testing.T) {
	const seg, n = 4096, 4 * 4096
	e := newHeadEnv(t, 2*n, 25, time.Minute)
	src := randBytes(rand.New(rand.NewSource(26)), n)
	copy(e.hostBuf, src)
	boom := errors.New("boom")
	release := e.holdSubmitter(t)
	op, err := submitWithin(t, e.s, failingPart(lazyLoad(e, n, seg, true, -1, nil), 1, boom), 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, int64(1), e.s.headParts.Load(), "the head stops at the part that failed")
	ev, err := op.Event()
	require.NoError(t, err)
	mine := e.callerWaits(t, ev)
	release()
	require.NoError(t, e.drv.EventSynchronize(mine), "a failed op's event must complete")
	select {
	case <-op.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the failed op did not complete")
	}
	require.ErrorIs(t, op.Err(), boom)
	require.ErrorContains(t, op.Err(), "building part 1")
	require.NoError(t, op.Release())

	e.loadGoesOn(t, n, seg, false, src)
}

// TestEarlyHeadBatchEventFailure: when the batch that takes a head's op
// cannot get its batch event, the op fails only once the head's copies
// (slowed here) have finished: its bytes are all there when it is done.
// Reporting the failure at once let the caller reuse blocks still being
// copied.
func TestEarlyHeadBatchEventFailure(t *testing.T) {
	const seg, n = 4096, 4 * 4096
	e := newFakeEnvConfig(t, 2*n, cudacopy.Options{Method: cudacopy.MethodMemcpy},
		cudafake.Options{Seed: 31, CopyMinDelay: 20 * time.Millisecond, CopyMaxDelay: 30 * time.Millisecond},
		Config{Builders: 2, EarlyHead: time.Minute})
	require.NotNil(t, e.s.early)
	src := randBytes(rand.New(rand.NewSource(32)), n)
	copy(e.hostBuf, src)
	release := e.holdSubmitter(t)
	op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, int64(4), e.s.headParts.Load(), "the whole op in the head")
	e.drv.FailAt(cuda.OpEventCreate, e.drv.Calls(cuda.OpEventCreate)+1, cuda.ErrorOutOfMemory)
	release()
	select {
	case <-op.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the op did not complete")
	}
	require.Error(t, op.Err())
	require.Equal(t, src, e.deviceBytes(t, n), "the op was reported failed before its head's copies finished")
	require.NoError(t, op.Release())

	e.loadGoesOn(t, n, seg, true, nil) // the engine goes on
}

// TestEarlyHeadRestoreFailure: a failure to restore the caller's capture
// mode after its op's events were promised and its head issued does not
// fail the Submit (the copies are enqueued; the op completes and its
// bytes arrive), as a caller issuing its own op ignores it.
func TestEarlyHeadRestoreFailure(t *testing.T) {
	const seg, n = 4096, 4 * 4096
	e := newHeadEnv(t, 2*n, 33, time.Minute)
	src := randBytes(rand.New(rand.NewSource(34)), n)
	copy(e.hostBuf, src)
	release := e.holdSubmitter(t)
	// The second exchange of this Submit's OnThread is the restore.
	e.drv.FailAt(cuda.OpThreadExchangeStreamCaptureMode, e.drv.Calls(cuda.OpThreadExchangeStreamCaptureMode)+2, cuda.ErrorInvalidValue)
	op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
	require.NoError(t, err, "a Submit whose head was issued failed on the restore after it")
	require.Positive(t, e.s.headParts.Load())
	release()
	waitWithin(t, op, 5*time.Second)
	require.NoError(t, op.Release())
	require.Equal(t, src, e.deviceBytes(t, n))
}

// TestEarlyHeadOtherDirectionWaits: no head while an op of the other
// direction waits to be issued (a load's head would otherwise hold back a
// store it may depend on through After): with the submitting thread held,
// a store with events waits, and a lazy load submitted after it issues
// nothing on its caller's thread. Released, both complete.
func TestEarlyHeadOtherDirectionWaits(t *testing.T) {
	const seg, n = 4096, 4 * 4096
	e := newHeadEnv(t, 4*n, 35, time.Minute)
	src := randBytes(rand.New(rand.NewSource(36)), n)
	copy(e.hostBuf, src)
	release := e.holdSubmitter(t)
	st, err := submitWithin(t, e.s, Request{Dir: Store, Events: true, Segments: []Segment{{Dev: e.dev + 2*n, Host: e.host + 2*n, Len: n}}}, 5*time.Second)
	require.NoError(t, err)
	ld, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
	require.NoError(t, err)
	require.Zero(t, e.s.headParts.Load(), "a load's head ran while a store waited to be issued")
	release()
	waitWithin(t, st, 5*time.Second)
	waitWithin(t, ld, 5*time.Second)
	require.NoError(t, st.Release())
	require.NoError(t, ld.Release())
	require.Equal(t, src, e.deviceBytes(t, n))
}

// TestEarlyHeadConcurrently: lazy loads and stores with early events and
// heads from several goroutines at once, beside ops without events, with
// a short head (so the submitting thread takes over mid-op) and a long
// one: every op completes and each round trip is byte-exact.
func TestEarlyHeadConcurrently(t *testing.T) {
	const seg, per, workers = 4096, 6, 6
	for _, head := range []time.Duration{20 * time.Microsecond, time.Minute} {
		t.Run(head.String(), func(t *testing.T) {
			n := uint64(seg * per * workers)
			e := newHeadEnv(t, 2*n, 27, head)
			src := randBytes(rand.New(rand.NewSource(28)), n)
			copy(e.hostBuf, src)
			runWorkers(t, workers, 30*time.Second, "concurrent submits with heads", func(w int) error {
				base := uint64(w * seg * per)
				build := func(p int, dst []Segment) ([]Segment, error) {
					off := base + uint64(p)*seg
					return append(dst, Segment{Dev: e.dev + off, Host: e.host + off, Len: seg}), nil
				}
				for round := range 10 {
					for _, dir := range []Direction{Load, Store} {
						req := Request{Dir: dir, Events: w%3 != 0, Parts: per, Layered: round%2 == 0, Bytes: seg * per, Build: build}
						if err := submitWait(e.s, req); err != nil {
							return err
						}
					}
				}
				return nil
			})
			require.Equal(t, src, e.deviceBytes(t, n))
			require.Positive(t, e.s.headParts.Load())
		})
	}
}

// TestEarlyHeadFirstPartBeforePromise: the head builds and copies its op's
// first part before the layers' events are recorded behind their counter
// waits (promiseLayers), and the events are all recorded before Submit
// returns. It fails if the promise went first again (the first copy 0.1 ms
// later on the H200 machine) or if Submit returned before it.
func TestEarlyHeadFirstPartBeforePromise(t *testing.T) {
	const seg, n = 4096, 3 * 4096
	e := newHeadEnv(t, 2*n, 41, time.Minute)
	release := e.holdSubmitter(t)
	waits0 := e.drv.Calls(cuda.OpStreamWaitValue64)
	var atPart [3]int
	req := lazyLoad(e, n, seg, true, -1, nil)
	build := req.Build
	req.Build = func(p int, dst []Segment) ([]Segment, error) {
		atPart[p] = e.drv.Calls(cuda.OpStreamWaitValue64) - waits0
		return build(p, dst)
	}
	op, err := submitWithin(t, e.s, req, 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, 3, e.drv.Calls(cuda.OpStreamWaitValue64)-waits0, "Submit returned before its 3 layers' waits were enqueued")
	require.Equal(t, int64(3), e.s.headParts.Load())
	require.Equal(t, [3]int{0, 3, 3}, atPart, "counter waits enqueued before each part was built")
	release()
	waitWithin(t, op, 5*time.Second)
	require.NoError(t, op.Release())
}

// TestEarlyHeadPromiseFailure: when recording the layers' events fails
// after the head's first copies were enqueued, Submit fails, and only once
// those copies (slowed here) have finished: the caller frees what the op
// would have copied as soon as Submit fails. The scheduler goes on, and
// the failed op's counter values are written in their turn (Close does
// not hang on the signal stream).
func TestEarlyHeadPromiseFailure(t *testing.T) {
	const seg, n = 4096, 4 * 4096
	e := newFakeEnvConfig(t, 2*n, cudacopy.Options{Method: cudacopy.MethodMemcpy},
		cudafake.Options{Seed: 43, CopyMinDelay: 20 * time.Millisecond, CopyMaxDelay: 30 * time.Millisecond, SyncingFree: true},
		Config{Builders: 2, EarlyHead: time.Minute})
	require.NotNil(t, e.s.early)
	src := randBytes(rand.New(rand.NewSource(44)), n)
	copy(e.hostBuf, src)
	release := e.holdSubmitter(t)
	e.drv.FailAt(cuda.OpStreamWaitValue64, e.drv.Calls(cuda.OpStreamWaitValue64)+2, cuda.ErrorInvalidValue)
	_, err := submitWithin(t, e.s, lazyLoad(e, n, seg, true, -1, nil), 5*time.Second)
	require.Error(t, err)
	require.ErrorContains(t, err, "promising layer 1's events")
	require.Equal(t, int64(0), e.s.headParts.Load(), "the head stops at its first part when the promise fails")
	require.Equal(t, src[:seg], e.deviceBytes(t, seg), "Submit failed before the head's copies finished")
	release()

	e.loadGoesOn(t, n, seg, true, src)
}

// TestEarlyHeadPromiseFailureDeviceLost: when, after a failed promise, the
// head's copies cannot be waited for either, the device is lost: Submit's
// error says so (ErrDeviceLost, which the engine reads to mark itself
// lost), and the scheduler refuses later requests.
func TestEarlyHeadPromiseFailureDeviceLost(t *testing.T) {
	const seg, n = 4096, 4 * 4096
	e := newHeadEnv(t, 2*n, 45, time.Minute)
	release := e.holdSubmitter(t)
	defer release()
	e.drv.FailAt(cuda.OpStreamWaitValue64, e.drv.Calls(cuda.OpStreamWaitValue64)+2, cuda.ErrorInvalidValue)
	e.drv.FailAt(cuda.OpStreamSynchronize, e.drv.Calls(cuda.OpStreamSynchronize)+1, cuda.ErrorLaunchFailed)
	_, err := submitWithin(t, e.s, lazyLoad(e, n, seg, true, -1, nil), 5*time.Second)
	require.ErrorContains(t, err, "promising layer 1's events")
	require.ErrorIs(t, err, ErrDeviceLost)
	_, err = submitWithin(t, e.s, lazyLoad(e, n, seg, true, -1, nil), 5*time.Second)
	require.ErrorIs(t, err, ErrDeviceLost)
}

// loadGoesOn checks that the scheduler goes on after a failure: a lazy
// load of n bytes in parts of seg completes, and, with want, the device
// then holds want.
func (e *fakeEnv) loadGoesOn(t *testing.T, n, seg uint64, layered bool, want []byte) {
	t.Helper()
	ok, err := submitWithin(t, e.s, lazyLoad(e, n, seg, layered, -1, nil), 5*time.Second)
	require.NoError(t, err)
	waitWithin(t, ok, 10*time.Second)
	require.NoError(t, ok.Release())
	if want != nil {
		require.Equal(t, want, e.deviceBytes(t, n))
	}
}
