package writeback

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/kvcache"
	"github.com/stretchr/testify/require"
)

const slotBytes = 4096

// rig is a Writer over a Store in t.TempDir() and a fake pool of slots
// (one region, slot i at offset i*slotBytes), with a gate that holds every
// Put until it is opened.
type rig struct {
	w       *Writer
	store   *disk.Store
	pool    []byte
	gate    chan struct{}
	mu      sync.Mutex
	demoted []kvcache.Slot
}

func newRig(t *testing.T, maxBusy int, tombKeys bool) *rig {
	t.Helper()
	st, err := disk.Open(disk.Config{Dirs: []string{t.TempDir()}, CapacityBytes: 64 * disk.SlotBytes(slotBytes),
		RecordPayloadBytes: slotBytes, Fingerprint: 0x5eed, Direct: disk.DirectOff})
	require.NoError(t, err)
	r := &rig{store: st, pool: disk.AlignedBuffer(16 * slotBytes), gate: make(chan struct{})}
	r.w = New(Config{Store: st, SlotBytes: slotBytes, MaxBusy: maxBusy, Writers: 2, TombKeys: tombKeys,
		Bytes: func(s kvcache.Slot) []byte { return r.pool[s.Off : s.Off+slotBytes] },
		Demoted: func(s kvcache.Slot) {
			r.mu.Lock()
			r.demoted = append(r.demoted, s)
			r.mu.Unlock()
		},
		BeforePut: func(kvcache.Key) { <-r.gate }})
	r.w.Start()
	t.Cleanup(func() {
		r.open()
		r.w.Close()
		require.NoError(t, st.Close())
	})
	return r
}

// open lets the held Puts and every later one go.
func (r *rig) open() {
	select {
	case <-r.gate:
	default:
		close(r.gate)
	}
}

// slot returns slot i, its bytes filled from key k.
func (r *rig) slot(i int, k kvcache.Key) kvcache.Slot {
	s := kvcache.Slot{ID: kvcache.SlotID(i), Gen: 1, Off: uint64(i * slotBytes)}
	copy(r.pool[s.Off:s.Off+slotBytes], block(k))
	return s
}

func block(k kvcache.Key) []byte {
	return bytes.Repeat(k[:], slotBytes/len(k))
}

func key(i byte) kvcache.Key { return kvcache.Key{i, 0xb1, 0x0c, 0x4b} }

func (r *rig) flush(t *testing.T) {
	t.Helper()
	r.open()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, r.w.Flush(ctx))
}

// TestReadableInFlight: a block accepted from its slot, and one copied
// out, are readable (Contains, Get) until written, then on disk; the demoting
// slot is given back once written.
func TestReadableInFlight(t *testing.T) {
	r := newRig(t, 4, false)
	k1, k2 := key(1), key(2)
	s1 := r.slot(1, k1)
	require.True(t, r.w.Demote(s1, k1, false), "ahead of demand: from the slot")
	require.False(t, r.w.Demote(r.slot(2, k2), k2, true), "needed: copied")
	require.EqualValues(t, 1, r.w.Copies.Load())
	copy(r.pool[2*slotBytes:3*slotBytes], make([]byte, slotBytes)) // the slot is reused: the copy stays
	r.w.OnDemote(s1, k1)

	require.False(t, r.store.Contains(k1), "held before its Put")
	require.Equal(t, 2, r.w.Prefix([]kvcache.Key{k1, k2, key(3)}))
	require.False(t, r.w.Demote(r.slot(3, k1), k1, false), "in flight already")
	for _, k := range []kvcache.Key{k1, k2} {
		buf := make([]byte, slotBytes)
		require.True(t, r.w.Get(k, buf))
		require.Equal(t, block(k), buf)
	}
	require.EqualValues(t, 2, r.w.Served.Load())

	r.flush(t)
	require.EqualValues(t, 2, r.w.Writes.Load())
	require.Equal(t, []kvcache.Slot{s1}, r.demoted)
	for _, k := range []kvcache.Key{k1, k2} {
		buf := make([]byte, slotBytes)
		require.True(t, r.w.Get(k, buf))
		require.Equal(t, block(k), buf)
	}
	require.EqualValues(t, 2, r.w.Served.Load(), "read from the records")
}

// TestDeleteClearInFlight: a write-back whose key is deleted, or cleared,
// while it is in flight is not served, and its record is deleted once
// written; one accepted after a Clear is kept.
func TestDeleteClearInFlight(t *testing.T) {
	for _, tomb := range []bool{false, true} {
		r := newRig(t, 8, tomb)
		k1, k2, k3, k4 := key(1), key(2), key(3), key(4)
		s1 := r.slot(1, k1)
		require.True(t, r.w.Demote(s1, k1, false))
		r.w.OnDemote(s1, k1)
		require.False(t, r.w.Demote(r.slot(2, k2), k2, true))
		require.False(t, r.w.Demote(r.slot(3, k3), k3, true))

		r.w.Delete([]kvcache.Key{k1, k2})
		require.False(t, r.w.Contains(k1))
		require.False(t, r.w.Get(k2, make([]byte, slotBytes)), "deleted: not served")
		require.True(t, r.w.Contains(k3))
		r.w.Clear()
		require.False(t, r.w.Contains(k3), "cleared: not served")
		require.False(t, r.w.Demote(r.slot(4, k4), k4, true))
		require.True(t, r.w.Contains(k4), "accepted after the Clear")

		r.flush(t)
		require.EqualValues(t, 4, r.w.Writes.Load(), "every Put ran")
		for _, k := range []kvcache.Key{k1, k2, k3} {
			require.False(t, r.store.Contains(k), "tomb %v: key %x's record deleted once written", tomb, k[0])
		}
		require.True(t, r.store.Contains(k4))
		require.Equal(t, []kvcache.Slot{s1}, r.demoted, "the deleted key's slot given back")
	}
}

// TestTombKeys: with TombKeys a key deleted while write-backs are
// unfinished stays deleted for a write-back of it accepted after; without,
// only the write-back in flight at the Delete is.
func TestTombKeys(t *testing.T) {
	for _, tomb := range []bool{false, true} {
		r := newRig(t, 8, tomb)
		k1, k9 := key(1), key(9)
		require.False(t, r.w.Demote(r.slot(9, k9), k9, true)) // keeps the Writer busy
		require.False(t, r.w.Demote(r.slot(1, k1), k1, true))
		r.w.Delete([]kvcache.Key{k1})
		require.False(t, r.w.Demote(r.slot(2, k1), k1, true), "stored and evicted again")
		require.Equal(t, !tomb, r.w.Contains(k1))
		r.flush(t)
		// Two write-backs of k1, Put in turn: without TombKeys the first's
		// record is deleted before the second writes its own, which is
		// kept (TestDeletedThenStoredAgain); with it both are deleted.
		require.Equal(t, !tomb, r.store.Contains(k1))
		require.True(t, r.store.Contains(k9))
	}
}

// TestDropPastMaxBusy: past MaxBusy unfinished write-backs an eviction
// is dropped, counted, and never waits; after Close a slot accepted before
// is given back unwritten.
func TestDropPastMaxBusy(t *testing.T) {
	r := newRig(t, 2, false)
	s1, s2 := r.slot(1, key(1)), r.slot(2, key(2))
	require.True(t, r.w.Demote(s1, key(1), false))
	require.False(t, r.w.Demote(r.slot(3, key(3)), key(3), true))
	require.False(t, r.w.Demote(s2, key(2), false), "past MaxBusy")
	require.False(t, r.w.Copy(key(4), r.pool[4*slotBytes:5*slotBytes]), "past MaxBusy")
	require.EqualValues(t, 2, r.w.Dropped.Load())
	require.False(t, r.w.Contains(key(2)))

	r.open()
	require.True(t, r.w.Close())
	require.False(t, r.w.Close(), "closed already")
	require.True(t, r.store.Contains(key(3)), "the queued copy was written at Close")
	r.w.OnDemote(s1, key(1)) // accepted before Close, demoting after
	require.EqualValues(t, 3, r.w.Dropped.Load())
	require.Equal(t, []kvcache.Slot{s1}, r.demoted, "given back unwritten")
	require.False(t, r.store.Contains(key(1)))
	require.False(t, r.w.Demote(s2, key(2), false), "closed")
	require.EqualValues(t, 4, r.w.Dropped.Load())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, r.w.Flush(ctx), "nothing unfinished")
}

// TestFinishWaitsForReaders: a write-back's finish waits for a reader
// copying from it before its buffer is given back for another copy.
func TestFinishWaitsForReaders(t *testing.T) {
	r := newRig(t, 1, false)
	k1, k2 := key(1), key(2)
	require.False(t, r.w.Demote(r.slot(1, k1), k1, true))
	// Hold a reader on k1's write-back as Get does while it copies.
	r.w.busyMu.Lock()
	wb := r.w.servableLocked(k1)
	require.NotNil(t, wb)
	wb.readers++
	r.w.busyMu.Unlock()
	r.open() // the Put runs; finish waits for the reader
	time.Sleep(50 * time.Millisecond)
	require.False(t, r.w.Demote(r.slot(2, k2), k2, true), "the one write-back is not finished")
	require.EqualValues(t, 1, r.w.Dropped.Load())
	require.Equal(t, block(k1), wb.src, "its bytes intact while read")
	r.w.busyMu.Lock()
	wb.readers--
	r.w.readDone.Broadcast()
	r.w.busyMu.Unlock()
	r.flush(t)
	require.True(t, r.store.Contains(k1))
	require.False(t, r.w.Demote(r.slot(2, k2), k2, true))
	r.flush(t)
	require.True(t, r.store.Contains(k2))
}

// TestDeletedThenStoredAgain: a key's write-back deleted while its Put is
// held, then the key stored and evicted again: the second write-back Puts
// only after the first finished (and deleted its record), so the second
// record is kept, with the second block's bytes. Before, the second Put
// could end first and the first's finish delete its record.
func TestDeletedThenStoredAgain(t *testing.T) {
	st, err := disk.Open(disk.Config{Dirs: []string{t.TempDir()}, CapacityBytes: 64 * disk.SlotBytes(slotBytes),
		RecordPayloadBytes: slotBytes, Fingerprint: 0x5eed, Direct: disk.DirectOff})
	require.NoError(t, err)
	first, held := make(chan struct{}), make(chan struct{})
	var puts sync.Mutex
	n := 0
	w := New(Config{Store: st, SlotBytes: slotBytes, MaxBusy: 4, Writers: 2,
		Bytes: func(kvcache.Slot) []byte { return nil }, Demoted: func(kvcache.Slot) {},
		BeforePut: func(kvcache.Key) {
			puts.Lock()
			n++
			i := n
			puts.Unlock()
			if i == 1 {
				close(held)
				<-first // the first Put waits until the test lets it go
			}
		}})
	w.Start()
	defer func() {
		w.Close()
		require.NoError(t, st.Close())
	}()
	k := key(1)
	old, fresh := block(key(7)), block(key(8))
	require.True(t, w.Copy(k, old))
	<-held
	w.Delete([]kvcache.Key{k})
	require.False(t, w.Contains(k))
	require.True(t, w.Copy(k, fresh), "stored and evicted again: a second write-back")
	time.Sleep(50 * time.Millisecond) // the second writer's chance to run ahead
	close(first)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, w.Flush(ctx))
	require.True(t, st.Contains(k), "the second record was deleted by the first write-back's finish")
	buf := make([]byte, slotBytes)
	require.True(t, w.Get(k, buf))
	require.Equal(t, fresh, buf)
	require.EqualValues(t, 2, w.Writes.Load())
}

// TestDeletedThenStoredAgainFromSlot: the same with the first write-back
// accepted from its slot (Demote, not needed), which is queued only when
// the cache hands the slot over (OnDemote, once its readers are done):
// here after the key's second write-back was queued. Order is by
// acceptance: the second waits, parked, for the first's finish.
func TestDeletedThenStoredAgainFromSlot(t *testing.T) {
	r := newRig(t, 8, false)
	r.open()
	k := key(1)
	s1 := r.slot(1, key(7)) // the old block's bytes
	require.True(t, r.w.Demote(s1, k, false), "accepted from its slot")
	r.w.Delete([]kvcache.Key{k})
	fresh := block(key(8))
	require.True(t, r.w.Copy(k, fresh), "stored and evicted again")
	time.Sleep(20 * time.Millisecond) // a writer takes the second write-back meanwhile
	require.False(t, r.store.Contains(k), "the second write-back was written before the first")
	r.w.OnDemote(s1, k)
	r.flush(t)
	require.True(t, r.store.Contains(k), "the first write-back's finish deleted the second's record")
	buf := make([]byte, slotBytes)
	require.True(t, r.w.Get(k, buf))
	require.Equal(t, fresh, buf)
	require.EqualValues(t, 2, r.w.Writes.Load())
	require.Equal(t, []kvcache.Slot{s1}, r.demoted)
}

// TestParkedDroppedAfterClose: a write-back parked behind one accepted
// from its slot is dropped, its buffer given back, when that slot is
// handed over only after Close.
func TestParkedDroppedAfterClose(t *testing.T) {
	r := newRig(t, 8, false)
	r.open()
	k := key(1)
	s1 := r.slot(1, k)
	require.True(t, r.w.Demote(s1, k, false))
	r.w.Delete([]kvcache.Key{k})
	require.True(t, r.w.Copy(k, block(key(8))))
	time.Sleep(20 * time.Millisecond) // parked by a writer
	require.True(t, r.w.Close())
	r.w.OnDemote(s1, k)
	require.EqualValues(t, 2, r.w.Dropped.Load(), "the slot's write-back and the one parked behind it")
	require.Equal(t, []kvcache.Slot{s1}, r.demoted)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, r.w.Flush(ctx), "both finished")
	require.False(t, r.store.Contains(k))
}
