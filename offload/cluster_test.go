package offload

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/tier/cluster/clustertest"
)

// clusterEngineConfig is a pool of pool 8 KiB slots over the cluster at
// addrs, in namespace ns.
func clusterEngineConfig(addrs []string, ns string, pool int64) Config {
	return Config{PoolBytes: pool * 8 << 10, Layout: smallLayout(16), Policy: PolicyLRU, Namespace: ns,
		Cluster: &ClusterConfig{Addrs: addrs, Timeout: 2 * time.Second}}
}

// waitClientGone waits, when t ends, for the Redis client's background
// goroutines (topology refreshes, which sleep up to 5s after a node
// failure and outlive Client.Close) to end, so that the package's
// goroutine-leak checks in later tests do not see them.
func waitClientGone(t *testing.T) {
	t.Cleanup(func() {
		buf := make([]byte, 1<<20)
		for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			if !strings.Contains(string(buf[:runtime.Stack(buf, true)]), "github.com/redis/rueidis") {
				return
			}
		}
		t.Log("the Redis client's goroutines outlived the test by 15s")
	})
}

// TestClusterTierTwoEngines: engine A stores blocks, written through to
// the cluster; engine B (same namespace, its own pool) finds none of them
// by Lookup, Prefetches them from the cluster, then Lookup sees them and
// Load copies them byte-exact.
func TestClusterTierTwoEngines(t *testing.T) {
	waitClientGone(t)
	c := clustertest.Start(t, 3)
	ns := fmt.Sprintf("two-engines-%d", time.Now().UnixNano())
	a := newTestEngine(t, clusterEngineConfig(c.Addrs(), ns, 8))
	defer func() { require.NoError(t, a.Close()) }()
	require.Empty(t, a.Stats().ClusterError)
	keys := seqKeys(0, 6)
	contents := make([][]byte, len(keys))
	for i := range keys {
		contents[i] = fillBlock(t, a, i, byte(7+16*i))
		require.Equal(t, OutcomeStored, storeOne(t, a, keys[i], i))
	}
	require.NoError(t, a.FlushCluster())
	st := a.Stats()
	require.Equal(t, int64(len(keys)), st.ClusterWrites)
	require.Zero(t, st.ClusterDropped)

	b := newTestEngine(t, clusterEngineConfig(c.Addrs(), ns, 8))
	defer func() { require.NoError(t, b.Close()) }()
	res, err := b.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Zero(t, res.Hits, "Lookup never asks the cluster")

	// One unknown key after the six: a miss, not an error.
	all := append(append([]Key(nil), keys...), testKey(999))
	pr, err := b.Prefetch(context.Background(), all, PrefetchOptions{Timeout: 2 * time.Second})
	require.NoError(t, err)
	require.Equal(t, PrefetchResult{Promoted: 6, FromCluster: 6}, pr)
	st = b.Stats()
	require.Equal(t, int64(6), st.ClusterHits)
	require.Equal(t, int64(1), st.ClusterMisses)
	require.Zero(t, st.ClusterWrites, "promoted blocks are not written through again")
	res, err = b.Lookup(all, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 6, res.Hits, "the promoted blocks are in B's pool")

	oc := loadAll(t, b, keys, seqIDs(8, 6))
	for i := range keys {
		require.Equal(t, OutcomeLoaded, oc[i])
		require.Equal(t, contents[i], blockBytes(b, 8+i), "block %d byte-exact through the cluster", i)
	}
	// A second Prefetch finds everything in the pool: nothing to do.
	pr, err = b.Prefetch(context.Background(), keys, PrefetchOptions{})
	require.NoError(t, err)
	require.Zero(t, pr.Promoted)

	// Another namespace's engine (another fingerprint, other keys) sees none.
	o := newTestEngine(t, clusterEngineConfig(c.Addrs(), ns+"-other", 8))
	defer func() { require.NoError(t, o.Close()) }()
	pr, err = o.Prefetch(context.Background(), keys, PrefetchOptions{})
	require.NoError(t, err)
	require.Zero(t, pr.Promoted)

	// Clear of the namespace empties it in the cluster for every engine.
	_, err = a.Clear(ns)
	require.NoError(t, err)
	d := newTestEngine(t, clusterEngineConfig(c.Addrs(), ns, 8))
	defer func() { require.NoError(t, d.Close()) }()
	pr, err = d.Prefetch(context.Background(), keys, PrefetchOptions{})
	require.NoError(t, err)
	require.Zero(t, pr.Promoted, "cleared")
}

// TestPrefetchFromDisk: Prefetch promotes disk records into host slots
// (no cluster tier); Lookup then sees them in the pool and Load copies
// them byte-exact.
func TestPrefetchFromDisk(t *testing.T) {
	ctx := context.Background()
	e := newTestEngine(t, diskEngineConfig(t.TempDir()))
	defer func() { _ = e.Close() }() // closed below; a second Close is ErrClosed
	keys := seqKeys(0, 8)
	contents := make([][]byte, 8)
	for i := range 8 {
		contents[i] = fillBlock(t, e, i, byte(5+16*i))
		require.Equal(t, OutcomeStored, storeOne(t, e, keys[i], i))
		require.Equal(t, OutcomeAlreadyPresent, storeOne(t, e, keys[i], i))
	}
	require.NoError(t, e.FlushDisk(ctx))
	res, err := e.Lookup(keys[:4], LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, LookupResult{Hits: 0, DiskHits: 4}, res)
	pr, err := e.Prefetch(ctx, keys[:4], PrefetchOptions{})
	require.NoError(t, err)
	require.Equal(t, PrefetchResult{Promoted: 4, FromDisk: 4}, pr)
	res, err = e.Lookup(keys[:4], LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 4, res.Hits, "the prefetched blocks are in the pool")
	oc := loadAll(t, e, keys[:4], seqIDs(8, 4))
	for i := range 4 {
		require.Equal(t, OutcomeLoaded, oc[i])
		require.Equal(t, contents[i], blockBytes(e, 8+i), "block %d prefetched byte-exact", i)
	}
	require.Equal(t, int64(4), e.Stats().DiskHits)
	_, err = e.Prefetch(ctx, keys, PrefetchOptions{Timeout: -1})
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.NoError(t, e.Close())
	_, err = e.Prefetch(ctx, keys, PrefetchOptions{})
	require.ErrorIs(t, err, ErrClosed)
}

// TestClusterStoppedMidRun: the cluster goes away; Prefetch returns misses
// within its timeout, Store and Load keep working from host memory, and
// write-throughs fail (counted), never as errors.
func TestClusterStoppedMidRun(t *testing.T) {
	waitClientGone(t)
	c := clustertest.Start(t, 3)
	ns := fmt.Sprintf("stopped-%d", time.Now().UnixNano())
	cfg := clusterEngineConfig(c.Addrs(), ns, 8)
	cfg.Cluster.Timeout = 300 * time.Millisecond
	e := newTestEngine(t, cfg)
	defer func() { require.NoError(t, e.Close()) }()
	keys := seqKeys(0, 4)
	for i := range 2 {
		fillBlock(t, e, i, byte(3+i))
		require.Equal(t, OutcomeStored, storeOne(t, e, keys[i], i))
	}
	require.NoError(t, e.FlushCluster())
	c.Stop()

	contents := make([][]byte, 4)
	for i := range 4 {
		contents[i] = fillBlock(t, e, i, byte(40+i))
		want := OutcomeStored
		if i < 2 {
			want = OutcomeAlreadyPresent
			contents[i] = nil
		}
		require.Equal(t, want, storeOne(t, e, keys[i], i))
	}
	start := time.Now()
	pr, err := e.Prefetch(context.Background(), append(keys, testKey(500), testKey(501)), PrefetchOptions{Timeout: 200 * time.Millisecond})
	require.NoError(t, err)
	require.Zero(t, pr.Promoted)
	require.Less(t, time.Since(start), 5*time.Second)
	require.NoError(t, e.FlushCluster())
	st := e.Stats()
	require.Positive(t, st.ClusterMisses)
	require.Positive(t, st.ClusterWriteErrors+st.ClusterDropped, "write-throughs to a stopped cluster fail, counted")

	oc := loadAll(t, e, keys, seqIDs(8, 4))
	for i := range keys {
		require.Equal(t, OutcomeLoaded, oc[i])
		if contents[i] != nil {
			require.Equal(t, contents[i], blockBytes(e, 8+i))
		}
	}
	res, err := e.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 4, res.Hits)
}

// TestClusterUnreachableAtNew: a cluster that does not answer leaves the
// engine without the tier (Stats.ClusterError); a bad cluster config is
// ErrInvalidConfig.
func TestClusterUnreachableAtNew(t *testing.T) {
	waitClientGone(t)
	cfg := clusterEngineConfig([]string{"127.0.0.1:1"}, "unreachable", 4)
	cfg.Cluster.Timeout = 200 * time.Millisecond
	e := newTestEngine(t, cfg)
	defer func() { require.NoError(t, e.Close()) }()
	require.Nil(t, e.cluster)
	require.Contains(t, e.Stats().ClusterError, "127.0.0.1:1")
	fillBlock(t, e, 0, 1)
	require.Equal(t, OutcomeStored, storeOne(t, e, testKey(1), 0))
	pr, err := e.Prefetch(context.Background(), []Key{testKey(2)}, PrefetchOptions{})
	require.NoError(t, err)
	require.Zero(t, pr.Promoted)

	for _, cc := range []ClusterConfig{{}, {Addrs: []string{""}}, {Addrs: []string{"a:1"}, TTL: time.Microsecond},
		{Addrs: []string{"a:1"}, Timeout: -1}, {Addrs: []string{"a:1"}, MaxInFlightBytes: -1}} {
		bad := clusterEngineConfig(nil, "bad", 4)
		bad.Cluster = &cc
		_, err := newEngine(withTestBackend(bad), engineHooks{})
		require.ErrorIs(t, err, ErrInvalidConfig, "%+v", cc)
	}
}
