package offload

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/tier/cluster/clustertest"
	"github.com/kvoffload/kvoffload/internal/tier/record"
)

// clusterEngineConfig is a pool of pool 8 KiB slots over the cluster at
// addrs, in namespace ns.
func clusterEngineConfig(addrs []string, ns string, pool int64) Config {
	return Config{PoolBytes: pool * 8 << 10, Layout: smallLayout(16), Policy: PolicyLRU, Namespace: ns,
		Cluster: &ClusterConfig{Addrs: addrs, Timeout: 2 * time.Second}}
}

// waitClientGone checks, when t ends (after its engines closed), that no
// goroutine of the Redis client is left nor starts later: the cluster
// tier's Close waits for them (the client's topology refreshes sleep up to
// 1s after a node failure and its replaced connections are closed 5s after
// a refresh), so they must be gone within a short grace, and later tests'
// goroutine-leak checks do not see them.
func waitClientGone(t *testing.T) {
	t.Cleanup(func() {
		buf := make([]byte, 1<<20)
		// Gone within 200ms (the last instructions of goroutines Close saw
		// end), and none appears for the next 1.1s (longer than the
		// client's delay before a topology refresh it schedules: one
		// scheduled from a goroutine Close did not wait for would show).
		start := time.Now()
		var left string
		var clean time.Time
		for ; ; time.Sleep(10 * time.Millisecond) {
			left = string(buf[:runtime.Stack(buf, true)])
			busy := strings.Contains(left, "github.com/redis/rueidis")
			switch {
			case busy && (!clean.IsZero() || time.Since(start) > 200*time.Millisecond):
				t.Errorf("a goroutine of the Redis client runs %v after the engines' Close:\n%s", time.Since(start), left)
				return
			case !busy && clean.IsZero():
				clean = time.Now()
			case !busy && time.Since(clean) > 1100*time.Millisecond:
				return
			}
		}
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
	require.Empty(t, a.Stats().Cluster.Error)
	keys := seqKeys(0, 6)
	contents := storeWrittenThrough(t, a, keys, 7)
	require.Zero(t, a.kc.Stats().Leased, "every write-through lease given back once flushed")
	st := a.Stats()
	require.Equal(t, int64(len(keys)), st.Cluster.Writes)
	require.Zero(t, st.Cluster.Dropped)

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
	require.Equal(t, int64(6), st.Cluster.Hits)
	require.Equal(t, int64(1), st.Cluster.Misses)
	require.Zero(t, st.Cluster.Writes, "promoted blocks are not written through again")
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

// TestClusterWriteThroughSlotReuse: the cluster tier copies a written-
// through block on its own goroutine, from the pool slot, here 30 ms
// late (the test hook); stores that follow at once in a pool of 8 slots
// need slots meanwhile. No slot may be reused before its copy: every
// block a second engine promotes from the cluster is the one stored under
// its key, byte-exact (without the write-through's lease the stores reuse
// the slots, and this fails).
func TestClusterWriteThroughSlotReuse(t *testing.T) {
	waitClientGone(t)
	c := clustertest.Start(t, 3)
	ns := fmt.Sprintf("slot-reuse-%d", time.Now().UnixNano())
	cfg := clusterEngineConfig(c.Addrs(), ns, 8)
	cfg.Backend, cfg.SkipMemoryCheck = BackendHost, true
	cfg.Cluster.MaxInFlightBytes = 64 << 20 // no drops
	var copies atomic.Int64
	a, err := newEngine(cfg, engineHooks{beforeClusterCopy: func(Key) {
		copies.Add(1)
		time.Sleep(30 * time.Millisecond)
	}})
	require.NoError(t, err)
	defer func() { require.NoError(t, a.Close()) }()
	const rounds = 6
	keys := seqKeys(0, 8*rounds)
	want := map[Key][]byte{}
	for i, k := range keys {
		b := i % 8
		if b == 0 && (i/8)%2 == 1 {
			// Every other round after the copies of the last have been
			// made; the others at once, while they are pending.
			time.Sleep(60 * time.Millisecond)
		}
		content := fillBlock(t, a, b, byte(3*i+1))
		if storeOne(t, a, k, b) == OutcomeStored {
			want[k] = content
		}
	}
	// A write-through's lease is given back once the tier has accepted the
	// put and copied the slot (the hook's goroutine first): then Flush
	// waits for the cluster's answers.
	require.Eventually(t, func() bool { return a.kc.Stats().Leased == 0 }, 10*time.Second, 5*time.Millisecond,
		"every write-through lease given back")
	require.NoError(t, a.FlushCluster())
	require.Equal(t, copies.Load(), a.Stats().Cluster.Writes, "every put the hook delayed was made")
	require.Greater(t, len(want), 8, "stores went on past the pool's size")
	require.Equal(t, int64(len(want)), a.Stats().Cluster.Writes)

	b := newTestEngine(t, clusterEngineConfig(c.Addrs(), ns, int64(len(keys))))
	defer func() { require.NoError(t, b.Close()) }()
	stored := make([]Key, 0, len(want))
	for _, k := range keys {
		if want[k] != nil {
			stored = append(stored, k)
		}
	}
	pr, err := b.Prefetch(context.Background(), stored, PrefetchOptions{Timeout: 5 * time.Second})
	require.NoError(t, err)
	require.Equal(t, len(stored), pr.FromCluster, "every stored block reached the cluster")
	for i, k := range stored {
		oc := loadAll(t, b, []Key{k}, []int{i % 16})
		require.Equal(t, OutcomeLoaded, oc[0])
		require.True(t, bytes.Equal(want[k], blockBytes(b, i%16)), "key %d: the block stored under it, not a later one", i)
	}
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
	require.Equal(t, int64(4), e.Stats().Disk.Hits)
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
	require.Positive(t, st.Cluster.Misses)
	require.Positive(t, st.Cluster.Timeouts+st.Cluster.Errors, "a stopped cluster's misses are timeouts or errors: %+v", st)
	require.LessOrEqual(t, st.Cluster.Timeouts+st.Cluster.Errors+st.Cluster.Corrupt, st.Cluster.Misses)
	require.True(t, st.Cluster.Available, "connected at New: the client's to reconnect, not unavailable")
	require.Positive(t, st.Cluster.WriteErrors+st.Cluster.Dropped, "write-throughs to a stopped cluster fail, counted")

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

// TestClusterUnreachableAtNew: a cluster that does not answer at New is
// not an error: the engine serves from host memory, the tier is not
// available (Stats.Cluster.Available false, Cluster.Error naming the
// address), write-throughs and Prefetch keys are counted in
// Cluster.Unavailable (no slot reserved for them), and Close stops its
// attempts to connect; a bad cluster config is ErrInvalidConfig.
func TestClusterUnreachableAtNew(t *testing.T) {
	waitClientGone(t)
	cfg := clusterEngineConfig([]string{"127.0.0.1:1"}, "unreachable", 4)
	cfg.Cluster.Timeout = 200 * time.Millisecond
	e := newTestEngine(t, cfg)
	defer func() { require.NoError(t, e.Close()) }()
	st := e.Stats()
	require.False(t, st.Cluster.Available)
	require.Contains(t, st.Cluster.Error, "127.0.0.1:1")
	fillBlock(t, e, 0, 1)
	require.Equal(t, OutcomeStored, storeOne(t, e, testKey(1), 0))
	free := e.Stats().Pool.SlotsFree
	pr, err := e.Prefetch(context.Background(), []Key{testKey(2), testKey(3)}, PrefetchOptions{})
	require.NoError(t, err)
	require.Zero(t, pr.Promoted)
	st = e.Stats()
	require.Equal(t, free, st.Pool.SlotsFree, "no slot reserved for an unavailable tier")
	require.Equal(t, int64(1+2), st.Cluster.Unavailable, "one write-through, two Prefetch keys")
	require.Equal(t, int64(1), st.Cluster.UnavailableWrites)
	require.Zero(t, st.Cluster.Dropped)
	require.Zero(t, st.Cluster.Misses)
	require.False(t, st.Cluster.Available)

	for _, cc := range []ClusterConfig{{}, {Addrs: []string{""}}, {Addrs: []string{"a:1"}, TTL: time.Microsecond},
		{Addrs: []string{"a:1"}, Timeout: -1}, {Addrs: []string{"a:1"}, MaxInFlightBytes: -1}} {
		bad := clusterEngineConfig(nil, "bad", 4)
		bad.Cluster = &cc
		_, err := newEngine(withTestBackend(bad), engineHooks{})
		require.ErrorIs(t, err, ErrInvalidConfig, "%+v", cc)
	}
}

// TestClusterStartsAfterEngine: the engine starts before its cluster (the
// addresses answer nothing), serves from host memory with the tier
// unavailable, and once the cluster is up connects in the background:
// write-through then stores the engine's blocks (each a BlockStored of
// medium SHARED_STORAGE), and a second engine's Prefetch promotes them
// (BlockStored of medium CPU: where the block now is), byte-exact.
func TestClusterStartsAfterEngine(t *testing.T) {
	waitClientGone(t)
	c := clustertest.Reserve(t, 3)
	ns := fmt.Sprintf("late-%d", time.Now().UnixNano())
	cfg := clusterEngineConfig(c.Addrs(), ns, 8)
	cfg.Cluster.Timeout = 300 * time.Millisecond
	a := newTestEngine(t, cfg)
	defer func() { require.NoError(t, a.Close()) }()
	evs := a.Events(0)
	st := a.Stats()
	require.False(t, st.Cluster.Available)
	require.NotEmpty(t, st.Cluster.Error)
	keys := seqKeys(0, 6)
	contents := make([][]byte, len(keys))
	contents[0] = fillBlock(t, a, 0, 11)
	require.Equal(t, OutcomeStored, storeOne(t, a, keys[0], 0), "served from host memory")
	require.Equal(t, int64(1), a.Stats().Cluster.Unavailable)

	require.NoError(t, c.Launch())
	require.Eventually(t, func() bool { return a.Stats().Cluster.Available }, 30*time.Second, 20*time.Millisecond,
		"the tier connects once the cluster is up: %+v", a.Stats())
	require.Empty(t, a.Stats().Cluster.Error)
	for i := 1; i < len(keys); i++ {
		contents[i] = fillBlock(t, a, i, byte(11+16*i))
		require.Equal(t, OutcomeStored, storeOne(t, a, keys[i], i))
	}
	require.NoError(t, a.FlushCluster())
	st = a.Stats()
	require.Equal(t, int64(len(keys)-1), st.Cluster.Writes)
	require.Equal(t, st.Cluster.Writes*a.slot, st.Cluster.WriteBytes)
	var shared []Key
	for done := false; !done; {
		select {
		case ev := <-evs.C:
			if ev.Medium == MediumSharedStorage {
				require.Equal(t, EventStored, ev.Kind)
				shared = append(shared, ev.Key)
			}
		default:
			done = true
		}
	}
	require.ElementsMatch(t, keys[1:], shared, "a BlockStored SHARED_STORAGE per block the cluster stored")

	b := newTestEngine(t, clusterEngineConfig(c.Addrs(), ns, 8))
	defer func() { require.NoError(t, b.Close()) }()
	require.True(t, b.Stats().Cluster.Available)
	bevs := b.Events(0)
	pr, err := b.Prefetch(context.Background(), keys, PrefetchOptions{Timeout: 2 * time.Second})
	require.NoError(t, err)
	require.Equal(t, PrefetchResult{Promoted: 5, FromCluster: 5}, pr, "the first block, stored while the tier was down, is not in the cluster")
	st = b.Stats()
	require.Equal(t, int64(5), st.Cluster.Hits)
	require.Equal(t, int64(1), st.Cluster.Misses)
	require.Equal(t, 5*b.slot, st.Cluster.HitBytes)
	var promoted []Key
	for done := false; !done; {
		select {
		case ev := <-bevs.C:
			require.Equal(t, MediumCPU, ev.Medium, "a promoted block is announced where it is: the host pool")
			if ev.Kind == EventStored {
				promoted = append(promoted, ev.Key)
			}
		default:
			done = true
		}
	}
	require.Equal(t, keys[1:], promoted)
	oc := loadAll(t, b, keys[1:], seqIDs(8, 5))
	for i := range 5 {
		require.Equal(t, OutcomeLoaded, oc[i])
		require.Equal(t, contents[i+1], blockBytes(b, 8+i), "block %d byte-exact through the cluster", i+1)
	}
}

// TestClusterCorruptRecordNeverLoaded: a record damaged in the cluster
// (one payload byte changed by hand) is read straight into its reserved
// slot by Prefetch and fails its checksum there: the slot is released,
// never made ready, so no Lookup or Load sees the key, while the other
// blocks are promoted and load byte-exact.
func TestClusterCorruptRecordNeverLoaded(t *testing.T) {
	waitClientGone(t)
	c := clustertest.Start(t, 3)
	ns := fmt.Sprintf("corrupt-%d", time.Now().UnixNano())
	a := newTestEngine(t, clusterEngineConfig(c.Addrs(), ns, 8))
	defer func() { require.NoError(t, a.Close()) }()
	keys := seqKeys(40, 4)
	contents := storeWrittenThrough(t, a, keys, 3)

	// Change one payload byte of keys[2]'s record where it lives.
	bad := hex.EncodeToString(keys[2][:])
	changed := false
	for _, addr := range c.Addrs() {
		_, port, _ := strings.Cut(addr, ":")
		p, _ := strconv.Atoi(port)
		out, err := clustertest.CLI(p, "", "keys", "*"+bad)
		require.NoError(t, err)
		if k := strings.TrimSpace(out); k != "" {
			_, err = clustertest.CLI(p, "", "setrange", k, strconv.Itoa(record.HeaderSize+100), "X")
			require.NoError(t, err)
			changed = true
		}
	}
	require.True(t, changed, "keys[2]'s record is in the cluster")

	b := newTestEngine(t, clusterEngineConfig(c.Addrs(), ns, 8))
	defer func() { require.NoError(t, b.Close()) }()
	pr, err := b.Prefetch(context.Background(), keys, PrefetchOptions{Timeout: 2 * time.Second})
	require.NoError(t, err)
	require.Equal(t, 3, pr.FromCluster, "every record but the damaged one")
	require.Equal(t, int64(1), b.Stats().Cluster.Corrupt)
	res, err := b.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 2, res.Hits, "the chain stops at the damaged block")
	res, err = b.Lookup(keys[2:3], LookupOptions{})
	require.NoError(t, err)
	require.Zero(t, res.Hits, "the damaged block's slot was never made ready")
	oc := loadAll(t, b, keys, seqIDs(8, 4))
	require.Equal(t, []Outcome{OutcomeLoaded, OutcomeLoaded, OutcomeMissing, OutcomeLoaded}, oc, "Load takes every key the pool holds")
	for _, i := range []int{0, 1, 3} {
		require.Equal(t, contents[i], blockBytes(b, 8+i), "block %d", i)
	}
}

// storeWrittenThrough fills GPU block i of e with byte seed+16i, stores it under
// keys[i], waits until every record is written through to the cluster, and
// returns the blocks' contents.
func storeWrittenThrough(t *testing.T, e *Engine, keys []Key, seed byte) [][]byte {
	t.Helper()
	contents := make([][]byte, len(keys))
	for i := range keys {
		contents[i] = fillBlock(t, e, i, seed+byte(16*i))
		require.Equal(t, OutcomeStored, storeOne(t, e, keys[i], i))
	}
	require.NoError(t, e.FlushCluster())
	return contents
}

// TestPrefetchPolicies: PrefetchWait with ctx done starts no disk read;
// PrefetchBestEffort returns at once and promotes in the background
// (byte-exact); past MaxBackgroundPrefetches running, a best-effort call
// is refused and counted; Close waits for the reads started; a bad policy
// is an error.
func TestPrefetchPolicies(t *testing.T) {
	ctx := context.Background()
	gate := make(chan struct{})
	var gated atomic.Bool
	var reads atomic.Int64
	cfg := diskEngineConfig(t.TempDir())
	cfg.Disk.AdmitAll = true
	e, err := newEngine(withTestBackend(cfg), engineHooks{beforeDiskGet: func(Key) {
		reads.Add(1)
		if gated.Load() {
			<-gate
		}
	}})
	require.NoError(t, err)
	keys := seqKeys(0, 12)
	contents := storeBlocks(t, e, keys, 7, 13)
	require.NoError(t, e.FlushDisk(ctx))
	res, err := e.Lookup(keys[:8], LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, LookupResult{DiskHits: 8}, res, "a pool of 4 blocks: the first 8 went to disk")

	done, cancel := context.WithCancel(ctx)
	cancel()
	pr, err := e.Prefetch(done, keys[:2], PrefetchOptions{})
	require.NoError(t, err)
	require.Zero(t, pr.Promoted)
	require.Zero(t, reads.Load(), "no read starts once ctx is done")

	pr, err = e.Prefetch(ctx, keys[:2], PrefetchOptions{Policy: PrefetchBestEffort})
	require.NoError(t, err)
	require.Equal(t, PrefetchResult{Background: true}, pr)
	require.Eventually(t, func() bool { return e.Stats().PrefetchBackgroundPromoted == 2 }, 10*time.Second, time.Millisecond)
	res, err = e.Lookup(keys[:2], LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 2, res.Hits, "the background promotion's blocks are in the pool")
	requireLoads(t, e, keys[:2], 12, contents, "promoted in the background")
	require.Equal(t, int64(1), e.Stats().PrefetchBackground)

	gated.Store(true)
	before := reads.Load()
	for i := range MaxBackgroundPrefetches {
		pr, err = e.Prefetch(ctx, keys[2+i:3+i], PrefetchOptions{Policy: PrefetchBestEffort})
		require.NoError(t, err)
		require.True(t, pr.Background)
	}
	require.Eventually(t, func() bool { return reads.Load() == before+MaxBackgroundPrefetches }, 10*time.Second, time.Millisecond)
	pr, err = e.Prefetch(ctx, keys[6:7], PrefetchOptions{Policy: PrefetchBestEffort})
	require.NoError(t, err)
	require.Equal(t, PrefetchResult{}, pr, "refused: %d running", MaxBackgroundPrefetches)
	require.Equal(t, int64(1), e.Stats().PrefetchRefused)
	_, err = e.Prefetch(ctx, keys, PrefetchOptions{Policy: PrefetchBestEffort + 1})
	require.ErrorIs(t, err, ErrInvalidArgument)

	closed := make(chan error, 1)
	go func() { closed <- e.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while background reads were held", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(gate)
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return once the reads went on")
	}
	require.Equal(t, int64(1+MaxBackgroundPrefetches), e.Stats().PrefetchBackground)
}

// TestClusterTLS: a cluster serving TLS only, with certificates of a CA of
// its own: an engine given the CA file writes through and another reads
// back byte-exact (TLSServerName checked against the certificate's name
// too); without the CA the nodes' certificates are refused (the tier is
// unavailable, the engine serves); a CA file that cannot be read or holds
// no certificate fails New.
func TestClusterTLS(t *testing.T) {
	waitClientGone(t)
	c, files := clustertest.StartTLS(t, 3)
	ns := fmt.Sprintf("tls-%d", time.Now().UnixNano())
	cfg := clusterEngineConfig(c.Addrs(), ns, 8)
	cfg.Cluster.TLSCAFile = files.CA
	a := newTestEngine(t, cfg)
	defer func() { require.NoError(t, a.Close()) }()
	require.Empty(t, a.Stats().Cluster.Error)
	keys := seqKeys(0, 4)
	contents := storeWrittenThrough(t, a, keys, 7)
	require.Equal(t, int64(len(keys)), a.Stats().Cluster.Writes)

	named := clusterEngineConfig(c.Addrs(), ns, 8)
	named.Cluster.TLSCAFile, named.Cluster.TLSServerName = files.CA, clustertest.ServerName
	b := newTestEngine(t, named)
	defer func() { require.NoError(t, b.Close()) }()
	pr, err := b.Prefetch(context.Background(), keys, PrefetchOptions{Timeout: 2 * time.Second})
	require.NoError(t, err)
	require.Equal(t, PrefetchResult{Promoted: 4, FromCluster: 4}, pr)
	oc := loadAll(t, b, keys, seqIDs(8, 4))
	for i := range keys {
		require.Equal(t, OutcomeLoaded, oc[i])
		require.Equal(t, contents[i], blockBytes(b, 8+i), "block %d byte-exact over TLS", i)
	}

	// The system's roots do not hold the test CA: no connection, and the
	// engine still serves from host memory.
	sys := clusterEngineConfig(c.Addrs(), ns, 8)
	sys.Cluster.TLS, sys.Cluster.Timeout = true, 500*time.Millisecond
	o := newTestEngine(t, sys)
	defer func() { require.NoError(t, o.Close()) }()
	require.Contains(t, o.Stats().Cluster.Error, "certificate")
	pr, err = o.Prefetch(context.Background(), keys, PrefetchOptions{Timeout: time.Second})
	require.NoError(t, err)
	require.Zero(t, pr.Promoted)

	for _, bad := range []string{filepath.Join(t.TempDir(), "missing.pem"), files.Key} {
		cfg := clusterEngineConfig(c.Addrs(), ns, 8)
		cfg.Cluster.TLSCAFile = bad
		_, err := New(cfg)
		require.ErrorIs(t, err, ErrInvalidConfig)
		require.ErrorContains(t, err, "TLSCAFile")
	}
}

// TestClusterFullOOM: a cluster at its maxmemory with noeviction refuses
// the write-throughs: each is a write error and an OOM in Stats, the
// stores themselves succeed and the blocks load from host memory.
func TestClusterFullOOM(t *testing.T) {
	waitClientGone(t)
	c := clustertest.Start(t, 3)
	for _, port := range c.Ports() {
		for _, kv := range [][2]string{{"maxmemory-policy", "noeviction"}, {"maxmemory", "1"}} {
			_, err := clustertest.CLI(port, "", "config", "set", kv[0], kv[1])
			require.NoError(t, err)
		}
	}
	e := newTestEngine(t, clusterEngineConfig(c.Addrs(), fmt.Sprintf("oom-%d", time.Now().UnixNano()), 8))
	defer func() { require.NoError(t, e.Close()) }()
	keys := seqKeys(0, 4)
	contents := storeBlocks(t, e, keys, 9, 17)
	require.NoError(t, e.FlushCluster())
	st := e.Stats()
	require.EqualValues(t, 4, st.Cluster.WriteErrors)
	require.EqualValues(t, 4, st.Cluster.WriteOOM)
	require.Zero(t, st.Cluster.Writes)
	requireLoads(t, e, keys, 8, contents, "from host memory, the cluster full")
}
