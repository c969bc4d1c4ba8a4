package transfer

import (
	"bytes"
	"errors"
	"math/rand"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/transfer/cudacopy"
)

// lazyLoad is a load of the env's first n bytes from host to device in
// parts of seg bytes, whose part gated (if ≥ 0) is built only once gate
// is closed.
func lazyLoad(e *fakeEnv, n, seg uint64, layered bool, gated int, gate <-chan struct{}) Request {
	parts := int(n / seg)
	return Request{
		Dir: Load, Events: true, Parts: parts, Layered: layered, Bytes: n,
		Build: func(p int, dst []Segment) ([]Segment, error) {
			if p == gated {
				<-gate
			}
			off := uint64(p) * seg
			return append(dst, Segment{Dev: e.dev + off, Host: e.host + off, Len: seg}), nil
		},
	}
}

// failingPart is req (lazy) whose Build of part fails with err.
func failingPart(req Request, part int, err error) Request {
	build := req.Build
	req.Build = func(p int, dst []Segment) ([]Segment, error) {
		if p == part {
			return dst, err
		}
		return build(p, dst)
	}
	return req
}

// busyLoad is a lazy load whose part 0 waits for hold, submitted: it keeps
// the submitter busy, and busyLoad returns once the submitter has taken it
// (its Build has started), so that requests submitted after it go into
// another batch whatever the scheduling.
func busyLoad(t *testing.T, e *fakeEnv, n, seg uint64, hold <-chan struct{}) *Op {
	t.Helper()
	started := make(chan struct{})
	req := lazyLoad(e, n, seg, false, 0, hold)
	build := req.Build
	var once sync.Once
	req.Build = func(p int, dst []Segment) ([]Segment, error) {
		once.Do(func() { close(started) })
		return build(p, dst)
	}
	op, err := submitWithin(t, e.s, req, 5*time.Second)
	require.NoError(t, err)
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the submitter did not take the busy load")
	}
	return op
}

func (e *fakeEnv) done(t *testing.T, ev cuda.Event) bool {
	t.Helper()
	ok, err := e.drv.EventQuery(ev)
	require.NoError(t, err)
	return ok
}

// callerWaits makes a new caller stream wait on ev and records a caller
// event after the wait: the caller's view of ev.
func (e *fakeEnv) callerWaits(t *testing.T, ev Event) cuda.Event {
	t.Helper()
	cs, err := e.drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.drv.StreamDestroy(cs) })
	mine, err := e.drv.EventCreate(cuda.EventDisableTiming)
	require.NoError(t, err)
	require.NoError(t, e.drv.StreamWaitEvent(cs, cuda.Event(ev), cuda.EventWaitDefault))
	require.NoError(t, e.drv.EventRecord(mine, cs))
	return mine
}

// callerWaitsLayers checks that op has layers layers and returns the
// caller's view (callerWaits) of each layer's event.
func (e *fakeEnv) callerWaitsLayers(t *testing.T, op *Op, layers int) []cuda.Event {
	t.Helper()
	require.Equal(t, layers, op.Layers())
	mine := make([]cuda.Event, layers)
	for l := range mine {
		ev, err := op.LayerEvent(l)
		require.NoError(t, err)
		mine[l] = e.callerWaits(t, ev)
	}
	return mine
}

func (e *fakeEnv) deviceBytes(t *testing.T, n uint64) []byte {
	t.Helper()
	half := e.size / 2
	require.LessOrEqual(t, n, half)
	require.NoError(t, e.drv.Memcpy(cuda.DevicePtr(e.host+half), cuda.DevicePtr(e.dev), n))
	return append([]byte(nil), e.hostBuf[half:half+n]...)
}

// TestEarlyEventsValidBeforeCopies: Submit of a load with events returns
// while its second part is not even built, and a caller stream waiting on
// the op's event right after Submit passes only once every part's copies
// have completed. It fails if the event were recorded only after the late
// copies (Submit would not return) or at Submit without the wait (the
// caller would pass early, before the bytes arrived).
func TestEarlyEventsValidBeforeCopies(t *testing.T) {
	const seg, n = 4096, 4 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 3})
	require.True(t, e.cu.EarlyEvents(), e.cu.EarlyEventsOff())
	src := randBytes(rand.New(rand.NewSource(4)), n)
	copy(e.hostBuf, src)
	gate := make(chan struct{})
	op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, 2, gate), 5*time.Second)
	require.NoError(t, err)
	ev, err := op.Event()
	require.NoError(t, err)
	mine := e.callerWaits(t, ev)
	time.Sleep(30 * time.Millisecond)
	require.False(t, e.done(t, mine), "the caller passed the op's event before its last parts were built")
	require.False(t, e.done(t, cuda.Event(ev)))
	close(gate)
	require.NoError(t, e.drv.EventSynchronize(mine))
	require.Equal(t, src, e.deviceBytes(t, n), "the caller's stream passed the event before the bytes arrived")
	require.NoError(t, op.Wait())
	require.NoError(t, op.Release())
}

// TestEarlyLayerEvents: a layered load's layer l event completes once
// layer l is copied, while later layers are not built yet.
func TestEarlyLayerEvents(t *testing.T) {
	const seg, n = 4096, 3 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 5})
	src := randBytes(rand.New(rand.NewSource(6)), n)
	copy(e.hostBuf, src)
	gate := make(chan struct{})
	op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, true, 1, gate), 5*time.Second)
	require.NoError(t, err)
	mine := e.callerWaitsLayers(t, op, 3)
	require.NoError(t, e.drv.EventSynchronize(mine[0]))
	require.Equal(t, src[:seg], e.deviceBytes(t, seg))
	time.Sleep(20 * time.Millisecond)
	require.False(t, e.done(t, mine[1]), "layer 1's event completed before layer 1 was built")
	require.False(t, e.done(t, mine[2]))
	close(gate)
	require.NoError(t, e.drv.EventSynchronize(mine[2]))
	require.Equal(t, src, e.deviceBytes(t, n))
	require.NoError(t, op.Wait())
}

// TestEarlyLayerParts: a layered load whose layers are several parts
// (LayerParts 3, 1, 2): layer 0's event covers all three of its parts (it
// does not complete while its last part is not built), and the layers'
// bytes are the parts' in order. Bad LayerParts are refused.
func TestEarlyLayerParts(t *testing.T) {
	const seg, n = 4096, 6 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 15})
	src := randBytes(rand.New(rand.NewSource(16)), n)
	copy(e.hostBuf, src)
	gate := make(chan struct{})
	var opened sync.Once
	release := func() { opened.Do(func() { close(gate) }) }
	t.Cleanup(release) // before the env closes, should the test fail
	req := lazyLoad(e, n, seg, true, 2, gate)
	req.LayerParts = []int{3, 1, 2}
	op, err := submitWithin(t, e.s, req, 5*time.Second)
	require.NoError(t, err)
	mine := e.callerWaitsLayers(t, op, 3)
	time.Sleep(30 * time.Millisecond)
	require.False(t, e.done(t, mine[0]), "layer 0's event completed before its third part was built")
	release()
	require.NoError(t, e.drv.EventSynchronize(mine[0]))
	require.Equal(t, src[:3*seg], e.deviceBytes(t, 3*seg), "layer 0 is parts 0-2")
	require.NoError(t, e.drv.EventSynchronize(mine[2]))
	require.Equal(t, src, e.deviceBytes(t, n))
	require.NoError(t, op.Wait())
	require.NoError(t, op.Release())

	for _, bad := range []struct {
		layered bool
		parts   []int
	}{{false, []int{3, 3}}, {true, []int{3, 0, 3}}, {true, []int{3, 2}}, {true, []int{4, 3}}, {true, make([]int, MaxLayers+1)}} {
		r := lazyLoad(e, n, seg, bad.layered, -1, nil)
		r.LayerParts = bad.parts
		_, err := e.s.Submit(r)
		require.ErrorIs(t, err, ErrInvalidRequest, "%v", bad)
	}
}

// TestEarlyValuesInOrder: two layered ops issued in one batch write their
// counter values op by op, so the first op's later layers never complete
// on the second op's values.
func TestEarlyValuesInOrder(t *testing.T) {
	const seg, n = 4096, 3 * 4096
	e := newFakeEnv(t, 4*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 7})
	hold, gate := make(chan struct{}), make(chan struct{})
	// op0 keeps the submitter busy so that op1 and op2 are taken together.
	op0 := busyLoad(t, e, n, seg, hold)
	op1, err := submitWithin(t, e.s, lazyLoad(e, n, seg, true, 1, gate), 5*time.Second)
	require.NoError(t, err)
	r2 := lazyLoad(e, n, seg, true, -1, nil)
	op2, err := submitWithin(t, e.s, r2, 5*time.Second)
	require.NoError(t, err)
	close(hold)
	ev, err := op1.LayerEvent(0)
	require.NoError(t, err)
	require.NoError(t, e.drv.EventSynchronize(cuda.Event(ev)))
	time.Sleep(20 * time.Millisecond)
	for l := 1; l < 3; l++ {
		ev, err := op1.LayerEvent(l)
		require.NoError(t, err)
		require.False(t, e.done(t, cuda.Event(ev)), "op1's layer %d completed before it was built", l)
	}
	close(gate)
	for _, op := range []*Op{op0, op1, op2} {
		require.NoError(t, op.Wait())
	}
}

// TestEarlyAfterSnapshot: the copies wait on the caller's After event as
// it was recorded at Submit, not on a later record of it. A serving loop
// records After, submits, makes its stream wait on the op's event and
// records After again for its next step; were the copies to wait on that
// later record (as a wait taken when the copies are issued would), they
// would wait on themselves.
func TestEarlyAfterSnapshot(t *testing.T) {
	const seg, n = 4096, 2 * 4096
	e := newFakeEnv(t, 4*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 8})
	word, err := e.drv.MemAlloc(8)
	require.NoError(t, err)
	require.NoError(t, e.drv.MemsetD8(word, 0, 8))
	caller, err := e.drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(t, err)
	after, err := e.drv.EventCreate(cuda.EventDisableTiming)
	require.NoError(t, err)
	// The submitter is kept busy by op0 until hold closes, so op's copies
	// are issued only after the caller's second record of After.
	hold := make(chan struct{})
	op0 := busyLoad(t, e, n, seg, hold)
	// The caller's work before After is held until word becomes 1.
	require.NoError(t, e.drv.StreamWaitValue64(caller, word, 1, cuda.StreamWaitValueGEQ))
	require.NoError(t, e.drv.EventRecord(after, caller))
	req := lazyLoad(e, n, seg, false, -1, nil)
	req.After = Event(after)
	op, err := submitWithin(t, e.s, req, 5*time.Second)
	require.NoError(t, err)
	ev, err := op.Event()
	require.NoError(t, err)
	require.NoError(t, e.drv.StreamWaitEvent(caller, cuda.Event(ev), cuda.EventWaitDefault))
	require.NoError(t, e.drv.EventRecord(after, caller))
	close(hold)
	require.NoError(t, op0.Wait())
	select {
	case <-op.Done():
		t.Fatalf("the op ran before the After record it was submitted behind (err %v)", op.Err())
	case <-time.After(30 * time.Millisecond):
	}
	idle, err := e.drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(t, err)
	require.NoError(t, e.drv.StreamWriteValue64(idle, word, 1, cuda.StreamWriteValueDefault))
	select {
	case <-op.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the op waits on a record of After made after it (a deadlock)")
	}
	require.NoError(t, op.Err())
	require.NoError(t, e.drv.StreamSynchronize(caller))
	for _, s := range []cuda.Stream{caller, idle} {
		require.NoError(t, e.drv.StreamDestroy(s))
	}
	require.NoError(t, e.drv.MemFree(word))
}

// TestEarlyBuildFailure: a part that fails to build fails the op, and its
// promised events still complete, so a caller stream waiting on them is
// never stuck.
func TestEarlyBuildFailure(t *testing.T) {
	const seg, n = 4096, 3 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 9})
	boom := errors.New("boom")
	op, err := submitWithin(t, e.s, failingPart(lazyLoad(e, n, seg, true, -1, nil), 1, boom), 5*time.Second)
	require.NoError(t, err)
	ev, err := op.Event()
	require.NoError(t, err)
	mine := e.callerWaits(t, ev)
	require.ErrorIs(t, op.Wait(), boom)
	require.NoError(t, e.drv.EventSynchronize(mine))
	// The engine goes on: a good op after it.
	op2, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
	require.NoError(t, err)
	require.NoError(t, op2.Wait())
}

// TestLazyBytesChecked: parts that copy other than the declared bytes fail
// the op.
func TestLazyBytesChecked(t *testing.T) {
	const seg, n = 4096, 2 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 10})
	req := lazyLoad(e, n, seg, false, -1, nil)
	req.Bytes = n + seg
	op, err := submitWithin(t, e.s, req, 5*time.Second)
	require.NoError(t, err)
	require.ErrorIs(t, op.Wait(), ErrInvalidRequest)
	_, err = e.s.Submit(Request{Dir: Load, Build: req.Build, Parts: 0, Bytes: n})
	require.ErrorIs(t, err, ErrInvalidRequest)
	_, err = e.s.Submit(Request{Dir: Load, Build: req.Build, Parts: MaxLayers + 1, Layered: true, Bytes: n})
	require.ErrorIs(t, err, ErrInvalidRequest)
}

// TestNoEarlyEventsWaits: without early events (a driver without stream
// memory operations), Submit of an op with events returns only once all
// its parts are built and enqueued.
func TestNoEarlyEventsWaits(t *testing.T) {
	const seg, n = 4096, 2 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 11, NoStreamMemOps: true})
	require.False(t, e.cu.EarlyEvents())
	require.NotEmpty(t, e.cu.EarlyEventsOff())
	src := randBytes(rand.New(rand.NewSource(12)), n)
	copy(e.hostBuf, src)
	gate := make(chan struct{})
	got := make(chan *Op, 1)
	go func() {
		op, err := e.s.Submit(lazyLoad(e, n, seg, false, 1, gate))
		if err != nil {
			panic(err)
		}
		got <- op
	}()
	select {
	case <-got:
		t.Fatal("Submit returned before its parts were built")
	case <-time.After(30 * time.Millisecond):
	}
	close(gate)
	op := <-got
	require.NoError(t, op.Wait())
	require.True(t, bytes.Equal(src, e.deviceBytes(t, n)))
}

func submitWithin(t *testing.T, s *Scheduler, req Request, d time.Duration) (*Op, error) {
	t.Helper()
	type res struct {
		op  *Op
		err error
	}
	ch := make(chan res, 1)
	go func() {
		op, err := s.Submit(req)
		ch <- res{op, err}
	}()
	select {
	case r := <-ch:
		return r.op, r.err
	case <-time.After(d):
		t.Fatalf("Submit did not return within %v", d)
		return nil, nil
	}
}

// TestEarlyFulfilFailure: when the counter cannot be written (the write
// after the copies, and the batch's catch-all after it), the op fails and
// the engine neither waits for its events at completion nor at Close.
func TestEarlyFulfilFailure(t *testing.T) {
	const seg, n = 4096, 2 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 13})
	calls := e.drv.Calls(cuda.OpStreamWriteValue64)
	e.drv.FailAt(cuda.OpStreamWriteValue64, calls+1, cuda.ErrorInvalidValue)
	e.drv.FailAt(cuda.OpStreamWriteValue64, calls+2, cuda.ErrorInvalidValue)
	op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
	require.NoError(t, err)
	select {
	case <-op.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("an op whose counter write failed never completed")
	}
	require.Error(t, op.Err())
	// The engine goes on with the next op.
	op2, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
	require.NoError(t, err)
	require.NoError(t, op2.Wait())
}

// TestEarlySameBatchAfter: two early ops taken into one batch, the second
// submitted After an event the caller recorded behind a wait on the
// first's event. The second's snapshot wait must come after the first's
// copies and counter write, not at the head of the batch (where it would
// wait on itself: found in review, it deadlocked).
func TestEarlySameBatchAfter(t *testing.T) {
	const seg, n = 4096, 2 * 4096
	e := newFakeEnv(t, 8*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 14})
	caller, err := e.drv.StreamCreate(cuda.StreamNonBlocking, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.drv.StreamDestroy(caller) })
	after, err := e.drv.EventCreate(cuda.EventDisableTiming)
	require.NoError(t, err)
	hold := make(chan struct{})
	// op0 keeps the submitter busy, so that op1 and op2 are taken together.
	op0 := busyLoad(t, e, n, seg, hold)
	op1, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
	require.NoError(t, err)
	ev1, err := op1.Event()
	require.NoError(t, err)
	require.NoError(t, e.drv.StreamWaitEvent(caller, cuda.Event(ev1), cuda.EventWaitDefault))
	require.NoError(t, e.drv.EventRecord(after, caller))
	r2 := lazyLoad(e, n, seg, false, -1, nil)
	r2.After = Event(after)
	op2, err := submitWithin(t, e.s, r2, 5*time.Second)
	require.NoError(t, err)
	close(hold)
	require.NoError(t, op0.Wait())
	select {
	case <-op2.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("op2's After snapshot wait came before op1's copies and counter write (a deadlock)")
	}
	require.NoError(t, op2.Err())
	require.NoError(t, op1.Wait())
}

// TestEarlyPartialPromise: a Promise that fails after the op was given its
// counter values (here at its second layer's event record) fails Submit,
// and the values are still written in their turn, so the signal stream is
// not left waiting: Close, whose cuMemFree waits for the device to go idle
// on this fake as on the driver, returns.
func TestEarlyPartialPromise(t *testing.T) {
	const seg, n = 4096, 3 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 15, SyncingFree: true})
	calls := e.drv.Calls(cuda.OpEventRecord)
	e.drv.FailAt(cuda.OpEventRecord, calls+2, cuda.ErrorInvalidValue)
	_, err := submitWithin(t, e.s, lazyLoad(e, n, seg, true, -1, nil), 5*time.Second)
	require.Error(t, err)
	// No later op writes a greater value: the failed op's own placeholder
	// must, or the device never idles and the counters' cuMemFree hangs.
	closed := make(chan error, 1)
	go func() {
		// The device's context current on this goroutine's thread, as on
		// the test's (the fake checks it).
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		ctx, err := e.drv.PrimaryCtxRetain(0)
		if err == nil {
			err = e.drv.CtxSetCurrent(ctx)
		}
		if err != nil {
			closed <- err
			return
		}
		closed <- errors.Join(e.s.Close(), e.cu.Close(), e.drv.PrimaryCtxRelease(0))
	}()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close hung: a failed promise's counter values were never written")
	}
}

// TestQuiesceFreeWhileBuilding: on a driver whose cuMemFree waits for the
// device to go idle and holds every other driver call meanwhile (as the
// H200 machine's did), a free run through Quiesce while an early op is
// half built waits until the op's counter writes are enqueued, then
// completes, and the op's bytes all arrive. A free run as it is would
// deadlock: the promised event's stream waits for a counter write that
// the submitting thread, held by the free, never enqueues (this test then
// times out).
func TestQuiesceFreeWhileBuilding(t *testing.T) {
	const seg, n = 4096, 4 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 9, SyncingFree: true, BlockingFree: true})
	require.True(t, e.cu.EarlyEvents(), e.cu.EarlyEventsOff())
	src := randBytes(rand.New(rand.NewSource(10)), n)
	copy(e.hostBuf, src)
	p, err := e.drv.MemAlloc(1 << 20)
	require.NoError(t, err)
	gate := make(chan struct{})
	op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, 2, gate), 5*time.Second)
	require.NoError(t, err)
	freed := make(chan error, 1)
	go func() {
		freed <- e.s.Quiesce(func() error { return e.cu.OnThread(func() error { return e.drv.MemFree(p) }) })
	}()
	select {
	case err := <-freed:
		t.Fatalf("the free ran while the op's counter write was not enqueued (err %v)", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(gate)
	select {
	case err := <-freed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the quiesced free did not complete after the op was built (a deadlock)")
	}
	require.NoError(t, op.Wait())
	require.Equal(t, src, e.deviceBytes(t, n))
	require.NoError(t, op.Release())
}
