package transfer_test

import (
	"errors"
	"math/rand"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	. "github.com/kvoffload/kvoffload/transfer"
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

func (e *fakeEnv) deviceBytes(t *testing.T, n uint64) []byte {
	t.Helper()
	half := e.size / 2
	require.LessOrEqual(t, n, half)
	require.NoError(t, e.drv.Memcpy(cuda.DevicePtr(e.host+half), cuda.DevicePtr(e.dev), n))
	return append([]byte(nil), e.hostBuf[half:half+n]...)
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

// eventWithin runs get (an Event or LayerEvent) on another goroutine and
// returns what it returned, or blocked: true when it had not returned
// after d (the goroutine goes on; its result is then dropped).
func eventWithin(get func() (Event, error), d time.Duration) (ev Event, err error, blocked bool) {
	type res struct {
		ev  Event
		err error
	}
	ch := make(chan res, 1)
	go func() {
		ev, err := get()
		ch <- res{ev, err}
	}()
	select {
	case r := <-ch:
		return r.ev, r.err, false
	case <-time.After(d):
		return 0, nil, true
	}
}

// TestSubmitReturnsBeforeCopies: Submit of a load with events returns
// while its third part cannot even be built; Event blocks until the
// submitting thread has recorded the event (all parts enqueued), and a
// caller stream waiting on it then passes only once the bytes arrived. It
// fails if Submit waited for the issue, or if Event returned an event not
// yet recorded (the caller's wait would pass at once).
func TestSubmitReturnsBeforeCopies(t *testing.T) {
	const seg, n = 4096, 4 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 3})
	src := randBytes(rand.New(rand.NewSource(4)), n)
	copy(e.hostBuf, src)
	gate := make(chan struct{})
	op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, 2, gate), 5*time.Second)
	require.NoError(t, err)
	_, _, blocked := eventWithin(op.Event, 30*time.Millisecond)
	require.True(t, blocked, "Event returned before the op's last parts were built")
	close(gate)
	ev, err, blocked := eventWithin(op.Event, 5*time.Second)
	require.False(t, blocked, "Event still blocked once every part could be built")
	require.NoError(t, err)
	mine := e.callerWaits(t, ev)
	require.NoError(t, e.drv.EventSynchronize(mine))
	require.Equal(t, src, e.deviceBytes(t, n), "the caller's stream passed the event before the bytes arrived")
	require.NoError(t, op.Wait())
	require.NoError(t, op.Release())
}

// TestLayerEventsInOrder: a layered load's layer 0 event is handed out
// (and completes with layer 0's bytes) while layer 1 cannot be built;
// LayerEvent(1) and Event wait until it is.
func TestLayerEventsInOrder(t *testing.T) {
	const seg, n = 4096, 3 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 5})
	src := randBytes(rand.New(rand.NewSource(6)), n)
	copy(e.hostBuf, src)
	gate := make(chan struct{})
	op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, true, 1, gate), 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, 3, op.Layers())
	ev0, err, blocked := eventWithin(func() (Event, error) { return op.LayerEvent(0) }, 5*time.Second)
	require.False(t, blocked, "layer 0's event waited for layer 1")
	require.NoError(t, err)
	require.NoError(t, e.drv.EventSynchronize(e.callerWaits(t, ev0)))
	require.Equal(t, src[:seg], e.deviceBytes(t, seg))
	_, _, blocked = eventWithin(func() (Event, error) { return op.LayerEvent(1) }, 30*time.Millisecond)
	require.True(t, blocked, "layer 1's event was handed out before layer 1 was built")
	_, _, blocked = eventWithin(op.Event, 10*time.Millisecond)
	require.True(t, blocked, "the op event was handed out before its last layer was built")
	close(gate)
	for l := 1; l < 3; l++ {
		ev, err := op.LayerEvent(l)
		require.NoError(t, err)
		require.NoError(t, e.drv.EventSynchronize(e.callerWaits(t, ev)))
		require.Equal(t, src[:uint64(l+1)*seg], e.deviceBytes(t, uint64(l+1)*seg))
	}
	require.NoError(t, op.Wait())
	_, err = op.LayerEvent(3)
	require.ErrorIs(t, err, ErrInvalidRequest)
	require.NoError(t, op.Release())
	_, err = op.LayerEvent(0)
	require.ErrorIs(t, err, ErrReleased)
}

// TestLayerPartsEvent: a layered load whose layers are several parts
// (LayerParts 3, 1, 2): layer 0's event waits for all three of its parts,
// and the layers' bytes are the parts' in order. Bad LayerParts are
// refused.
func TestLayerPartsEvent(t *testing.T) {
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
	require.Equal(t, 3, op.Layers())
	_, _, blocked := eventWithin(func() (Event, error) { return op.LayerEvent(0) }, 30*time.Millisecond)
	require.True(t, blocked, "layer 0's event was handed out before its third part was built")
	release()
	ev0, err := op.LayerEvent(0)
	require.NoError(t, err)
	require.NoError(t, e.drv.EventSynchronize(e.callerWaits(t, ev0)))
	require.Equal(t, src[:3*seg], e.deviceBytes(t, 3*seg), "layer 0 is parts 0-2")
	ev, err := op.Event()
	require.NoError(t, err)
	require.NoError(t, e.drv.EventSynchronize(e.callerWaits(t, ev)))
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

// TestBuildFailureEvents: a part that fails to build fails the op: the
// layers recorded before it keep their events, the later ones and the op
// event return the failure instead of an event never recorded (a caller
// stream waiting on that would pass at once), and the engine goes on.
func TestBuildFailureEvents(t *testing.T) {
	const seg, n = 4096, 3 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 9})
	boom := errors.New("boom")
	op, err := submitWithin(t, e.s, failingPart(lazyLoad(e, n, seg, true, -1, nil), 1, boom), 5*time.Second)
	require.NoError(t, err)
	ev0, err := op.LayerEvent(0)
	require.NoError(t, err)
	require.NotZero(t, ev0)
	_, err = op.LayerEvent(1)
	require.ErrorIs(t, err, boom)
	_, err = op.Event()
	require.ErrorIs(t, err, boom)
	require.ErrorIs(t, op.Wait(), boom)
	require.NoError(t, op.Release())
	// The engine goes on: a good op after it.
	op2, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, -1, nil), 5*time.Second)
	require.NoError(t, err)
	_, err = op2.Event()
	require.NoError(t, err)
	require.NoError(t, op2.Wait())
	// An op without Events has none to wait for.
	plain := lazyLoad(e, n, seg, false, -1, nil)
	plain.Events = false
	op3, err := submitWithin(t, e.s, plain, 5*time.Second)
	require.NoError(t, err)
	_, err = op3.Event()
	require.ErrorIs(t, err, ErrInvalidRequest)
	require.NoError(t, op3.Wait())
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

// TestReleaseWakesEventWaiter: a goroutine waiting in Event for an op
// that cannot be issued yet returns ErrReleased when the op is released;
// the op still completes once it can.
func TestReleaseWakesEventWaiter(t *testing.T) {
	const seg, n = 4096, 2 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 12})
	gate := make(chan struct{})
	op, err := submitWithin(t, e.s, lazyLoad(e, n, seg, false, 1, gate), 5*time.Second)
	require.NoError(t, err)
	got := make(chan error, 1)
	go func() {
		_, err := op.Event()
		got <- err
	}()
	time.Sleep(10 * time.Millisecond)
	require.NoError(t, op.Release())
	select {
	case err := <-got:
		require.ErrorIs(t, err, ErrReleased)
	case <-time.After(5 * time.Second):
		t.Fatal("Event still waited after Release")
	}
	close(gate)
	select {
	case <-op.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a released op did not complete")
	}
}

// TestFreeWhileIssuing: another thread frees and allocates device memory
// in a loop (as PyTorch's caching allocator does under pressure, or
// torch.cuda.empty_cache) while stores and loads with events go through,
// each waited on the way a serving loop does (freeWhileIssuing). The fake
// driver's free waits for every stream to drain and holds every other
// driver call meanwhile, as the H200 machine's cuMemFree did; nothing the
// engine enqueues waits on work a host thread has yet to enqueue, so the
// loop never hangs. It did hang with the retired early events (a stream
// waiting on a counter that only the held submitting thread would write).
func TestFreeWhileIssuing(t *testing.T) {
	const seg, n = 4096, 4 * 4096
	ops := 10000
	if InvariantsEnabled() || testing.Short() { // -race builds have invariants on
		ops = 2000
	}
	e := newFakeEnv(t, 4*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 21, SyncingFree: true, BlockingFree: true})
	src := randBytes(rand.New(rand.NewSource(22)), n)
	copy(e.hostBuf, src)
	freeWhileIssuing(t, e.drv, e.s, e.dev, e.host, n, seg, ops)
	require.Equal(t, src, e.deviceBytes(t, n))
}

// freeWhileIssuing runs ops stores and loads of the first n bytes of host
// and dev (in parts of seg bytes; every other one layered, a part a
// layer) on s while another thread of drv's device 0 allocates and frees
// device memory in a loop. Each op is waited on as a serving loop does: a
// stream of the caller's waits on its layer 0 event (layered ones), then
// on the op's event, then the op is waited for on the CPU. It fails if
// the ops do not finish within two minutes.
func freeWhileIssuing(t *testing.T, drv cuda.Driver, s *Scheduler, dev, host, n, seg uint64, ops int) {
	t.Helper()
	onThread := func() error {
		runtime.LockOSThread()
		ctx, err := drv.PrimaryCtxRetain(0)
		if err == nil {
			err = drv.CtxSetCurrent(ctx)
		}
		return err
	}
	stop := make(chan struct{})
	var frees atomic.Int64
	freerDone := make(chan error, 1)
	go func() {
		defer runtime.UnlockOSThread()
		err := onThread()
		for err == nil {
			select {
			case <-stop:
				freerDone <- nil
				return
			default:
			}
			var p cuda.DevicePtr
			if p, err = drv.MemAlloc(1 << 20); err == nil {
				err = drv.MemFree(p)
				frees.Add(1)
			}
		}
		freerDone <- err
	}()
	finished := make(chan error, 1)
	go func() {
		defer runtime.UnlockOSThread()
		finished <- func() error {
			if err := onThread(); err != nil {
				return err
			}
			cs, err := drv.StreamCreate(cuda.StreamNonBlocking, 0)
			if err != nil {
				return err
			}
			defer func() { _ = drv.StreamDestroy(cs) }()
			for i := range ops {
				req := Request{
					Dir: Load, Events: true, Parts: int(n / seg), Layered: i%2 == 0, Bytes: n,
					Build: func(p int, dst []Segment) ([]Segment, error) {
						off := uint64(p) * seg
						return append(dst, Segment{Dev: dev + off, Host: host + off, Len: seg}), nil
					},
				}
				if i%3 == 2 {
					req.Dir = Store // the same bytes back to the host
				}
				op, err := s.Submit(req)
				if err != nil {
					return err
				}
				if req.Layered {
					ev, err := op.LayerEvent(0)
					if err != nil {
						return err
					}
					if err := drv.StreamWaitEvent(cs, cuda.Event(ev), cuda.EventWaitDefault); err != nil {
						return err
					}
				}
				ev, err := op.Event()
				if err != nil {
					return err
				}
				if err := drv.StreamWaitEvent(cs, cuda.Event(ev), cuda.EventWaitDefault); err != nil {
					return err
				}
				if err := errors.Join(op.Wait(), op.Release()); err != nil {
					return err
				}
			}
			return drv.StreamSynchronize(cs)
		}()
	}()
	select {
	case err := <-finished:
		require.NoError(t, err)
	case <-time.After(120 * time.Second):
		t.Fatalf("stores and loads hung with a thread freeing device memory (%d frees)", frees.Load())
	}
	close(stop)
	require.NoError(t, <-freerDone)
	require.Positive(t, frees.Load(), "the freeing thread never freed")
	t.Logf("%d ops with %d frees and allocations of 1 MiB on another thread", ops, frees.Load())
}

// TestSignalEvent: an op with a Signal and no Events is issued in its turn
// too; its Event blocks until the Signal is recorded and then returns the
// Signal, so a caller launches work that waits on the Signal only once its
// record is this op's. An op with neither has no Event.
func TestSignalEvent(t *testing.T) {
	const seg, n = 4096, 2 * 4096
	e := newFakeEnv(t, 2*n, cudacopy.MethodMemcpy, cudafake.Options{Seed: 31})
	sig, err := e.drv.EventCreate(cuda.EventDisableTiming)
	require.NoError(t, err)
	defer func() { require.NoError(t, e.drv.EventDestroy(sig)) }()
	gate := make(chan struct{})
	req := lazyLoad(e, n, seg, false, 1, gate)
	req.Events, req.Signal = false, Event(sig)
	op, err := submitWithin(t, e.s, req, 5*time.Second)
	require.NoError(t, err)
	_, _, blocked := eventWithin(op.Event, 30*time.Millisecond)
	require.True(t, blocked, "Event returned before the Signal was recorded")
	close(gate)
	ev, err, blocked := eventWithin(op.Event, 5*time.Second)
	require.False(t, blocked)
	require.NoError(t, err)
	require.Equal(t, Event(sig), ev)
	require.NoError(t, op.Wait())
	_, err = op.LayerEvent(0)
	require.ErrorIs(t, err, ErrInvalidRequest, "a Signal is no layer event")
	require.NoError(t, op.Release())
}
