package offload

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudadev"
)

// Op.Release returns at once, also while the op's copies are still in
// flight: the op's events go back to the pool when they retire, recycled
// by the engine's completion thread. It never waits for the GPU.
func TestReleaseDoesNotWait(t *testing.T) {
	sim, err := cudadev.NewSim(cudadev.SimConfig{})
	require.NoError(t, err)
	defer sim.Close()
	e := newEngineOn(t, Config{PoolBytes: 64 << 10, Layout: simLayout(t, sim, 8)}, sim)
	ev, _, open := gatedEvent(t, sim)
	defer open()
	ctx := context.Background()
	op, err := e.Store(ctx, []Key{testKey(1), testKey(2)}, []int{0, 1}, StoreOptions{After: uintptr(ev)})
	require.NoError(t, err)
	released := make(chan error, 1)
	go func() { released <- op.Release() }()
	select {
	case err := <-released:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		open()
		t.Fatal("Release waited for the op's copies")
	}
	require.Zero(t, e.Stats().Copies.Store.Ops, "the copies are still held by the gate")
	open()
	require.Eventually(t, func() bool { return e.Stats().Copies.Store.Ops == 1 }, 10*time.Second, time.Millisecond)
	require.ErrorIs(t, op.Release(), ErrReleased)
	require.NoError(t, e.Close())
	require.Equal(t, int64(2), e.Stats().Outcomes[OutcomeStored], "the released op's blocks were still stored")
}

// Events of ops never released are destroyed at Close (the fake driver's
// leak check fails otherwise), and an op released after Close does not
// recycle its events into the closed engine's pool.
func TestCloseDestroysUnreleasedOpEvents(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 64 << 10, StagingBytes: -1, Layout: g.layout(LayoutLayerSeparate, 8)}, engineHooks{})
	require.NoError(t, err)
	ctx := context.Background()
	st, err := e.Store(ctx, []Key{testKey(1), testKey(2)}, []int{0, 1}, StoreOptions{})
	require.NoError(t, err)
	require.NoError(t, st.Wait(ctx))
	ld, err := e.Load(ctx, []Key{testKey(1), testKey(2)}, []int{2, 3}, LoadOptions{PerLayer: true})
	require.NoError(t, err)
	require.NoError(t, ld.Wait(ctx))
	require.NoError(t, e.Close())
	require.Zero(t, d.Live().Events, "no event left after Close: %+v", d.Live())
	require.NoError(t, st.Release())
	require.NoError(t, ld.Release())
	require.Zero(t, d.Live().Events)
}

// Teardown errors are returned by Close and counted in Stats, never
// swallowed: a failed unpin is retried once (nothing stays pinned when the
// retry succeeds), and one that fails again is reported.
func TestTeardownErrorsReported(t *testing.T) {
	for _, permanent := range []bool{false, true} {
		t.Run(fmt.Sprint("permanent=", permanent), func(t *testing.T) {
			d := cudafake.New(cudafake.Options{CheckContext: true})
			defer func() { _ = d.Close() }()
			g := newGPUMem(t, d, 8<<10)
			defer g.close()
			e, err := newCUDAEngine(t, d, Config{PoolBytes: 64 << 10, StagingBytes: -1, Layout: g.layout(LayoutLayerSeparate, 8)}, engineHooks{})
			require.NoError(t, err)
			require.NoError(t, e.WaitGrown(context.Background()))
			failed := 0
			d.SetHook(func(op string, _ int) cuda.Result {
				if op == cuda.OpMemHostUnregister && (permanent || failed == 0) {
					failed++
					return cuda.ErrorInvalidValue
				}
				return 0
			})
			err = e.Close()
			d.SetHook(nil)
			st := e.Stats()
			if !permanent {
				require.NoError(t, err, "the retry unpinned the region")
				require.Zero(t, d.Live().Registrations, "nothing stays pinned")
				require.Zero(t, st.Pool.TeardownErrors)
				return
			}
			require.ErrorContains(t, err, "unpinning a region of 65536 bytes")
			require.ErrorContains(t, err, "CUDA_ERROR_INVALID_VALUE")
			require.Equal(t, int64(1), st.Pool.TeardownErrors)
			require.Contains(t, st.Pool.TeardownError, "unpinning")
		})
	}
}
