package offload

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvoffload/kvoffload/internal/tier/disk"
)

// demoteSlots is the pool of the demotion tests: 128 slots of 8 KiB, so
// that the engine's low-watermark (two slots) evicts ahead of demand.
const demoteSlots = 128

func demoteConfig(dir string) Config {
	return Config{PoolBytes: demoteSlots * 8 << 10, Layout: smallLayout(16), Policy: PolicyLRU,
		Disk: &DiskConfig{Dirs: []string{dir}, CapacityBytes: 4 << 20, AdmitAll: true}}
}

// storeFlushed stores keys from..to-1, each its own chain from GPU block
// k%16 filled with seed k, flushing the disk tier after each, and returns
// the contents by key.
func storeFlushed(t *testing.T, e *Engine, from, to int, contents map[int][]byte) {
	t.Helper()
	for k := from; k < to; k++ {
		contents[k] = fillBlock(t, e, k%16, byte(k))
		require.Equal(t, OutcomeStored, storeOne(t, e, testKey(k), k%16))
		require.NoError(t, e.FlushDisk(context.Background()))
	}
}

// TestDiskDemoteFromSlot: blocks the watermark evicts ahead of demand are
// written to disk straight from their slot (no copy: Disk.Copies stays 0),
// each slot demoting until its write completes, then zeroed
// (ZeroOnRelease) and free again; they load back byte-exact.
func TestDiskDemoteFromSlot(t *testing.T) {
	cfg := demoteConfig(t.TempDir())
	cfg.ZeroOnRelease = true
	e := newTestEngine(t, cfg)
	defer func() { require.NoError(t, e.Close()) }()
	contents := map[int][]byte{}
	n := demoteSlots + 8
	storeFlushed(t, e, 0, n, contents)
	st, cs := e.Stats(), e.kc.Stats()
	require.Positive(t, st.Disk.Writes)
	require.Equal(t, int64(cs.Evicted), st.Disk.Writes, "every eviction written back")
	require.Equal(t, cs.Demotions, uint64(st.Disk.Writes), "each from its slot")
	require.Zero(t, st.Disk.Copies)
	require.Zero(t, st.Disk.Dropped)
	require.Zero(t, cs.Demoting, "every demoting slot given back")
	require.GreaterOrEqual(t, st.Pool.ZeroedSlots, int64(cs.Demotions), "demoted slots zeroed before reuse")

	res, err := e.Lookup(seqKeys(0, 4), LookupOptions{})
	require.NoError(t, err)
	require.Equal(t, 4, res.DiskHits)
	require.Equal(t, []Outcome{OutcomeLoaded, OutcomeLoaded, OutcomeLoaded, OutcomeLoaded}, loadAll(t, e, seqKeys(0, 4), []int{0, 1, 2, 3}))
	for i := range 4 {
		require.Equal(t, contents[i], blockBytes(e, i), "key %d written from its slot and loaded byte-exact", i)
	}
}

// heldPut is a beforeDiskPut that holds the first write until release,
// reporting its key on entered.
type heldPut struct {
	first   sync.Once
	entered chan Key
	proceed chan struct{}
	release func()
}

// holdFirstPut returns a heldPut; the test's cleanup releases it, so that
// a failing test still closes its engine.
func holdFirstPut(t *testing.T) *heldPut {
	h := &heldPut{entered: make(chan Key, 1), proceed: make(chan struct{})}
	var once sync.Once
	h.release = func() { once.Do(func() { close(h.proceed) }) }
	t.Cleanup(h.release)
	return h
}

func (h *heldPut) hook(k Key) {
	first := false
	h.first.Do(func() { first = true })
	if first {
		h.entered <- k
		<-h.proceed
	}
}

// demoting returns the cache's demoting slots.
func demoting(e *Engine) int { return e.kc.Stats().Demoting }

// TestDiskDemotingSlotHeld: while a block is written from its slot, the
// slot is neither reused (the pool refilled twice over meanwhile, the
// record still holds the block's bytes) nor released by Trim (pending
// until the write completes); a Delete of its key meanwhile deletes the
// record once written.
func TestDiskDemotingSlotHeld(t *testing.T) {
	h := holdFirstPut(t)
	e, err := newEngine(withTestBackend(demoteConfig(t.TempDir())), engineHooks{beforeDiskPut: h.hook})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	contents := map[int][]byte{}
	var held Key
	k := 0
	for ; ; k++ {
		require.Less(t, k, 2*demoteSlots, "no write-back started")
		contents[k] = fillBlock(t, e, k%16, byte(k))
		require.Equal(t, OutcomeStored, storeOne(t, e, testKey(k), k%16))
		select {
		case held = <-h.entered:
		default:
			continue
		}
		break
	}
	heldAt := -1
	for j := 0; j <= k; j++ {
		if testKey(j) == held {
			heldAt = j
		}
	}
	require.GreaterOrEqual(t, heldAt, 0, "the held write is of a stored key")
	// Refill the pool twice over while the write is held.
	for j := k + 1; j <= k+2*demoteSlots; j++ {
		contents[j] = fillBlock(t, e, j%16, byte(j))
		require.Equal(t, OutcomeStored, storeOne(t, e, testKey(j), j%16), "the store never waits for the disk")
	}
	require.Eventually(t, func() bool { return demoting(e) == 1 }, 10*time.Second, time.Millisecond,
		"the held write keeps its slot demoting; the others complete")

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	tr, err := e.Trim(ctx, 1<<40)
	cancel()
	require.NoError(t, err)
	require.Positive(t, tr.PendingBytes, "the demoting slot's region is not released")

	h.release()
	require.NoError(t, e.FlushDisk(context.Background()))
	require.Zero(t, demoting(e))
	buf := disk.AlignedBuffer(int(e.slot))
	found, err := e.disk.Store.Get(held, buf)
	require.NoError(t, err)
	require.True(t, found)
	require.Equal(t, contents[heldAt], buf, "the slot was not reused while it was written")
	require.Eventually(t, func() bool { return e.Stats().Pool.TrimmedBytes == tr.PendingBytes+tr.FreedBytes }, 10*time.Second, time.Millisecond,
		"the trimmed region is released once its write completed")
}

// TestDiskDeleteWhileDemoting: a key deleted while its block is written
// from its slot has no record once the write completes.
func TestDiskDeleteWhileDemoting(t *testing.T) {
	h := holdFirstPut(t)
	e, err := newEngine(withTestBackend(demoteConfig(t.TempDir())), engineHooks{beforeDiskPut: h.hook})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	deleted := make(chan Key, 1)
	go func() {
		k := <-h.entered
		if _, err := e.Delete([]Key{k}); err == nil {
			deleted <- k
		}
		h.release()
	}()
	storeFlushed(t, e, 0, demoteSlots+4, map[int][]byte{})
	k := <-deleted
	st := e.Stats()
	require.Positive(t, st.Disk.Writes)
	require.Zero(t, st.Disk.Copies)
	require.False(t, e.disk.Store.Contains(k), "the deleted key's record was deleted once written")
	require.Equal(t, st.Disk.Writes-1, st.Disk.Records, "the others stay")
}

// TestDiskDemoteDropsAtTheBound: with WriteBackBytes of one block and its
// write held, the next admitted eviction is dropped and counted, its slot
// freed at once; every slot is back once the write completes.
func TestDiskDemoteDropsAtTheBound(t *testing.T) {
	h := holdFirstPut(t)
	cfg := demoteConfig(t.TempDir())
	cfg.Disk.WriteBackBytes = 8 << 10
	e, err := newEngine(withTestBackend(cfg), engineHooks{beforeDiskPut: h.hook})
	require.NoError(t, err)
	defer func() { require.NoError(t, e.Close()) }()
	k := 0
	for ; e.Stats().Disk.Dropped == 0; k++ {
		require.Less(t, k, 2*demoteSlots, "no eviction dropped")
		fillBlock(t, e, k%16, byte(k))
		require.Equal(t, OutcomeStored, storeOne(t, e, testKey(k), k%16))
	}
	<-h.entered
	require.Equal(t, 1, demoting(e))
	h.release()
	require.NoError(t, e.FlushDisk(context.Background()))
	st, cs := e.Stats(), e.kc.Stats()
	require.Equal(t, int64(1), st.Disk.Writes)
	require.Equal(t, int64(cs.Evicted), st.Disk.Writes+st.Disk.Dropped)
	require.Zero(t, cs.Demoting)
}

// TestDiskDemoteWriteFaults: ENOSPC and EIO on writes from demoting slots
// are counted write errors; the slots come back and the pool keeps
// serving.
func TestDiskDemoteWriteFaults(t *testing.T) {
	for _, errno := range []error{unix.ENOSPC, unix.EIO} {
		t.Run(errno.Error(), func(t *testing.T) {
			var on atomic.Bool
			on.Store(true)
			e := diskFaultEngine(t, demoteConfig(t.TempDir()), disk.FaultWrite, errno, &on)
			defer func() { require.NoError(t, e.Close()) }()
			storeFlushed(t, e, 0, demoteSlots+4, map[int][]byte{})
			st, cs := e.Stats(), e.kc.Stats()
			require.Positive(t, st.Disk.WriteErrors)
			require.Zero(t, st.Disk.Writes)
			require.Equal(t, cs.Demotions, uint64(st.Disk.WriteErrors))
			require.Zero(t, cs.Demoting)
			require.Zero(t, st.Disk.Records)
			res, err := e.Lookup(seqKeys(demoteSlots, 4), LookupOptions{})
			require.NoError(t, err)
			require.Equal(t, 4, res.Hits, "the pool keeps serving")
		})
	}
}

// TestDiskReadableWhileWriting: a block evicted to disk is readable from
// the moment its write-back is accepted, before its record is written:
// Lookup counts it among DiskHits and Load copies it, byte-exact, from
// the demoting slot (ahead-of-demand evictions) or from the copy (a store
// that needed the slot at once), counted in Disk.HitsWriting, while the
// write is still held. Once deleted it is no longer served, and its
// record is deleted once written.
func TestDiskReadableWhileWriting(t *testing.T) {
	copyCfg := diskEngineConfig("")
	copyCfg.Disk.AdmitAll = true
	for _, tc := range []struct {
		name     string
		cfg      Config
		fromSlot bool
	}{{"from its slot", demoteConfig(""), true}, {"from its copy", copyCfg, false}} {
		t.Run(tc.name, func(t *testing.T) {
			h := holdFirstPut(t)
			cfg := tc.cfg
			cfg.Disk = &DiskConfig{Dirs: []string{t.TempDir()}, CapacityBytes: cfg.Disk.CapacityBytes, AdmitAll: true}
			e, err := newEngine(withTestBackend(cfg), engineHooks{beforeDiskPut: h.hook})
			require.NoError(t, err)
			defer func() {
				h.release() // a failing check first: Close waits for the write
				require.NoError(t, e.Close())
			}()
			contents := map[Key][]byte{}
			var held Key
			for k := 0; held == (Key{}); k++ {
				require.Less(t, k, 2*demoteSlots, "no write-back started")
				contents[testKey(k)] = fillBlock(t, e, k%8, byte(k))
				require.Equal(t, OutcomeStored, storeOne(t, e, testKey(k), k%8))
				select {
				case held = <-h.entered:
				default:
				}
			}
			require.NotNil(t, contents[held], "the held write is of a stored key")
			st := e.Stats()
			if tc.fromSlot {
				// Only the held write stays: the other writer may still be
				// finishing an eviction queued behind it (CI saw 2 here).
				require.Eventually(t, func() bool { return demoting(e) == 1 }, 10*time.Second, time.Millisecond,
					"demoting slots: %d, want the held one", demoting(e))
				require.Zero(t, st.Disk.Copies)
			} else {
				require.Positive(t, st.Disk.Copies)
			}
			require.False(t, e.disk.Store.Contains(held), "not written yet")

			res, err := e.Lookup([]Key{held}, LookupOptions{})
			require.NoError(t, err)
			require.Equal(t, 0, res.Hits)
			require.Equal(t, 1, res.DiskHits, "a block being written counts as on disk")
			fillBlock(t, e, 15, 0xEE)
			require.Equal(t, []Outcome{OutcomeLoaded}, loadAll(t, e, []Key{held}, []int{15}))
			require.Equal(t, contents[held], blockBytes(e, 15), "loaded byte-exact from the write-back in flight")
			require.Equal(t, int64(1), e.Stats().Disk.HitsWriting)
			require.False(t, e.disk.Store.Contains(held), "still not written: the load read no record")

			_, err = e.Delete([]Key{held})
			require.NoError(t, err)
			res, err = e.Lookup([]Key{held}, LookupOptions{})
			require.NoError(t, err)
			require.Equal(t, 0, res.Hits+res.DiskHits, "a deleted block is not served from its write-back")
			require.Equal(t, []Outcome{OutcomeMissing}, loadAll(t, e, []Key{held}, []int{15}))

			h.release()
			require.NoError(t, e.FlushDisk(context.Background()))
			require.False(t, e.disk.Store.Contains(held), "the deleted key's record was deleted once written")
			require.Equal(t, int64(1), e.Stats().Disk.HitsWriting)
		})
	}
}
