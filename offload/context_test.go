package offload

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
)

// keepsContext runs New, WaitGrown, Store, Load, Staging, Trim and Close on
// the calling goroutine's OS thread (locked by newGPUMem: through the C ABI
// it is the application's thread) with app current, and requires app
// current again after each: the engine's driver calls on a caller's thread
// must not switch its context, and with it the CUDA runtime's current
// device. app is another device's context, or 0 (none). The layout is
// allocated with g's context (device 0's, the engine's) current; the caller
// makes it current again before g.close.
func keepsContext(t *testing.T, drv cuda.Driver, g *gpuMem, app cuda.Context) {
	t.Helper()
	slot := int64(8 << 10)
	layout := g.layout(LayoutLayerSeparate, 16)
	require.NoError(t, drv.CtxSetCurrent(app))
	after := func(step string) {
		t.Helper()
		cur, err := drv.CtxGetCurrent()
		require.NoError(t, err, step)
		require.Equal(t, app, cur, "the caller thread's current context after %s", step)
	}

	e, err := newCUDAEngine(t, drv, Config{PoolBytes: 32 * slot, FirstRegionBytes: 8 * slot, RegionBytes: 8 * slot,
		StagingBytes: 64 << 10, Layout: layout, Policy: PolicyLRU}, engineHooks{})
	require.NoError(t, err)
	after("New")
	require.NoError(t, e.WaitGrown(context.Background()))
	after("WaitGrown")

	const n = 4
	keys, src, dst := make([]Key, n), make([]int, n), make([]int, n)
	for i := range n {
		keys[i] = testKey(7000 + i)
		src[i], dst[i] = i, n+i
	}
	storeAll(t, e, keys, src, StoreOptions{})
	after("Store")

	op, err := e.Load(context.Background(), keys, dst, LoadOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(context.Background()))
	require.Equal(t, n, op.count(OutcomeLoaded), "outcomes %v", mustOutcomes(op.Outcomes()))
	require.NoError(t, op.Release())
	after("Load")

	_, err = e.Staging("logits", 4096)
	require.NoError(t, err)
	after("Staging")

	res, err := e.Trim(context.Background(), 8*slot)
	require.NoError(t, err)
	require.Equal(t, 8*slot, res.FreedBytes)
	after("Trim")

	require.NoError(t, e.Close())
	after("Close")
}

// TestCUDAFakeKeepsCallersContext: on the fake driver with two devices, an
// engine on device 0 called from a thread with device 1's primary context
// current, or with no context current, leaves that thread's context as it
// was (issue 18 item 5).
func TestCUDAFakeKeepsCallersContext(t *testing.T) {
	for _, current := range []string{"other device", "none"} {
		t.Run(current, func(t *testing.T) {
			d := fakeDriver(t, cudafake.Options{Devices: 2})
			g := newGPUMem(t, d, 8<<10)
			defer g.close()
			defer func() { require.NoError(t, d.CtxSetCurrent(g.ctx)) }() // for g.close's frees
			var app cuda.Context
			if current == "other device" {
				var err error
				app, err = d.PrimaryCtxRetain(1)
				require.NoError(t, err)
				defer func() { require.NoError(t, d.PrimaryCtxRelease(1)) }()
				require.NotEqual(t, g.ctx, app)
			}
			keepsContext(t, d, g, app)
		})
	}
}
