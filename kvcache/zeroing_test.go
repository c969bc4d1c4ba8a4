package kvcache

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// blockingOnFree is a Config.OnFree that reports each slot on started and
// returns only when proceed is closed (or sent to).
type blockingOnFree struct {
	started chan Slot
	proceed chan struct{}
}

func newBlockingOnFree() *blockingOnFree {
	return &blockingOnFree{started: make(chan Slot, 16), proceed: make(chan struct{})}
}

func (b *blockingOnFree) onFree(s Slot) {
	b.started <- s
	<-b.proceed
}

// TestZeroingOffTheLock: while OnFree zeroes a released slot, every other
// call proceeds; the slot is neither free nor readable, a store finding no
// other slot is refused as pool full without waiting, and once OnFree
// returns the slot is free again.
func TestZeroingOffTheLock(t *testing.T) {
	z := newBlockingOnFree()
	c := newCache(t, 2, Config{OnFree: z.onFree})
	ks, ids := keysN(0, 2)
	res := store(t, c, ks, ids)
	require.Len(t, res, 2)

	deleted := make(chan int)
	go func() { deleted <- c.Delete(ks[:1]) }()
	zs := <-z.started
	require.Equal(t, res[0].Slot, zs, "OnFree gets the deleted block's slot handle")

	// Other calls run while the slot is zeroing.
	require.Equal(t, 0, c.Lookup(ks[:1]))
	require.Equal(t, 1, c.Lookup(ks[1:]))
	st := c.Stats()
	require.Equal(t, 1, st.Zeroing)
	require.Zero(t, st.Free)
	require.NoError(t, c.Verify())
	// The slot is not handed out: a store is refused at once, not after the
	// zeroing (its chain's parent ks[1] is not a victim).
	more, moreIDs := keysN(2, 1)
	r, err := c.BeginStore(StoreRequest{Parent: ks[1], Keys: more, BlockIDs: moreIDs}, nil)
	require.NoError(t, err)
	require.Equal(t, StoreRefusedFull, r[0].Outcome)
	require.ErrorIs(t, c.CompleteStore([]Slot{zs}, nil), errStaleSlot, "a zeroing slot's handle is stale")

	z.proceed <- struct{}{}
	require.Equal(t, 1, <-deleted)
	st = c.Stats()
	require.Zero(t, st.Zeroing)
	require.Equal(t, 1, st.Free)
	require.NoError(t, c.Verify())
	r = store(t, c, more, moreIDs)
	require.Equal(t, StoreWrite, r[0].Outcome)
	require.Equal(t, zs.ID, r[0].Slot.ID, "the zeroed slot is reused")
	require.NotEqual(t, zs.Gen, r[0].Slot.Gen)
}

// TestTrimWaitsForZeroing: a region with a slot being zeroed drains but is
// not releasable until OnFree returns; the slot is then retired, not freed.
func TestTrimWaitsForZeroing(t *testing.T) {
	z := newBlockingOnFree()
	c := newCache(t, 2, Config{OnFree: z.onFree})
	ks, ids := keysN(0, 2)
	store(t, c, ks, ids)
	deleted := make(chan int)
	go func() { deleted <- c.Delete(ks[:1]) }()
	<-z.started

	done, err := c.RemoveRegion(1)
	require.NoError(t, err)
	require.False(t, done, "region released while one of its slots is zeroing")
	require.Empty(t, c.TakeReleasable(nil))
	require.NoError(t, c.Verify())

	close(z.proceed)
	require.Equal(t, 1, <-deleted)
	require.Equal(t, []RegionID{1}, c.TakeReleasable(nil))
	st := c.Stats()
	require.Zero(t, st.Zeroing)
	require.Zero(t, st.Free)
	require.Zero(t, st.Regions)
	require.NoError(t, c.Verify())
}

// TestCloseWaitsForZeroing: Close returns only after the OnFree calls in
// progress returned.
func TestCloseWaitsForZeroing(t *testing.T) {
	z := newBlockingOnFree()
	c := newCache(t, 1, Config{OnFree: z.onFree})
	ks, ids := keysN(0, 1)
	store(t, c, ks, ids)
	deleted := make(chan int)
	go func() { deleted <- c.Delete(ks) }()
	<-z.started

	closed := make(chan struct{})
	go func() {
		c.Close()
		close(closed)
	}()
	// Close must still be waiting: it cannot return before proceed, since
	// the zeroing slot only leaves its state after OnFree returns.
	select {
	case <-closed:
		t.Fatal("Close returned while OnFree was zeroing a slot")
	case <-deleted:
		t.Fatal("Delete returned before its OnFree did")
	default:
	}
	close(z.proceed)
	<-closed
	require.Equal(t, 1, <-deleted)
	require.Zero(t, c.Stats().Zeroing)
	require.NoError(t, c.Verify())
}

// TestStoreZeroesItsOwnVictims: a store into a full pool (no watermark)
// evicts a block and zeroes its slot at once, under the lock, instead of
// being refused; the slot comes back zeroed before it is handed out.
func TestStoreZeroesItsOwnVictims(t *testing.T) {
	var zeroed []Slot
	c := newCache(t, 1, Config{OnFree: func(s Slot) { zeroed = append(zeroed, s) }})
	ks, ids := keysN(0, 2)
	first := store(t, c, ks[:1], ids[:1])
	r := store(t, c, ks[1:], ids[1:])
	require.Equal(t, StoreWrite, r[0].Outcome)
	require.Equal(t, []Slot{first[0].Slot}, zeroed, "the evicted block's slot was zeroed before its reuse")
	require.Equal(t, first[0].Slot.ID, r[0].Slot.ID)
	st := c.Stats()
	require.Equal(t, uint64(1), st.ZeroedUnderLock)
	require.Equal(t, uint64(1), st.Evicted)
	require.Zero(t, st.Zeroing)
	require.NoError(t, c.Verify())
}

// TestIndexEventEvicted: OnIndex marks a policy eviction Evicted, and OnFree
// later gets the same slot handle (ID and Gen) with the bytes untouched
// meanwhile; a Delete's removal is not marked.
func TestIndexEventEvicted(t *testing.T) {
	var events []IndexEvent
	var freed []Slot
	c := newCache(t, 2, Config{
		OnIndex: func(ev IndexEvent) {
			if !ev.Ready {
				events = append(events, ev)
			}
		},
		OnFree: func(s Slot) { freed = append(freed, s) },
	})
	ks, ids := keysN(0, 2)
	res := store(t, c, ks, ids)
	require.Equal(t, 1, c.Delete(ks[1:]))
	require.Len(t, events, 1)
	require.False(t, events[0].Evicted, "a delete is not an eviction")
	require.Equal(t, res[1].Slot, freed[0])

	// Two more blocks in a pool of two: the first evicts nothing (the
	// deleted slot is free), the second evicts ks[0].
	more, moreIDs := keysN(2, 2)
	store(t, c, more[:1], moreIDs[:1])
	store(t, c, more[1:], moreIDs[1:])
	require.Len(t, events, 2)
	ev := events[1]
	require.True(t, ev.Evicted, "the policy's eviction")
	require.Equal(t, ks[0], ev.Key)
	require.Equal(t, res[0].Slot, ev.Slot)
	require.Contains(t, freed, ev.Slot, "OnFree gets the evicted block's slot, same generation")
	require.NoError(t, c.Verify())
}
