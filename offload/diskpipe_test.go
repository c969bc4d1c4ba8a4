package offload

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cuda/cudatest"
	"github.com/kvoffload/kvoffload/internal/cudacopy"
	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/internal/tier/disk"
)

// pipeBlocks is the GPU blocks of the disk pipeline tests' layout.
const pipeBlocks = 64

// writeDiskRecords leaves the records of keys (content keyContent) in dir:
// an engine whose pool of four slots evicts them (every eviction written,
// AdmitAll) stores them, then four more, and closes.
func writeDiskRecords(t *testing.T, dir string, keys []Key) {
	t.Helper()
	e := newTestEngine(t, Config{PoolBytes: 4 * 8 << 10, Layout: smallLayout(pipeBlocks), Policy: PolicyLRU,
		Disk: &DiskConfig{Dirs: []string{dir}, CapacityBytes: 4 << 20, AdmitAll: true}})
	fill := append(append([]Key(nil), keys...), seqKeys(1000, 4)...)
	for i, k := range fill {
		writeBlock(t, e, i%pipeBlocks, keyContent(k, e.slot))
		require.Equal(t, OutcomeStored, storeOne(t, e, k, i%pipeBlocks))
	}
	require.NoError(t, e.FlushDisk(context.Background()))
	require.GreaterOrEqual(t, e.Stats().Disk.Writes, int64(len(keys)))
	require.NoError(t, e.Close())
}

// pipeEngine is an engine of 48 slots over the disk tier in dir, with
// hooks h.
func pipeEngine(t *testing.T, dir string, h engineHooks) *Engine {
	t.Helper()
	e, err := newEngine(withTestBackend(Config{PoolBytes: 48 * 8 << 10, Layout: smallLayout(pipeBlocks), Policy: PolicyLRU,
		Disk: &DiskConfig{Dirs: []string{dir}, CapacityBytes: 4 << 20, AdmitAll: true}}), h)
	require.NoError(t, err)
	return e
}

// TestDiskLoadPipelined: a Load of 4 blocks in the pool and 20 on disk
// copies the pool's blocks and the first chunks of promoted blocks to the
// GPU while a later read is still held (a hook delays the read of one
// block of the third chunk): the copies do not wait for every read. Once
// the read goes on, every block arrives byte-exact, the promoted blocks
// are in the pool, and the stats add up (one Load op, 24 blocks).
func TestDiskLoadPipelined(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t) })
	dir := t.TempDir()
	diskKeys := seqKeys(0, 20)
	writeDiskRecords(t, dir, diskKeys)

	held := diskKeys[2*diskChunk+1] // in the third chunk
	gate, reached := make(chan struct{}), make(chan struct{})
	e := pipeEngine(t, dir, engineHooks{beforeDiskGet: func(k Key) {
		if k == held {
			close(reached)
			<-gate
		}
	}})
	defer func() { require.NoError(t, e.Close()) }()
	hostKeys := seqKeys(100, 4)
	for i, k := range hostKeys {
		writeBlock(t, e, i, keyContent(k, e.slot))
		require.Equal(t, OutcomeStored, storeOne(t, e, k, i))
	}
	for id := range pipeBlocks {
		writeBlock(t, e, id, make([]byte, e.slot))
	}
	res, err := e.Lookup(append(append([]Key(nil), hostKeys...), diskKeys...), LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 4, res.Hits)
	require.Equal(t, 20, res.DiskHits)

	keys := append(append([]Key(nil), hostKeys...), diskKeys...)
	ids := seqIDs(30, len(keys))
	ch := loadInBackground(e, keys, ids)
	<-reached
	// While the held read waits: the pool's 4 blocks and the first two
	// chunks (16 promoted blocks) are copied.
	want := int64(4 + 2*diskChunk)
	require.Eventually(t, func() bool { return e.Stats().Copies.Load.Blocks >= want }, 10*time.Second, time.Millisecond,
		"copies of the blocks before the held read were not submitted while it was held")
	select {
	case <-ch:
		t.Fatal("Load returned before its last read")
	default:
	}
	for i := range 4 + 2*diskChunk {
		require.Equal(t, keyContent(keys[i], e.slot), blockBytes(e, ids[i]), "block %d", i)
	}
	close(gate)
	l := <-ch
	require.NoError(t, l.err)
	require.NoError(t, l.op.Wait(context.Background()))
	oc, err := l.op.Outcomes()
	require.NoError(t, err)
	for i, o := range oc {
		require.Equal(t, OutcomeLoaded, o, "block %d", i)
		require.Equal(t, keyContent(keys[i], e.slot), blockBytes(e, ids[i]), "block %d byte-exact", i)
	}
	require.NoError(t, l.op.StreamWait(0))
	require.NoError(t, l.op.Release())
	st := e.Stats()
	require.Equal(t, int64(1), st.Copies.Load.Ops, "one Load op over its parts")
	require.Equal(t, int64(24), st.Copies.Load.Blocks)
	require.Equal(t, int64(20), st.Disk.Hits)
	require.Zero(t, st.Disk.Misses)
	res, err = e.Lookup(keys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 24, res.Hits, "the promoted blocks are in the pool")
}

// TestDiskLoadFaultsMidPipeline: in one Load of blocks on disk, a damaged
// record (second chunk), a read that fails with EIO (third chunk) and a
// record deleted since the lookup are missing, those blocks only; every
// other block, before and after them, loads byte-exact; the blocks in the
// pool before the Load are still there, and the stats count the misses.
func TestDiskLoadFaultsMidPipeline(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t) })
	dir := t.TempDir()
	diskKeys := seqKeys(0, 20)
	writeDiskRecords(t, dir, diskKeys)
	damaged, failed, deleted := diskChunk+2, 2*diskChunk+1, 5
	flipRecordByte(t, dir, diskKeys[damaged], 8<<10)

	var failNext atomic.Bool
	e, err := newEngine(withTestBackend(Config{PoolBytes: 48 * 8 << 10, Layout: smallLayout(pipeBlocks), Policy: PolicyLRU,
		Disk: &DiskConfig{Dirs: []string{dir}, CapacityBytes: 4 << 20, AdmitAll: true}}), engineHooks{
		beforeDiskGet: func(k Key) { failNext.Store(k == diskKeys[failed]) },
		diskFaults: func(op disk.FaultOp, _ string) error {
			if op == disk.FaultRead && failNext.Load() {
				return unix.EIO
			}
			return nil
		}})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	// The hook and the seam pair up only one read at a time.
	e.disk.Readers = 1
	hostKeys := seqKeys(100, 4)
	for i, k := range hostKeys {
		writeBlock(t, e, i, keyContent(k, e.slot))
		require.Equal(t, OutcomeStored, storeOne(t, e, k, i))
	}
	e.disk.Delete([]Key{diskKeys[deleted]})

	ids := seqIDs(30, len(diskKeys))
	oc := loadAll(t, e, diskKeys, ids)
	for i, o := range oc {
		if i == damaged || i == failed || i == deleted {
			require.Equal(t, OutcomeMissing, o, "block %d", i)
			continue
		}
		require.Equal(t, OutcomeLoaded, o, "block %d", i)
		require.Equal(t, keyContent(diskKeys[i], e.slot), blockBytes(e, ids[i]), "block %d byte-exact", i)
	}
	st := e.Stats()
	require.Equal(t, int64(17), st.Disk.Hits)
	require.Equal(t, int64(2), st.Disk.Misses, "the damaged record and the failed read")
	require.Equal(t, int64(1), st.Disk.Corrupt)
	res, err := e.Lookup(hostKeys, LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 4, res.Hits, "nothing stored before was lost")
	res, err = e.Lookup(diskKeys[failed:failed+1], LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 0, res.Hits+res.DiskHits, "a record whose read failed is dropped (internal/tier/disk)")
	res, err = e.Lookup(diskKeys[failed+1:], LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, len(diskKeys)-failed-1, res.Hits, "the blocks after it were promoted")
}

// TestDiskLoadSignalPerLayer (host backend): a per-layer Load of pool and
// disk blocks (several parts) with a Signal: a caller stream waiting on
// the Signal right after the Load sees every block, the op has its
// per-layer events (0 on this backend), and StreamWait waits for every
// part.
func TestDiskLoadSignalPerLayer(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t) })
	dir := t.TempDir()
	diskKeys := seqKeys(0, 20)
	writeDiskRecords(t, dir, diskKeys)
	sim, err := cudadev.NewSim(cudadev.SimConfig{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sim.Close()) })
	e, err := newEngine(withTestBackend(Config{PoolBytes: 48 * 8 << 10, Layout: simLayout(t, sim, pipeBlocks), Policy: PolicyLRU,
		Disk: &DiskConfig{Dirs: []string{dir}, CapacityBytes: 4 << 20, AdmitAll: true}}), engineHooks{sim: sim})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	hostKeys := seqKeys(100, 2)
	for i, k := range hostKeys {
		writeBlock(t, e, i, keyContent(k, e.slot))
		require.Equal(t, OutcomeStored, storeOne(t, e, k, i))
	}
	keys := append(append([]Key(nil), hostKeys...), diskKeys...)
	ids := seqIDs(30, len(keys))
	sig, err := sim.CreateEvent(false)
	require.NoError(t, err)
	cs := sim.NewStream()
	op, err := e.Load(context.Background(), keys, ids, LoadOptions{Signal: uintptr(sig), PerLayer: true})
	require.NoError(t, err)
	seen := make([][]byte, len(keys))
	require.NoError(t, sim.StreamWaitEvent(cs, sig))
	require.NoError(t, sim.Launch(cs, func() {
		for i, id := range ids {
			seen[i] = blockBytes(e, id)
		}
	}))
	require.NoError(t, sim.StreamSynchronize(cs))
	for i, k := range keys {
		require.Equal(t, keyContent(k, e.slot), seen[i], "block %d seen after the Signal", i)
	}
	for l := range 2 {
		ev, err := op.LayerEvent(l)
		require.NoError(t, err)
		require.Zero(t, ev)
	}
	_, err = op.LayerEvent(2)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.NoError(t, op.StreamWait(uintptr(cs)))
	select {
	case <-op.Done():
	default:
		t.Fatal("StreamWait returned before the op was done")
	}
	require.Equal(t, len(keys), op.count(OutcomeLoaded))
	require.NoError(t, op.Release())
}

// TestCUDAFakeDiskLoad: on the CUDA backend (fake driver, random copy
// delays), plain and staged through device
// bounce chunks, a (per-layer, but for staged) Load of pool and
// disk blocks runs as several transfer ops whose events are chained: the
// op's Event, its last LayerEvent and a stream that StreamWaits on it all
// complete only after every block of every part is on the GPU, checked
// before the op is waited for; the Signal has completed once the op has.
func TestCUDAFakeDiskLoad(t *testing.T) {
	diskLoadEvents(t, func(t *testing.T) cuda.Driver {
		return fakeDriver(t, cudafake.Options{Seed: 3, MaxDelay: 200 * time.Microsecond})
	})
}

// TestGPUDiskLoad is TestCUDAFakeDiskLoad on the GPU (records on the
// test's temporary directory).
func TestGPUDiskLoad(t *testing.T) {
	diskLoadEvents(t, func(t *testing.T) cuda.Driver { return cudatest.Open(t).Drv })
}

// diskLoadEvents runs TestCUDAFakeDiskLoad's checks on the driver drv
// gives each variant.
func diskLoadEvents(t *testing.T, drv func(t *testing.T) cuda.Driver) {
	for _, v := range []struct {
		name   string
		staged bool
	}{{"events", false}, {"staged", true}} {
		t.Run(v.name, func(t *testing.T) {
			dir := t.TempDir()
			writeDiskRecords(t, dir, seqKeys(0, 60))
			d := drv(t)
			g := newGPUMem(t, d, 8<<10)
			defer g.close()
			slot := int64(8 << 10)
			var h engineHooks
			if v.staged {
				// Whole blocks go through device bounce chunks and the
				// bounce stream: a part's copies end on a second stream.
				h.copyOptions = cudacopy.Options{GatherMinRun: int(slot)}
			}
			e, err := newCUDAEngine(t, d, Config{PoolBytes: 48 * slot, StagingBytes: 64 << 10, Layout: g.layout(LayoutLayerSeparate, pipeBlocks),
				Policy: PolicyLRU, Disk: &DiskConfig{Dirs: []string{dir}, CapacityBytes: 4 << 20, AdmitAll: true}}, h)
			require.NoError(t, err)
			defer func() { require.NoError(t, e.Close()) }()
			hostKeys := seqKeys(100, 3)
			for i, k := range hostKeys {
				g.write(e, i, keyContent(k, e.slot))
			}
			storeAll(t, e, hostKeys, seqIDs(0, 3), StoreOptions{})
			sig, err := g.drv.EventCreate(cuda.EventDisableTiming)
			require.NoError(t, err)
			defer func() { require.NoError(t, g.drv.EventDestroy(sig)) }()
			ids := seqIDs(pipeBlocks-len(hostKeys)-20, len(hostKeys)+20)
			for round, wait := range []string{"event", "layer", "stream"} {
				keys := append(append([]Key(nil), hostKeys...), seqKeys(20*round, 20)...)
				res, err := e.Lookup(keys, LookupOptions{})
				require.NoError(t, err)
				require.Equal(t, 3, res.Hits)
				require.Equal(t, 20, res.DiskHits, "%s: the round's blocks are on disk only", wait)
				for _, id := range ids {
					g.write(e, id, make([]byte, e.slot))
				}
				op, err := e.Load(context.Background(), keys, ids, LoadOptions{PerLayer: !v.staged, Signal: uintptr(sig)})
				require.NoError(t, err)
				if v.staged && wait == "layer" {
					wait = "event" // staged copies are of whole blocks
				}
				switch wait {
				case "event":
					ev, err := op.Event()
					require.NoError(t, err)
					require.NotZero(t, ev)
					require.NoError(t, g.drv.EventSynchronize(cuda.Event(ev)))
				case "layer":
					ev, err := op.LayerEvent(1)
					require.NoError(t, err)
					require.NotZero(t, ev)
					require.NoError(t, g.drv.EventSynchronize(cuda.Event(ev)))
				case "stream":
					s, err := g.drv.StreamCreate(cuda.StreamNonBlocking, 0)
					require.NoError(t, err)
					require.NoError(t, op.StreamWait(uintptr(s)))
					require.NoError(t, g.drv.StreamSynchronize(s))
					require.NoError(t, g.drv.StreamDestroy(s))
				}
				for i, k := range keys {
					require.Equal(t, keyContent(k, e.slot), g.read(e, ids[i]), "%s: block %d on the GPU once the wait is over", wait, i)
				}
				require.NoError(t, op.Wait(context.Background()))
				done, err := g.drv.EventQuery(cuda.Event(sig))
				require.NoError(t, err)
				require.True(t, done, "the Signal completed with the load")
				require.Equal(t, len(keys), op.count(OutcomeLoaded))
				require.NoError(t, op.Release())
			}
			st := e.Stats()
			require.Equal(t, int64(60), st.Disk.Hits)
			if v.staged {
				require.Positive(t, st.Copies.Bounced, "the loads were staged")
			}
		})
	}
}

// loaded is the result of a Load run by loadInBackground.
type loaded struct {
	op  *Op
	err error
}

// loadInBackground runs e.Load of keys into ids on a goroutine of its own
// and sends its result on the channel it returns.
func loadInBackground(e *Engine, keys []Key, ids []int) <-chan loaded {
	ch := make(chan loaded, 1)
	go func() {
		op, err := e.Load(context.Background(), keys, ids, LoadOptions{})
		ch <- loaded{op, err}
	}()
	return ch
}
