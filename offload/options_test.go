package offload

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cudadev"
)

func newSimEngine(t *testing.T, blocks int) (*Engine, *cudadev.Sim) {
	t.Helper()
	sim, err := cudadev.NewSim(cudadev.SimConfig{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sim.Close()) })
	e := newEngineOn(t, Config{PoolBytes: 64 << 10, Layout: simLayout(t, sim, blocks), Policy: PolicyLRU}, sim)
	return e, sim
}

// TestStoreAfterCapturingStream: a Store whose AfterStream is capturing a
// graph is refused with ErrCapturing and changes nothing.
func TestStoreAfterCapturingStream(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t) })
	e, sim := newSimEngine(t, 8)
	defer func() { require.NoError(t, e.Close()) }()
	cs := sim.NewStream()
	ev, err := sim.CreateEvent(false)
	require.NoError(t, err)
	require.NoError(t, sim.SetCapturing(cs, true))
	before := stateOf(e)
	_, err = e.Store(context.Background(), []Key{testKey(1)}, []int{0}, StoreOptions{After: uintptr(ev), AfterStream: uintptr(cs)})
	require.ErrorIs(t, err, ErrCapturing)
	require.ErrorContains(t, err, "capturing")
	require.Equal(t, before, stateOf(e))
	require.Zero(t, e.Stats().Pool.InUseBytes)

	require.NoError(t, sim.SetCapturing(cs, false))
	require.NoError(t, sim.RecordEvent(ev, cs))
	op, err := e.Store(context.Background(), []Key{testKey(1)}, []int{0}, StoreOptions{After: uintptr(ev), AfterStream: uintptr(cs)})
	require.NoError(t, err)
	require.NoError(t, op.Wait(context.Background()))
	require.Equal(t, []Outcome{OutcomeStored}, mustOutcomes(op.Outcomes()))
	require.NoError(t, op.Release())
}

// TestStoreWaitsForAfter: the store's copies read the block only after the
// caller's event, so bytes a "kernel" writes before recording it are the
// ones stored (the store-after-producer hazard).
func TestStoreWaitsForAfter(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t) })
	e, sim := newSimEngine(t, 8)
	defer func() { require.NoError(t, e.Close()) }()
	k := []Key{testKey(9)}
	writeBlock(t, e, 3, make([]byte, e.slot))
	cs := sim.NewStream()
	open, err := sim.Gate(cs)
	require.NoError(t, err)
	require.NoError(t, sim.Launch(cs, func() { writeBlock(t, e, 3, keyContent(k[0], e.slot)) }))
	ev, err := sim.CreateEvent(false)
	require.NoError(t, err)
	require.NoError(t, sim.RecordEvent(ev, cs))
	op, err := e.Store(context.Background(), k, []int{3}, StoreOptions{After: uintptr(ev)})
	require.NoError(t, err)
	open()
	require.NoError(t, op.Wait(context.Background()))
	require.NoError(t, op.Release())

	op, err = e.Load(context.Background(), k, []int{5}, LoadOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(context.Background()))
	require.Equal(t, []Outcome{OutcomeLoaded}, mustOutcomes(op.Outcomes()))
	require.Equal(t, keyContent(k[0], e.slot), blockBytes(e, 5))
	require.NoError(t, op.Release())
}

// TestLoadSignalsCallerEvent: LoadOptions.Signal is recorded after the
// load's copies, so a caller stream waiting on it sees the loaded bytes. A
// Load that copies nothing (every key missing) does not record it.
func TestLoadSignalsCallerEvent(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t) })
	e, sim := newSimEngine(t, 8)
	defer func() { require.NoError(t, e.Close()) }()
	k := []Key{testKey(4)}
	writeBlock(t, e, 1, keyContent(k[0], e.slot))
	op, err := e.Store(context.Background(), k, []int{1}, StoreOptions{})
	require.NoError(t, err)
	require.NoError(t, op.Wait(context.Background()))
	require.NoError(t, op.Release())

	sig, err := sim.CreateEvent(false)
	require.NoError(t, err)
	cs := sim.NewStream()
	for _, keys := range [][]Key{k, {testKey(77)}} {
		writeBlock(t, e, 6, make([]byte, e.slot))
		op, err = e.Load(context.Background(), keys, []int{6}, LoadOptions{Signal: uintptr(sig), PerLayer: true})
		require.NoError(t, err)
		var seen []byte
		require.NoError(t, sim.StreamWaitEvent(cs, sig))
		require.NoError(t, sim.Launch(cs, func() { seen = blockBytes(e, 6) }))
		require.NoError(t, sim.StreamSynchronize(cs))
		require.NoError(t, op.Wait(context.Background()))
		if keys[0] == k[0] {
			require.Equal(t, keyContent(k[0], e.slot), seen)
		} else {
			require.Equal(t, []Outcome{OutcomeMissing}, mustOutcomes(op.Outcomes()))
			require.Equal(t, make([]byte, e.slot), seen)
		}
		require.NoError(t, op.StreamWait(uintptr(cs)))
		require.NoError(t, op.Release())
	}
}

// TestStickyErrorRefusesNewWork: after a sticky device error the failed
// op reports the driver's error, and later calls are refused saying why.
func TestStickyErrorRefusesNewWork(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t) })
	e, sim := newSimEngine(t, 8)
	defer func() { _ = e.Close() }()
	sim.InjectError(cuda.NewError("cuMemcpyAsync", cuda.ErrorIllegalAddress))
	op, err := e.Store(context.Background(), []Key{testKey(1)}, []int{0}, StoreOptions{})
	if err == nil {
		<-op.Done()
		require.Equal(t, []Outcome{OutcomeFailed}, mustOutcomes(op.Outcomes()))
		require.ErrorContains(t, op.Err(), "CUDA_ERROR_ILLEGAL_ADDRESS")
		require.NoError(t, op.Release())
		_, err = e.Store(context.Background(), []Key{testKey(2)}, []int{1}, StoreOptions{})
	}
	require.ErrorIs(t, err, ErrDeviceLost)
	require.ErrorContains(t, err, "CUDA_ERROR_ILLEGAL_ADDRESS")
	_, err = e.Load(context.Background(), []Key{testKey(2)}, []int{1}, LoadOptions{})
	require.ErrorIs(t, err, ErrDeviceLost)
	require.Zero(t, e.Stats().Pool.InUseBytes, "the failed block's slot is free again")
}
