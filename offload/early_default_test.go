package offload

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
)

// TestEarlyEventsDefault: early events are on by default on a CUDA driver
// with stream memory operations, and Stats says so; Config.LateEvents, a
// driver without them and the host backend each turn them off, with the
// reason in Stats. In every case a store and a per-layer load move every
// byte.
func TestEarlyEventsDefault(t *testing.T) {
	for _, tc := range []struct {
		name  string
		late  bool
		noOps bool
		host  bool
		early bool
		why   string
	}{
		{name: "default", early: true},
		{name: "late", late: true, why: "Config.LateEvents is set"},
		{name: "no stream memory ops", noOps: true, why: "cuStreamWaitValue64_v2"},
		{name: "host backend", host: true, why: "host backend"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			const blocks = 16
			cfg := Config{PoolBytes: 64 * 8192, Layout: smallLayout(4 * blocks), Policy: PolicyLRU, LateEvents: tc.late}
			var e *Engine
			var g *gpuMem
			var err error
			if tc.host {
				cfg.Backend, cfg.SkipMemoryCheck = BackendHost, true
				e, err = New(cfg)
				require.NoError(t, err)
			} else {
				drv := fakeDriver(t, cudafake.Options{DeviceMemory: 64 << 20, NoStreamMemOps: tc.noOps})
				g = newGPUMem(t, drv, 8192)
				defer g.close()
				cfg.Layout = g.layout(LayoutLayerSeparate, 4*blocks)
				e, err = newCUDAEngine(t, drv, cfg, engineHooks{})
				require.NoError(t, err)
			}
			defer func() { require.NoError(t, e.Close()) }()
			st := e.Stats()
			require.Equal(t, tc.early, st.EarlyEvents, "Stats.EarlyEvents (off: %q)", st.EarlyEventsOff)
			if tc.early {
				require.Empty(t, st.EarlyEventsOff)
			} else {
				require.Contains(t, st.EarlyEventsOff, tc.why)
			}
			if g == nil {
				return
			}
			rng := rand.New(rand.NewPCG(7, 8))
			keys := make([]Key, blocks)
			for i := range keys {
				keys[i] = testKey(i)
			}
			ids := rng.Perm(4 * blocks)
			src, dst := ids[:blocks], ids[blocks:2*blocks]
			contents := randomContents(rng, blocks, e.slot)
			for i, id := range src {
				g.write(e, id, contents[i])
			}
			storeAll(t, e, keys, src, StoreOptions{})
			op := loadCheck(t, e, g, keys, dst, contents, LoadOptions{PerLayer: true})
			require.NoError(t, op.Release())
			require.NoError(t, ctx.Err())
		})
	}
}
