package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
)

// ErrThreadClosed is returned by Thread.Do after Close.
var ErrThreadClosed = errors.New("cuda: thread closed")

// OnThread runs f with the calling goroutine locked to its OS thread, ctx
// current on that thread and the thread's capture mode relaxed (so that f's
// driver calls never invalidate a graph capture another thread is making in
// global mode). The calling thread may be an application's (through the C
// ABI, the Python thread that called the engine), whose current context is
// also its CUDA runtime's current device: OnThread saves the thread's
// current context (cuCtxGetCurrent) and capture mode, and restores both
// afterwards, also when f fails or panics; a failed restore is joined into
// the error returned. When ctx is already current it is not set again. f
// must not start goroutines that call the driver: they would run on other
// threads.
func OnThread(drv Driver, ctx Context, f func() error) (err error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	saved, err := drv.CtxGetCurrent()
	if err != nil {
		return fmt.Errorf("cuda: read the thread's current context: %w", err)
	}
	if saved != ctx {
		if err := drv.CtxSetCurrent(ctx); err != nil {
			return fmt.Errorf("cuda: make context current: %w", err)
		}
		defer func() {
			if rerr := drv.CtxSetCurrent(saved); rerr != nil {
				err = errors.Join(err, fmt.Errorf("cuda: restore the thread's context %#x: %w", uintptr(saved), rerr))
			}
		}()
	}
	prev, err := drv.ThreadExchangeStreamCaptureMode(CaptureModeRelaxed)
	if err != nil {
		return fmt.Errorf("cuda: relax capture mode: %w", err)
	}
	defer func() {
		if _, rerr := drv.ThreadExchangeStreamCaptureMode(prev); rerr != nil {
			err = errors.Join(err, fmt.Errorf("cuda: restore capture mode %d: %w", prev, rerr))
		}
	}()
	return f()
}

// Thread is a goroutine locked to its own OS thread, with a context current
// and capture mode relaxed (neither restored: the thread is the engine's
// and exits with the goroutine), that runs the functions given to Do one at a
// time. Engine goroutines that call the driver often (pollers, pinning,
// trimming) use one instead of locking themselves. Do may be called from
// any goroutine; Close stops the thread after the work already submitted.
// The OS thread exits with the goroutine, so its driver state is never
// handed to other goroutines.
type Thread struct {
	mu     sync.RWMutex
	closed bool
	work   chan job
	done   chan struct{}
}

type job struct {
	f   func() error
	res chan result
}

type result struct {
	err   error
	panic any
}

// NewThread starts a Thread with ctx current. It fails if ctx cannot be made
// current or the capture mode cannot be set.
func NewThread(drv Driver, ctx Context) (*Thread, error) {
	t := &Thread{work: make(chan job), done: make(chan struct{})}
	ready := make(chan error)
	go t.loop(drv, ctx, ready)
	if err := <-ready; err != nil {
		<-t.done
		return nil, err
	}
	return t, nil
}

func (t *Thread) loop(drv Driver, ctx Context, ready chan<- error) {
	defer close(t.done)
	// Never unlocked: the thread exits with this goroutine.
	runtime.LockOSThread()
	if err := drv.CtxSetCurrent(ctx); err != nil {
		ready <- fmt.Errorf("cuda: thread: make context current: %w", err)
		return
	}
	if _, err := drv.ThreadExchangeStreamCaptureMode(CaptureModeRelaxed); err != nil {
		ready <- fmt.Errorf("cuda: thread: relax capture mode: %w", err)
		return
	}
	close(ready)
	for j := range t.work {
		j.res <- run(j.f)
	}
}

func run(f func() error) (r result) {
	defer func() {
		if p := recover(); p != nil {
			r.panic = p
		}
	}()
	return result{err: f()}
}

// Do runs f on the thread and returns its error; a panic in f is re-raised
// in the caller. After Close it returns ErrThreadClosed without running f.
func (t *Thread) Do(f func() error) error {
	t.mu.RLock()
	if t.closed {
		t.mu.RUnlock()
		return ErrThreadClosed
	}
	res := make(chan result, 1)
	t.work <- job{f: f, res: res}
	t.mu.RUnlock()
	r := <-res
	if r.panic != nil {
		panic(r.panic)
	}
	return r.err
}

// Close stops the thread once the work already submitted has run. It is
// safe to call more than once.
func (t *Thread) Close() {
	t.mu.Lock()
	if !t.closed {
		t.closed = true
		close(t.work)
	}
	t.mu.Unlock()
	<-t.done
}
