package kvcache

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// EndReads gives back a slot's many leases and loads in one step, refuses
// more than are held and a slot given twice (changing nothing), and frees
// a deleted block once its last read ends.
func TestEndReads(t *testing.T) {
	c := newCache(t, 2, Config{})
	ks, ids := keysN(0, 2)
	res := store(t, c, ks, ids)
	a, b := res[0].Slot, res[1].Slot
	for range 1000 {
		_, _ = c.LookupLease(ks, nil)
	}
	lr, err := c.BeginLoad(ks[:1], ids[:1], nil)
	require.NoError(t, err)
	require.True(t, lr[0].Found)
	require.ErrorIs(t, c.EndReads([]Reads{{Slot: a, Leases: 1002}}), errStaleSlot, "more reads than held")
	require.ErrorIs(t, c.EndReads([]Reads{{Slot: a, Leases: 1}, {Slot: a, Leases: 1}}), errStaleSlot, "a slot twice")
	require.ErrorIs(t, c.EndReads([]Reads{{Slot: b, Loads: 1}}), errStaleSlot, "a load never begun")
	require.Equal(t, 2, c.Stats().Leased, "the refusals changed nothing")
	require.Equal(t, 1, c.Delete(ks[:1]))
	require.NoError(t, c.EndReads([]Reads{{Slot: a, Leases: 1000, Loads: 1}, {Slot: b, Leases: 1000}}))
	st := c.Stats()
	require.Equal(t, 0, st.Leased)
	require.Equal(t, 1, st.Ready)
	require.Equal(t, 1, st.Free, "the deleted block's slot freed with its last read")
	require.NoError(t, c.Verify())
}

// A block with MaxReaders readers is not leased again: its count cannot
// overflow.
func TestMaxReaders(t *testing.T) {
	c := newCache(t, 1, Config{})
	ks, ids := keysN(0, 1)
	res := store(t, c, ks, ids)
	c.mu.Lock()
	s := &c.slots[res[0].Slot.ID]
	s.readers = maxReaders
	c.setState(s, stateLeased)
	c.mu.Unlock()
	n, _ := c.LookupLease(ks, nil)
	require.Equal(t, 0, n, "a lease past MaxReaders")
	require.Equal(t, 1, c.Lookup(ks), "still found without a lease")
	lr, err := c.BeginLoad(ks, ids, nil)
	require.NoError(t, err)
	require.False(t, lr[0].Found)
	require.Equal(t, []bool{false}, c.LeaseHandles([]Slot{res[0].Slot}, nil))
	require.NoError(t, c.EndReads([]Reads{{Slot: res[0].Slot, Leases: maxReaders}}))
	n, _ = c.LookupLease(ks, nil)
	require.Equal(t, 1, n)
}
