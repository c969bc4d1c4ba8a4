package cuda_test

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
)

// capturing returns a fake with a global-mode capture in progress on a
// stream, begun on the locked test thread, and an event to query.
func capturing(t *testing.T) (*cudafake.Driver, cuda.Context, cuda.Stream, cuda.Event) {
	t.Helper()
	d := cudafake.New(cudafake.Options{CheckContext: true})
	t.Cleanup(func() { require.NoError(t, d.Close()) })
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
	ctx, err := d.PrimaryCtxRetain(0)
	require.NoError(t, err)
	require.NoError(t, d.CtxSetCurrent(ctx))
	s, err := d.StreamCreate(0, 0)
	require.NoError(t, err)
	e, err := d.EventCreate(0)
	require.NoError(t, err)
	require.NoError(t, d.StreamBeginCapture(s, cuda.CaptureModeGlobal))
	return d, ctx, s, e
}

func TestOnThreadKeepsCaptureValid(t *testing.T) {
	d, ctx, s, e := capturing(t)
	var wg sync.WaitGroup
	wg.Go(func() {
		err := cuda.OnThread(d, ctx, func() error {
			_, err := d.EventQuery(e)
			return err
		})
		require.NoError(t, err)
	})
	wg.Wait()
	g, err := d.StreamEndCapture(s)
	require.NoError(t, err)
	require.NoError(t, d.GraphDestroy(g))
}

func TestOnThreadRestoresCaptureMode(t *testing.T) {
	d := cudafake.New(cudafake.Options{})
	defer func() { require.NoError(t, d.Close()) }()
	ctx, err := d.PrimaryCtxRetain(0)
	require.NoError(t, err)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	_, err = d.ThreadExchangeStreamCaptureMode(cuda.CaptureModeThreadLocal)
	require.NoError(t, err)
	var inside cuda.CaptureMode
	require.NoError(t, cuda.OnThread(d, ctx, func() error {
		m, err := d.ThreadExchangeStreamCaptureMode(cuda.CaptureModeRelaxed)
		inside = m
		return err
	}))
	require.Equal(t, cuda.CaptureModeRelaxed, inside)
	m, err := d.ThreadExchangeStreamCaptureMode(cuda.CaptureModeGlobal)
	require.NoError(t, err)
	require.Equal(t, cuda.CaptureModeThreadLocal, m)
	require.Error(t, cuda.OnThread(d, 0x999, func() error { return nil }))
}

// lockThread locks the (sub)test's goroutine to its OS thread until t ends:
// the current context is per OS thread.
func lockThread(t *testing.T) {
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
}

// currentCtx is the calling OS thread's current context.
func currentCtx(t *testing.T, d cuda.Driver) cuda.Context {
	t.Helper()
	c, err := d.CtxGetCurrent()
	require.NoError(t, err)
	return c
}

// TestOnThreadRestoresContext: OnThread runs on the caller's thread (the
// application's, through the C ABI), so whatever context that thread had
// current, none included, is current again afterwards, also when f fails
// or panics.
func TestOnThreadRestoresContext(t *testing.T) {
	d := cudafake.New(cudafake.Options{Devices: 2, CheckContext: true})
	defer func() { require.NoError(t, d.Close()) }()
	appCtx, err := d.PrimaryCtxRetain(1) // the application's device
	require.NoError(t, err)
	defer func() { require.NoError(t, d.PrimaryCtxRelease(1)) }()
	engCtx, err := d.PrimaryCtxRetain(0) // the engine's
	require.NoError(t, err)
	defer func() { require.NoError(t, d.PrimaryCtxRelease(0)) }()

	inside := func() error {
		if c := currentCtx(t, d); c != engCtx {
			return fmt.Errorf("context %#x current inside OnThread, want %#x", c, engCtx)
		}
		_, _, err := d.MemGetInfo() // a context-bound call
		return err
	}
	boom := errors.New("boom")
	for _, saved := range []cuda.Context{appCtx, 0} {
		t.Run(fmt.Sprintf("saved=%#x", saved), func(t *testing.T) {
			lockThread(t)
			require.NoError(t, d.CtxSetCurrent(saved))
			require.NoError(t, cuda.OnThread(d, engCtx, inside))
			require.Equal(t, saved, currentCtx(t, d))

			err := cuda.OnThread(d, engCtx, func() error { return errors.Join(inside(), boom) })
			require.ErrorIs(t, err, boom)
			require.Equal(t, saved, currentCtx(t, d), "restored after f's error")

			require.PanicsWithValue(t, "panic in f", func() {
				_ = cuda.OnThread(d, engCtx, func() error { panic("panic in f") })
			})
			require.Equal(t, saved, currentCtx(t, d), "restored after f's panic")

			require.Error(t, cuda.OnThread(d, 0x999, func() error { return errors.New("f must not run") }))
			require.Equal(t, saved, currentCtx(t, d), "unchanged when ctx cannot be made current")
		})
	}

	t.Run("already current", func(t *testing.T) {
		lockThread(t)
		require.NoError(t, d.CtxSetCurrent(engCtx))
		sets := d.Calls(cuda.OpCtxSetCurrent)
		require.NoError(t, cuda.OnThread(d, engCtx, inside))
		require.Equal(t, sets, d.Calls(cuda.OpCtxSetCurrent), "no set when ctx is already current")
		require.Equal(t, engCtx, currentCtx(t, d))
	})

	t.Run("restore fails", func(t *testing.T) {
		lockThread(t)
		require.NoError(t, d.CtxSetCurrent(appCtx))
		d.FailAt(cuda.OpCtxSetCurrent, d.Calls(cuda.OpCtxSetCurrent)+2, cuda.ErrorInvalidValue)
		err := cuda.OnThread(d, engCtx, func() error { return boom })
		require.ErrorIs(t, err, boom, "f's error is kept")
		require.True(t, cuda.IsCode(err, cuda.ErrorInvalidValue), "the restore's failure is joined: %v", err)
		require.ErrorContains(t, err, "restore the thread's context")
	})

	t.Run("current context unreadable", func(t *testing.T) {
		lockThread(t)
		require.NoError(t, d.CtxSetCurrent(appCtx))
		d.FailAt(cuda.OpCtxGetCurrent, d.Calls(cuda.OpCtxGetCurrent)+1, cuda.ErrorInvalidValue)
		ran := false
		err := cuda.OnThread(d, engCtx, func() error { ran = true; return nil })
		require.True(t, cuda.IsCode(err, cuda.ErrorInvalidValue), "%v", err)
		require.False(t, ran, "f does not run when the caller's context could not be saved")
		require.Equal(t, appCtx, currentCtx(t, d))
	})
}
