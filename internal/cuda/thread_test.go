package cuda_test

import (
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

func TestThread(t *testing.T) {
	d, ctx, s, e := capturing(t)
	th, err := cuda.NewThread(d, ctx)
	require.NoError(t, err)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 10 {
				require.NoError(t, th.Do(func() error {
					_, err := d.EventQuery(e)
					return err
				}))
			}
		})
	}
	wg.Wait()
	require.PanicsWithValue(t, "boom", func() { _ = th.Do(func() error { panic("boom") }) })
	th.Close()
	th.Close()
	require.ErrorIs(t, th.Do(func() error { return nil }), cuda.ErrThreadClosed)
	g, err := d.StreamEndCapture(s)
	require.NoError(t, err, "queries from a Thread must not invalidate a global capture")
	require.NoError(t, d.GraphDestroy(g))

	_, err = cuda.NewThread(d, 0x999)
	require.True(t, cuda.IsCode(err, cuda.ErrorInvalidContext), "%v", err)
}
