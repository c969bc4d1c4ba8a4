package kvcache

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// demoteRecorder records Config.Demote's questions and Config.OnDemote's
// slots, and accepts every demotion.
type demoteRecorder struct {
	c       *Cache
	asked   []bool // the needed argument of each Demote call
	handed  []demotion
	locked  []bool // whether the cache's lock was held in each OnDemote
	onEvery func(Slot, Key)
}

func (d *demoteRecorder) demote(_ Slot, _ Key, needed bool) bool {
	d.asked = append(d.asked, needed)
	return true
}

func (d *demoteRecorder) onDemote(s Slot, k Key) {
	free := d.c.mu.TryLock()
	if free {
		d.c.mu.Unlock()
	}
	d.locked = append(d.locked, !free)
	d.handed = append(d.handed, demotion{s, k})
	if d.onEvery != nil {
		d.onEvery(s, k)
	}
}

func newDemoteCache(t *testing.T, slots int, cfg Config) (*Cache, *demoteRecorder) {
	d := &demoteRecorder{}
	cfg.Demote, cfg.OnDemote = d.demote, d.onDemote
	c := newCache(t, slots, cfg)
	d.c = c
	return c, d
}

// TestDemoteLifecycle: a block the policy evicts ahead of demand goes into
// demoting: out of the index, its slot handed to OnDemote (outside the
// lock) with its key, never to a store, its region not releasable, until
// Demoted frees it (through OnFree). A store that needs a slot at once
// frees its own victim instead, and Demote is told so.
func TestDemoteLifecycle(t *testing.T) {
	var zeroed []Slot
	c, d := newDemoteCache(t, 3, Config{LowWatermark: 1, OnFree: func(s Slot) { zeroed = append(zeroed, s) }})
	ks, ids := keysN(0, 4)
	first := append(store(t, c, ks[:1], ids[:1]), store(t, c, ks[1:2], ids[1:2])...) // two chains
	require.Empty(t, d.asked, "one slot free: the watermark holds")

	// k2 takes the free slot; the watermark evicts k0, ahead of demand.
	r := store(t, c, ks[2:3], ids[2:3])
	require.Equal(t, []bool{false}, d.asked)
	require.Equal(t, []demotion{{first[0].Slot, ks[0]}}, d.handed)
	require.Equal(t, []bool{false}, d.locked, "OnDemote runs without the cache's lock")
	dem := first[0].Slot
	require.NotEqual(t, dem.ID, r[0].Slot.ID)
	st := c.Stats()
	require.Equal(t, 1, st.Demoting)
	require.Equal(t, uint64(1), st.Demotions)
	require.Equal(t, uint64(1), st.Evicted)
	require.Zero(t, st.Free)
	require.Empty(t, zeroed, "a demoting slot is not zeroed")
	require.Equal(t, 0, c.Lookup(ks[:1]), "a demoting block is out of the index")
	require.NoError(t, c.Verify())

	// No slot free, one demoting: k3's store evicts k1 for itself and
	// takes its slot (zeroed under the lock), never the demoting one.
	r = store(t, c, ks[3:4], ids[3:4])
	require.Equal(t, StoreWrite, r[0].Outcome)
	require.Equal(t, first[1].Slot.ID, r[0].Slot.ID)
	require.Equal(t, []bool{false, true}, d.asked, "the store's own victim is needed at once")
	require.Len(t, d.handed, 1)
	require.Equal(t, []Slot{first[1].Slot}, zeroed)
	require.Equal(t, 1, c.Stats().Demoting)

	// The demoting slot's handle is good for Demoted only.
	require.ErrorIs(t, c.CompleteStore([]Slot{dem}, nil), errStaleSlot)
	require.ErrorIs(t, c.EndLoad([]Slot{dem}), errStaleSlot)
	require.ErrorIs(t, c.Demoted([]Slot{{ID: dem.ID, Gen: dem.Gen + 1}}), errStaleSlot)
	require.ErrorIs(t, c.Demoted([]Slot{{ID: 99}}), errStaleSlot)
	require.ErrorIs(t, c.Demoted([]Slot{dem, dem}), errDuplicate)
	require.ErrorIs(t, c.Demoted([]Slot{r[0].Slot}), errStaleSlot, "a ready slot is not demoting")
	require.Equal(t, 1, c.Stats().Demoting)

	// Trim: the region drains but is not releasable while a slot demotes.
	done, err := c.RemoveRegion(1)
	require.NoError(t, err)
	require.False(t, done)
	require.Empty(t, c.TakeReleasable(nil))
	require.NoError(t, c.Verify())

	require.NoError(t, c.Demoted([]Slot{dem}))
	require.Equal(t, []RegionID{1}, c.TakeReleasable(nil))
	require.Len(t, zeroed, 1, "a draining region's slot is not zeroed")
	require.ErrorIs(t, c.Demoted([]Slot{dem}), errStaleSlot, "Demoted twice")
	st = c.Stats()
	require.Zero(t, st.Demoting)
	require.Zero(t, st.Regions)
	require.NoError(t, c.Verify())
}

// TestDemotedZeroesAndFrees: Demoted sends the slot through OnFree to the
// free list, where the next store finds it; Demote answering false frees
// the slot at once.
func TestDemotedZeroesAndFrees(t *testing.T) {
	var zeroed []Slot
	accept := true
	var handed []Slot
	c := newCache(t, 2, Config{LowWatermark: 1,
		Demote:   func(Slot, Key, bool) bool { return accept },
		OnDemote: func(s Slot, _ Key) { handed = append(handed, s) },
		OnFree:   func(s Slot) { zeroed = append(zeroed, s) }})
	ks, ids := keysN(0, 3)
	first := store(t, c, ks[:1], ids[:1])
	store(t, c, ks[1:2], ids[1:2]) // evicts ks[0] ahead: demoting
	require.Equal(t, []Slot{first[0].Slot}, handed)
	require.Zero(t, c.Stats().Free)
	require.NoError(t, c.Demoted(handed))
	require.Equal(t, []Slot{first[0].Slot}, zeroed, "zeroed once demoted")
	require.Equal(t, 1, c.Stats().Free)

	accept = false
	r := store(t, c, ks[2:3], ids[2:3]) // evicts ks[1] ahead, not demoted
	require.Len(t, handed, 1)
	require.Len(t, zeroed, 2)
	require.Equal(t, 1, c.Stats().Free)
	require.Equal(t, first[0].Slot.ID, r[0].Slot.ID, "the demoted slot was reused")
	require.NoError(t, c.Verify())
}

// TestDemotedFromOnDemoteAndAfterClose: OnDemote may call Demoted at once,
// and Demoted still frees a slot after Close.
func TestDemotedFromOnDemoteAndAfterClose(t *testing.T) {
	c, d := newDemoteCache(t, 2, Config{LowWatermark: 1})
	d.onEvery = func(s Slot, _ Key) { require.NoError(t, c.Demoted([]Slot{s})) }
	ks, ids := keysN(0, 3)
	store(t, c, ks[:2], ids[:2])
	require.Len(t, d.handed, 1)
	st := c.Stats()
	require.Zero(t, st.Demoting)
	require.Equal(t, 1, st.Free)

	d.onEvery = nil
	store(t, c, ks[2:], ids[2:])
	require.Len(t, d.handed, 2)
	require.Equal(t, 1, c.Stats().Demoting)
	c.Close()
	require.NoError(t, c.Demoted([]Slot{d.handed[1].slot}))
	st = c.Stats()
	require.Zero(t, st.Demoting)
	require.Equal(t, 1, st.Free)
	require.NoError(t, c.Verify())
}
