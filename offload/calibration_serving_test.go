package offload

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// TestCUDAFakeCalibrationWhileServing: the copy methods' calibration at
// the end of growth frees its buffers (calls that may wait for the device
// to go idle and, on the H200 machine's driver, hold other threads'
// driver calls meanwhile) while stores and per-layer loads are being
// built; on a fake driver that does both, the engine serves through it
// without a deadlock and every byte arrives.
func TestCUDAFakeCalibrationWhileServing(t *testing.T) {
	d := fakeDriver(t, cudafake.Options{SyncingFree: true, BlockingFree: true})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	slot := int64(8 << 10)
	e, err := newCUDAEngine(t, d, Config{PoolBytes: 32 * slot, StagingBytes: 64 << 10, Layout: g.layout(LayoutLayerSeparate, 32),
		Policy: PolicyLRU}, engineHooks{calibrate: true, copyOptions: calibrationOptions()})
	require.NoError(t, err)
	serveThroughCalibration(t, e, g, 4, 60*time.Second)
	require.NoError(t, e.WaitGrown(context.Background()))
	require.Contains(t, e.Stats().Copies.Calibration, "calibrated in")
	require.NoError(t, e.Close())
}

// serveThroughCalibration stores and loads rounds of n blocks
// (storeOverwriteLoad) until the engine's copy calibration has ended and
// at least five rounds ran, and returns the rounds. The loop runs on the
// test goroutine (its thread has the context current); a deadlock stops
// it, which a watchdog reports by panicking after limit.
func serveThroughCalibration(t *testing.T, e *Engine, g *gpuMem, n int, limit time.Duration) int64 {
	var rounds atomic.Int64
	watchdog := time.AfterFunc(limit, func() {
		panic(fmt.Sprintf("serving stopped during the calibration after %d rounds (a deadlock); calibration %q",
			rounds.Load(), e.Stats().Copies.Calibration))
	})
	defer watchdog.Stop()
	for seed := uint64(100); e.Stats().Copies.Calibration == "" || rounds.Load() < 5; seed++ {
		storeOverwriteLoad(t, e, g, n, seed)
		rounds.Add(1)
	}
	return rounds.Load()
}

// TestGPUCalibrationWhileServing: the calibration-while-serving case on
// the GPU, with the engine's real calibration at the end of growth:
// stores and loads go on through it (on the H200 machine the
// calibration's cuMemFree once deadlocked the demo's first store, with
// the retired early events), then a Trim unregisters a region.
func TestGPUCalibrationWhileServing(t *testing.T) {
	gpu := cudatest.Open(t)
	g := newGPUMem(t, gpu.Drv, 8<<10)
	defer g.close()
	slot := int64(8 << 10)
	e, err := newCUDAEngine(t, gpu.Drv, Config{PoolBytes: 2048 * slot, FirstRegionBytes: 1024 * slot, RegionBytes: 1024 * slot,
		Layout: g.layout(LayoutLayerSeparate, 512), Policy: PolicyLRU}, engineHooks{calibrate: true})
	require.NoError(t, err)
	rounds := serveThroughCalibration(t, e, g, 64, 120*time.Second)
	t.Logf("%d rounds of 64 blocks served while the copy methods were calibrated (%s)", rounds, e.Stats().Copies.Calibration)
	require.NoError(t, e.WaitGrown(context.Background()))
	res, err := e.Trim(context.Background(), 1024*slot)
	require.NoError(t, err)
	require.Equal(t, 1024*slot, res.FreedBytes)
	storeOverwriteLoad(t, e, g, 64, 999)
	require.NoError(t, e.Close())
}
