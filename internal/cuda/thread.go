package cuda

import (
	"errors"
	"fmt"
	"runtime"
)

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
