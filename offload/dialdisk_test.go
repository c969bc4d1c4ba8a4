package offload

import (
	"context"
	"fmt"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/nodepool"
	"github.com/kvoffload/kvoffload/internal/tiered"
)

// diskNodeConfig is a node of 64 slots of 8 KiB (dialConfig's blocks) over
// a write-through disk tier in dir.
func diskNodeConfig(socket, dir string) nodepool.ServerConfig {
	return nodepool.ServerConfig{Socket: socket, PoolBytes: 512 << 10, RegionBytes: 512 << 10, PrefaultThreads: 1,
		Disk: &tiered.DiskConfig{Dirs: []string{dir}, CapacityBytes: 4 << 20, WriteThrough: true}}
}

// fillNodeDisk stores four batches of 32 keys (dialKeys seeds 1 to 4)
// through a dialled engine into s's pool of 64 slots, each written
// through: the first batch is then on the node's disk only, the last in
// its pool. It returns the batches.
func fillNodeDisk(t *testing.T, s *nodepool.Server, socket string) [][]Key {
	t.Helper()
	w, err := Dial(socket, dialConfig())
	require.NoError(t, err)
	defer func() { require.NoError(t, w.Close()) }()
	var batches [][]Key
	total := 0
	for b := range 4 {
		keys := dialKeys(b+1, 32)
		out, err := waitOut(must(storeKeys(w, keys, StoreOptions{})))
		require.NoError(t, err)
		require.Equal(t, 32, countOutcome(out, OutcomeStored), "batch %d", b)
		total += len(keys)
		waitNode(t, s, "write-through", func(st nodepool.Stats) bool { return st.DiskWrites == int64(total) })
		batches = append(batches, keys)
	}
	res, err := w.Lookup(batches[0], LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, [2]int{0, 32}, [2]int{res.Hits, res.DiskHits}, "the first batch is on the node's disk only")
	return batches
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// filledDiskNode starts a node with a disk tier, fills it (fillNodeDisk)
// and returns it, its socket, the keys a Load asks for (nodeLoadKeys) and
// the GPU block ids they go to.
func filledDiskNode(t *testing.T) (*nodepool.Server, string, []Key, []int) {
	socket := filepath.Join(t.TempDir(), "node.sock")
	s := startNodeConfig(t, diskNodeConfig(socket, t.TempDir()))
	keys := nodeLoadKeys(fillNodeDisk(t, s, socket))
	return s, socket, keys, seqIDs(dialBlocks/2, len(keys))
}

// nodeLoadKeys is a Load's keys of the node disk tests: 4 keys of the
// pool, then 20 of the disk (three chunks: 8, 8, 4).
func nodeLoadKeys(batches [][]Key) []Key {
	return append(append([]Key(nil), batches[3][28:]...), batches[0][:20]...)
}

// zeroBlocks zeroes GPU blocks ids.
func zeroBlocks(t *testing.T, e *Engine, ids []int) {
	t.Helper()
	for _, id := range ids {
		require.NoError(t, writeBlockErr(e, id, make([]byte, e.slot)))
	}
}

// TestDialNodeDiskPipelined: a dialled engine's Load of 4 blocks of the
// node's pool and 20 of its disk copies the pool's blocks and the first
// two chunks of promoted blocks to the GPU, byte-exact, before it asks
// the node for the last chunk (a hook holds that request): the node's
// disk reads and the copies are pipelined, chunk by chunk, not every read
// before the first copy. Once the request goes on every block arrives
// byte-exact, the node holds nothing once the op is done, and the
// promoted blocks are in the pool.
func TestDialNodeDiskPipelined(t *testing.T) {
	s, socket, keys, ids := filledDiskNode(t)

	var e *Engine
	var asked atomic.Int32
	inHook := make(chan error, 1)
	gate := make(chan struct{})
	want := int64(4 + 2*diskChunk)
	e, err := dialEngine(socket, dialConfig(), engineHooks{beforeNodePromote: func(i int) {
		asked.Add(1)
		if i != 2 {
			return
		}
		// The last chunk: the copies before it complete first.
		deadline := time.Now().Add(20 * time.Second)
		for e.Stats().Copies.Load.Blocks < want {
			if time.Now().After(deadline) {
				inHook <- fmt.Errorf("%d blocks loaded before the last chunk was asked for, want %d", e.Stats().Copies.Load.Blocks, want)
				<-gate
				return
			}
			time.Sleep(time.Millisecond)
		}
		for j := range want {
			if got := blockBytesErr(e, ids[j]); string(got) != string(keyContent(keys[j], e.slot)) {
				inHook <- fmt.Errorf("block %d not on the GPU before the last chunk was asked for", j)
				<-gate
				return
			}
		}
		inHook <- nil
		<-gate
	}})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	zeroBlocks(t, e, ids)
	res, err := e.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, [2]int{4, 20}, [2]int{res.Hits, res.DiskHits})

	ch := loadInBackground(e, keys, ids)
	select {
	case err := <-inHook:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatalf("the last chunk was never asked for (%d chunks asked): the node promoted every block at once", asked.Load())
	}
	select {
	case <-ch:
		t.Fatal("Load returned before its last chunk")
	default:
	}
	close(gate)
	l := <-ch
	require.NoError(t, l.err)
	out, err := waitOut(l.op)
	require.NoError(t, err)
	for i, oc := range out {
		require.Equal(t, OutcomeLoaded, oc, "block %d", i)
		require.Equal(t, keyContent(keys[i], e.slot), blockBytesErr(e, ids[i]), "block %d byte-exact", i)
	}
	require.NoError(t, l.op.Release())
	require.EqualValues(t, 3, asked.Load(), "three chunks of 8, 8, 4")
	st := e.Stats()
	require.EqualValues(t, 1, st.Copies.Load.Ops, "one Load op over its parts")
	require.EqualValues(t, 24, st.Copies.Load.Blocks)
	ns := s.Stats()
	require.EqualValues(t, 20, ns.DiskHits)
	require.Zero(t, ns.DiskMisses)
	require.Zero(t, ns.Cache.Leased, "every load ended")
	require.Zero(t, ns.Cache.StoresInFlight, "no promotion left reserved")
	res, err = e.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 24, res.Hits, "the promoted blocks are in the node's pool")
}

// TestDialNodeDiskCorruptMiddle: through a node restarted on its disk,
// a Load of pool blocks, disk blocks (one record damaged, in the second
// chunk) and a key stored nowhere loads every block byte-exact but the
// damaged one and the unknown one, which are missing; the node counts the
// damaged record and holds nothing after.
func TestDialNodeDiskCorruptMiddle(t *testing.T) {
	dir := t.TempDir()
	socket := filepath.Join(t.TempDir(), "node.sock")
	s := startNodeConfig(t, diskNodeConfig(socket, dir))
	batches := fillNodeDisk(t, s, socket)
	require.NoError(t, s.Close())
	keys := nodeLoadKeys(batches)
	damaged := 4 + diskChunk + 3
	flipRecordByte(t, dir, keys[damaged], 8<<10)
	keys = append(keys, testKey(1<<20)) // stored nowhere

	socket2 := filepath.Join(t.TempDir(), "node.sock")
	s2 := startNodeConfig(t, diskNodeConfig(socket2, dir))
	e, err := Dial(socket2, dialConfig())
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	// The restarted node's pool is empty: store the first 4 again.
	out, err := waitOut(must(storeKeys(e, keys[:4], StoreOptions{})))
	require.NoError(t, err)
	require.Equal(t, 4, countOutcome(out, OutcomeStored))
	ids := seqIDs(dialBlocks/2, len(keys))
	zeroBlocks(t, e, ids)
	out, err = waitOut(must(e.Load(context.Background(), keys, ids, LoadOptions{})))
	require.NoError(t, err)
	for i, oc := range out {
		if i == damaged || i == len(keys)-1 {
			require.Equal(t, OutcomeMissing, oc, "block %d", i)
			continue
		}
		require.Equal(t, OutcomeLoaded, oc, "block %d", i)
		require.Equal(t, keyContent(keys[i], e.slot), blockBytesErr(e, ids[i]), "block %d byte-exact", i)
	}
	est := e.Stats()
	require.EqualValues(t, [2]int64{19, 1}, [2]int64{est.Disk.Hits, est.Disk.Misses}, "the engine counts the node's promotions")
	st := s2.Stats()
	require.EqualValues(t, 19, st.DiskHits)
	require.EqualValues(t, 1, st.DiskMisses)
	require.EqualValues(t, 1, st.DiskCorrupt)
	require.Zero(t, st.Cache.Leased)
	require.Zero(t, st.Cache.StoresInFlight)
}

// TestDialNodeDiskCancel: a Load whose ctx ends while it asks the node
// for its second chunk reports the pool's blocks loaded, the chunks from
// the second on cancelled (the second's promoted blocks are not copied,
// the third is never asked for), and leaves nothing held on the node.
func TestDialNodeDiskCancel(t *testing.T) {
	s, socket, keys, ids := filledDiskNode(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var asked atomic.Int32
	e, err := dialEngine(socket, dialConfig(), engineHooks{beforeNodePromote: func(i int) {
		asked.Add(1)
		if i == 1 {
			cancel()
		}
	}})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	zeroBlocks(t, e, ids)
	out, err := waitOut(must(e.Load(ctx, keys, ids, LoadOptions{})))
	require.NoError(t, err)
	require.EqualValues(t, 2, asked.Load(), "no chunk asked for once ctx ended")
	for i, oc := range out {
		switch {
		case i < 4:
			require.Equal(t, OutcomeLoaded, oc, "pool block %d", i)
		case i < 4+diskChunk:
			// The first chunk's reply came before the cancel, its
			// copies submitted after or before it.
			require.Contains(t, []Outcome{OutcomeLoaded, OutcomeCancelled}, oc, "block %d", i)
		default:
			require.Equal(t, OutcomeCancelled, oc, "block %d", i)
		}
		if oc == OutcomeLoaded {
			require.Equal(t, keyContent(keys[i], e.slot), blockBytesErr(e, ids[i]), "block %d byte-exact", i)
		}
	}
	st := waitNode(t, s, "loads ended", func(st nodepool.Stats) bool { return st.Cache.Leased == 0 })
	require.Zero(t, st.Cache.StoresInFlight)
	require.EqualValues(t, 2*diskChunk, st.DiskHits, "two chunks promoted")
}

// TestDialNodeDiskKillLoading: a process SIGKILLed in the middle of a
// Load of disk blocks through the node (its copies never complete; the
// first two chunks promoted and held, the last not asked for) leaves
// nothing held on the node once it has exited; another process then
// loads every block byte-exact.
func TestDialNodeDiskKillLoading(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "node.sock")
	s := startNodeConfig(t, diskNodeConfig(socket, t.TempDir()))
	fillNodeDisk(t, s, socket)
	waitNode(t, s, "the writer gone", func(st nodepool.Stats) bool { return st.Clients == 0 })
	h := startDialChild(t, "loadhang", s.Addr(), 1, 24)
	h.expect(t, "promoting 2")
	st := s.Stats()
	require.Equal(t, 2*diskChunk, st.Cache.Leased, "the first two chunks' loads held by the loading process")
	require.NoError(t, h.cmd.Process.Signal(syscall.SIGKILL))
	st = waitNode(t, s, "release on exit", func(st nodepool.Stats) bool { return st.Clients == 0 && st.Cache.Leased == 0 })
	require.Zero(t, st.Cache.StoresInFlight)
	require.Zero(t, st.Cache.Writing)
	r := startDialChild(t, "load", s.Addr(), 1, 24)
	r.expect(t, "verified 24 missing 0")
	r.wait(t)
}
