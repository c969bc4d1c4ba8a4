package offload

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
)

func TestZZTraceFake(t *testing.T) {
	drv := cudafake.New(cudafake.Options{DeviceMemory: 1 << 30})
	defer drv.Close()
	layers, blocks := 32, 128
	seg := uint64(16 * 1 * 4 * 2)
	g := newGPUMem(t, drv, 2*layers*int(seg))
	defer g.close()
	numBlocks := 2 * blocks
	l := LayoutSpec{Kind: LayoutLayerSeparate, Layers: layers, KVHeads: 1, HeadDim: 4, DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: numBlocks}
	for range l.Layers {
		l.LayerTensors = append(l.LayerTensors, LayerTensors{K: g.alloc(seg * uint64(numBlocks)), V: g.alloc(seg * uint64(numBlocks)), Stride: seg})
	}
	slot := int64(seg) * int64(2*layers)
	var mu sync.Mutex
	var t0 time.Time
	var pts []string
	on := false
	h := engineHooks{calibrate: true}
	h.trace = func(p string, part int) {
		mu.Lock()
		defer mu.Unlock()
		if on {
			pts = append(pts, fmt.Sprintf("%s%d %.1f", p, part, float64(time.Since(t0).Nanoseconds())/1e3))
		}
	}
	cfg := Config{PoolBytes: slot * int64(blocks) * 5 / 4, Layout: l, Policy: PolicyLRU}
	e, err := newCUDAEngine(t, drv, cfg, h)
	require.NoError(t, err)
	defer e.Close()
	require.NoError(t, e.WaitGrown(context.Background()))
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))
	keys := make([]Key, blocks)
	for it := range 8 {
		for i := range keys {
			keys[i] = testKey(it*blocks + i)
		}
		ids := rng.Perm(numBlocks)
		op, err := e.Store(ctx, keys, ids[:blocks], StoreOptions{})
		require.NoError(t, err)
		require.NoError(t, op.Wait(ctx))
		op.Release()
		mu.Lock()
		pts, on, t0 = pts[:0], true, time.Now()
		mu.Unlock()
		op, err = e.Load(ctx, keys, ids[blocks:], LoadOptions{})
		c := time.Since(t0)
		require.NoError(t, err)
		require.NoError(t, op.Wait(ctx))
		op.Release()
		mu.Lock()
		on = false
		t.Logf("call %v: %s", c, strings.Join(pts, "; "))
		mu.Unlock()
		e.Delete(keys)
	}
}
