package cuda_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// TestGPUOnThreadRestoresContext: with the real driver, cuCtxGetCurrent
// reports the thread's context, and OnThread leaves the calling thread with
// the context it had: none, or device 0's primary context.
func TestGPUOnThreadRestoresContext(t *testing.T) {
	g := cudatest.Open(t) // device 0's primary context current, thread locked
	require.Equal(t, g.Ctx, currentCtx(t, g.Drv))
	inside := func() error {
		if c := currentCtx(t, g.Drv); c != g.Ctx {
			return errors.New("the engine's context is not current inside OnThread")
		}
		_, _, err := g.Drv.MemGetInfo()
		return err
	}
	boom := errors.New("boom")
	for _, saved := range []cuda.Context{0, g.Ctx} {
		require.NoError(t, g.Drv.CtxSetCurrent(saved))
		require.Equal(t, saved, currentCtx(t, g.Drv))
		require.NoError(t, cuda.OnThread(g.Drv, g.Ctx, inside))
		require.Equal(t, saved, currentCtx(t, g.Drv), "after OnThread")
		require.ErrorIs(t, cuda.OnThread(g.Drv, g.Ctx, func() error { return errors.Join(inside(), boom) }), boom)
		require.Equal(t, saved, currentCtx(t, g.Drv), "after OnThread's f failed")
	}
}
