package cudadev

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
)

// Warm start: once the calibration has run (at NewCUDA, or at Calibrate
// with CalibrateLater), the copier holds its staging share of
// MaxDeviceBytes in idle chunks, so that the first stores' rings need no
// allocation on the submitting thread; before a later calibration only the
// two prewarmed rings are there (the calibration's buffer must fit).
func TestWarmStaging(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const max = 256 << 20
	chunk := int64(cudacopy.DefaultGatherChunk)
	// The tables' bytes (New's and Prewarm's), learnt from the first case:
	// everything but the two rings before a later calibration.
	var tables int64
	for _, later := range []bool{true, false} {
		d := cudafake.New(cudafake.Options{DeviceMemory: 2 << 30})
		c, err := (&Driver{drv: d}).Open(0)
		require.NoError(t, err)
		dev, err := c.NewCUDA(CUDAOptions{CalibrateLater: later, MaxDeviceBytes: max})
		require.NoError(t, err)
		require.True(t, dev.keepIdle)
		cp := dev.Copier()
		staging := func() int64 { return cp.DeviceBytes() - tables }
		if later {
			tables = cp.DeviceBytes() - int64(prewarmRings*cudacopy.DefaultGatherRing)*chunk
			require.GreaterOrEqual(t, tables, int64(prewarmTables)*descCapacity*32, "before the calibration: the tables and two rings")
			require.LessOrEqual(t, tables, int64(max/8), "the tables within their share")
			require.NoError(t, c.Do(func() error { _, err := dev.Calibrate(); return err }))
		}
		// The staging share: the bound less the tables' eighth.
		share := int64(max) - max/8
		require.Equal(t, share/chunk*chunk, staging(), "later %v", later)
		require.LessOrEqual(t, cp.DeviceBytes(), int64(max))
		require.NoError(t, c.Do(dev.Close))
		require.NoError(t, c.Release())
		d.Close()
	}
}
