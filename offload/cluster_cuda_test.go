package offload

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/tier/cluster/clustertest"
)

// TestCUDAFakeClusterTwoEngines is the real-model benchmark's cluster
// flow on the CUDA backend (fake driver, copies delayed at random): engine
// A stores GPU blocks, written through to the cluster once their copies
// completed; A closes; engine B over the same GPU tensors Prefetches them
// and Loads them into other, poisoned, block ids, byte-exact; then again
// from B's pool.
func TestCUDAFakeClusterTwoEngines(t *testing.T) {
	waitClientGone(t)
	c := clustertest.Start(t, 3)
	d := fakeDriver(t, cudafake.Options{Seed: 7, MaxDelay: 200 * time.Microsecond})
	g := newGPUMem(t, d, 8<<10)
	defer g.close()
	ns := fmt.Sprintf("cuda-two-engines-%d", time.Now().UnixNano())
	slot := int64(8 << 10)
	cfg := func() Config {
		return Config{PoolBytes: 16 * slot, Layout: g.layout(LayoutLayerSeparate, 16), Policy: PolicyLRU, Namespace: ns,
			Cluster: &ClusterConfig{Addrs: c.Addrs(), Timeout: 2 * time.Second}}
	}
	a, err := newCUDAEngine(t, d, cfg(), engineHooks{})
	require.NoError(t, err)
	const n = 6
	rng := rand.New(rand.NewPCG(3, 4))
	contents := randomContents(rng, n, a.slot)
	keys := make([]Key, n)
	src, dst := make([]int, n), make([]int, n)
	for i := range n {
		keys[i] = testKey(7000 + i)
		src[i], dst[i] = i, n+i
		g.write(a, i, contents[i])
	}
	storeAll(t, a, keys, src, StoreOptions{})
	require.NoError(t, a.FlushCluster())
	require.Equal(t, int64(n), a.Stats().Cluster.Writes)
	require.NoError(t, a.Close())

	b, err := newCUDAEngine(t, d, cfg(), engineHooks{})
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	for i := range n {
		g.write(b, n+i, make([]byte, b.slot))
	}
	pr, err := b.Prefetch(context.Background(), keys, PrefetchOptions{Timeout: 2 * time.Second})
	require.NoError(t, err)
	require.Equal(t, PrefetchResult{Promoted: n, FromCluster: n}, pr)
	require.NoError(t, loadCheck(t, b, g, keys, dst, contents, LoadOptions{}).Release())
	for i := range n {
		g.write(b, n+i, make([]byte, b.slot))
	}
	require.NoError(t, loadCheck(t, b, g, keys, dst, contents, LoadOptions{}).Release())
}
