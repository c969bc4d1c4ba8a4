package offload

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
)

// TestGPUKeepsCallersContext: on the H200, an engine on device 0 leaves the
// calling thread's current context as it was through New, Store, Load,
// Staging, Trim and Close: with no context current, with device 0's
// primary context (the engine's own) current, and, on a machine with a
// second GPU, with device 1's primary context current (issue 18 item 5).
func TestGPUKeepsCallersContext(t *testing.T) {
	gpu := cudatest.Open(t)
	devices, err := gpu.Drv.DeviceCount()
	require.NoError(t, err)
	for _, current := range []string{"none", "device 0", "device 1"} {
		t.Run(current, func(t *testing.T) {
			if current == "device 1" && devices < 2 {
				t.Skipf("one CUDA device (%d): no other device's context to keep", devices)
			}
			g := newGPUMem(t, gpu.Drv, 8<<10) // this subtest's thread, locked
			defer g.close()
			defer func() { require.NoError(t, gpu.Drv.CtxSetCurrent(g.ctx)) }() // for g.close's frees
			var app cuda.Context
			switch current {
			case "device 0":
				app = g.ctx
			case "device 1":
				dev, err := gpu.Drv.DeviceGet(1)
				require.NoError(t, err)
				app, err = gpu.Drv.PrimaryCtxRetain(dev)
				require.NoError(t, err)
				defer func() { require.NoError(t, gpu.Drv.PrimaryCtxRelease(dev)) }()
				require.NotEqual(t, g.ctx, app)
			}
			keepsContext(t, gpu.Drv, g, app)
		})
	}
}
