package kvcache

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// tiny is a 2-layer geometry with 64-byte segments: 256-byte slots.
var tiny = Geometry{Layers: 2, KVHeads: 1, HeadDim: 8, DTypeBytes: 2, TokensPerBlock: 4}

func tinyLayout(t testing.TB, blocks int) *Layout {
	l, err := NewLayout(denseSpec(LayerSeparate, tiny, blocks, 1<<30))
	require.NoError(t, err)
	return l
}

func newCache(t testing.TB, slots int, cfg Config) *Cache {
	if cfg.Layout == nil {
		cfg.Layout = tinyLayout(t, 1024)
	}
	if cfg.SlotAlign == 0 {
		cfg.SlotAlign = 256
	}
	c, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	if slots > 0 {
		n, err := c.AddRegion(Region{ID: 1, Base: 0x10000, Size: uint64(slots) * 256})
		require.NoError(t, err)
		require.Equal(t, slots, n)
	}
	return c
}

func key(i int) Key { return Key{byte(i), byte(i >> 8), byte(i >> 16), 0xAB} }

func keysN(from, n int) ([]Key, []int) {
	ks := make([]Key, n)
	ids := make([]int, n)
	for i := range ks {
		ks[i], ids[i] = key(from+i), from+i
	}
	return ks, ids
}

func store(t testing.TB, c *Cache, ks []Key, ids []int) []StoreResult {
	res, err := c.BeginStore(StoreRequest{Keys: ks, BlockIDs: ids}, nil)
	require.NoError(t, err)
	var slots []Slot
	for _, r := range res {
		if r.Outcome == StoreWrite {
			slots = append(slots, r.Slot)
		}
	}
	require.NoError(t, c.CompleteStore(slots, nil))
	return res
}

func TestCarve(t *testing.T) {
	cases := []struct {
		name       string
		r          Region
		slot, algn uint64
		want       []uint64
		err        string
	}{
		{"exact", Region{Size: 1024}, 256, 256, []uint64{0, 256, 512, 768}, ""},
		{"padded slots", Region{Size: 1024}, 200, 256, []uint64{0, 256, 512, 768}, ""},
		{"tail too short", Region{Size: 1000}, 256, 256, []uint64{0, 256, 512}, ""},
		{"unaligned base", Region{Base: 0x1010, Size: 1024}, 256, 256, []uint64{0xf0, 0x1f0, 0x2f0}, ""},
		{"ranges", Region{Size: 1024, RangeStarts: []uint64{384}}, 256, 128, []uint64{0, 384, 640}, ""},
		{"range too small for any slot", Region{ID: 7, Size: 512, RangeStarts: []uint64{200}}, 256, 16, []uint64{208}, ""},
		{"no slot fits", Region{ID: 7, Size: 512, RangeStarts: []uint64{255}}, 300, 16, nil, "no slot of 300 bytes (aligned to 16) fits in its largest registration range of 257 bytes"},
		{"zero size", Region{ID: 3}, 256, 256, nil, "region 3 has size 0"},
		{"bad range order", Region{ID: 3, Size: 1024, RangeStarts: []uint64{512, 256}}, 256, 256, nil, "range start 256 (index 1) must be ascending"},
		{"range outside", Region{ID: 3, Size: 1024, RangeStarts: []uint64{1024}}, 256, 256, nil, "range start 1024"},
		{"address overflow", Region{ID: 3, Base: ^uintptr(0) - 10, Size: 1024}, 256, 256, nil, "overflows"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			offs, err := carve(tc.r, tc.slot, tc.algn)
			if tc.err != "" {
				require.ErrorIs(t, err, errRegion)
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, offs)
			checkCarving(t, tc.r, offs, tc.slot, tc.algn)
		})
	}
}

// checkCarving: aligned, inside the region, no overlap, no slot across a range.
func checkCarving(t *testing.T, r Region, offs []uint64, slot, align uint64) {
	bounds := append([]uint64{0}, r.RangeStarts...)
	bounds = append(bounds, r.Size)
	for i, o := range offs {
		require.Zero(t, (uint64(r.Base)+o)%align, "slot %d misaligned", i)
		require.LessOrEqual(t, o+slot, r.Size)
		if i > 0 {
			require.GreaterOrEqual(t, o, offs[i-1]+slot)
		}
		for j := 1; j+1 < len(bounds); j++ {
			b := bounds[j]
			require.False(t, o < b && o+slot > b, "slot at %d..%d crosses range start %d", o, o+slot, b)
		}
	}
}

// Preset slots in a region registered in 64 GiB-like ranges (scaled down):
// every slot aligned to 4 KiB and inside one range.
func TestCarvePresets(t *testing.T) {
	for name, g := range presets {
		for _, kind := range kindsFor(g) {
			l, err := NewLayout(denseSpec(kind, g, 8, 0))
			require.NoError(t, err)
			r := Region{Base: 0x7f0000000000, Size: 1 << 30, RangeStarts: []uint64{100 << 20, 300<<20 + 4096, 700 << 20}}
			offs, err := carve(r, l.SlotSize(), defaultSlotAlign)
			require.NoError(t, err, name)
			require.NotEmpty(t, offs)
			checkCarving(t, r, offs, l.SlotSize(), defaultSlotAlign)
		}
	}
}

func TestConfigErrors(t *testing.T) {
	l := tinyLayout(t, 4)
	for _, cfg := range []Config{
		{},
		{Layout: l, SlotAlign: 8},
		{Layout: l, SlotAlign: 48},
		{Layout: l, LowWatermark: -1},
		{Layout: l, StoreThreshold: 99},
	} {
		_, err := New(cfg)
		require.ErrorIs(t, err, errConfig)
	}
	_, err := NewTinyLFU(TinyLFUConfig{})
	require.ErrorIs(t, err, errConfig)
}

func TestStoreLookupLoad(t *testing.T) {
	c := newCache(t, 8, Config{})
	ks, ids := keysN(0, 4)
	res, err := c.BeginStore(StoreRequest{Keys: ks, BlockIDs: ids}, nil)
	require.NoError(t, err)
	require.Len(t, res, 4)
	seen := map[uintptr]bool{}
	for i, r := range res {
		require.Equal(t, StoreWrite, r.Outcome)
		require.Equal(t, ids[i], r.BlockID)
		require.Equal(t, RegionID(1), r.Slot.Region)
		require.Equal(t, uintptr(0x10000)+uintptr(r.Slot.Off), r.Slot.Addr)
		require.False(t, seen[r.Slot.Addr])
		seen[r.Slot.Addr] = true
	}
	// Writing blocks are present for stores but invisible to lookups.
	require.Equal(t, 0, c.Lookup(ks))
	again, err := c.BeginStore(StoreRequest{Keys: ks[:1], BlockIDs: ids[:1]}, nil)
	require.NoError(t, err)
	require.Equal(t, StorePresent, again[0].Outcome)

	require.NoError(t, c.CompleteStore([]Slot{res[0].Slot, res[1].Slot, res[3].Slot}, nil))
	require.NoError(t, c.CompleteStore([]Slot{res[2].Slot}, errors.New("copy failed")))
	require.Equal(t, 2, c.Lookup(ks))

	lr, err := c.BeginLoad(ks, []int{10, 11, 12, 13}, nil)
	require.NoError(t, err)
	require.True(t, lr[0].Found)
	require.True(t, lr[1].Found)
	require.False(t, lr[2].Found)
	require.True(t, lr[3].Found) // loads do not need a prefix
	require.Equal(t, res[0].Slot, lr[0].Slot)
	st := c.Stats()
	require.Equal(t, 3, st.Leased)
	require.NoError(t, c.EndLoad([]Slot{lr[0].Slot, lr[1].Slot, lr[3].Slot}))
	require.ErrorIs(t, c.EndLoad([]Slot{lr[0].Slot}), errStaleSlot)

	st = c.Stats()
	require.Equal(t, Stats{
		Regions: 1, Slots: 8, Free: 5, Ready: 3,
		StoreKeys: 5, StoreAllocated: 4, StorePresent: 1, Stored: 3, StoreFailed: 1,
		LookupKeys: 8, LookupHits: 2, LookupMisses: 6, LoadKeys: 4, Loaded: 3, LoadMissing: 1,
		Orphaned: 1, // ks[3], whose parent's copy failed
	}, st)
	require.NoError(t, c.Verify())
}

func TestBadInputLeavesNoState(t *testing.T) {
	c := newCache(t, 8, Config{Layout: tinyLayout(t, 16)})
	ks, ids := keysN(0, 3)
	store(t, c, ks[:1], ids[:1])
	before := c.Stats()
	dup := []Key{key(5), key(6), key(5)}
	cases := []struct {
		name string
		call func() error
		err  error
		msg  string
	}{
		{"store length", func() error { _, err := c.BeginStore(StoreRequest{Keys: ks, BlockIDs: ids[:2]}, nil); return err }, errLengthMismatch, "3 keys, 2 block ids"},
		{"store dup", func() error {
			_, err := c.BeginStore(StoreRequest{Keys: dup, BlockIDs: []int{1, 2, 3}}, nil)
			return err
		}, errDuplicate, "at index 2"},
		{"store block id", func() error {
			_, err := c.BeginStore(StoreRequest{Keys: ks, BlockIDs: []int{1, 16, 2}}, nil)
			return err
		}, errBlockID, "block id 16, layout has 16 blocks"},
		{"store negative id", func() error {
			_, err := c.BeginStore(StoreRequest{Keys: ks, BlockIDs: []int{-1, 2, 3}}, nil)
			return err
		}, errBlockID, "block id -1"},
		{"load length", func() error { _, err := c.BeginLoad(ks, nil, nil); return err }, errLengthMismatch, "3 keys, 0 block ids"},
		{"load dup key", func() error { _, err := c.BeginLoad(dup, []int{1, 2, 3}, nil); return err }, errDuplicate, "key"},
		{"load dup block", func() error { _, err := c.BeginLoad(ks, []int{1, 2, 1}, nil); return err }, errDuplicate, "block id 1 at index 2"},
		{"complete stale", func() error { return c.CompleteStore([]Slot{{ID: 0, Gen: 99}}, nil) }, errStaleSlot, "gen 99"},
		{"complete unknown", func() error { return c.CompleteStore([]Slot{{ID: 1000}}, nil) }, errStaleSlot, "slot 1000"},
		{"unlease none", func() error { return c.Unlease([]Slot{{ID: 7, Gen: 1}}) }, errStaleSlot, ""},
		{"remove unknown region", func() error { _, err := c.RemoveRegion(42); return err }, errUnknownRegion, "region 42"},
		{"add duplicate region", func() error { _, err := c.AddRegion(Region{ID: 1, Size: 4096}); return err }, errRegion, "region id 1 already"},
		{"add region too small", func() error { _, err := c.AddRegion(Region{ID: 2, Size: 255}); return err }, errRegion, "no slot of 256 bytes"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			require.ErrorIs(t, err, tc.err)
			require.ErrorContains(t, err, tc.msg)
			require.Equal(t, before, c.Stats())
			require.NoError(t, c.Verify())
		})
	}
	// A handle completed twice, and given twice in one call.
	res, err := c.BeginStore(StoreRequest{Keys: ks[1:2], BlockIDs: ids[1:2]}, nil)
	require.NoError(t, err)
	s := res[0].Slot
	require.ErrorIs(t, c.CompleteStore([]Slot{s, s}, nil), errDuplicate)
	require.NoError(t, c.CompleteStore([]Slot{s}, nil))
	require.ErrorIs(t, c.CompleteStore([]Slot{s}, nil), errStaleSlot)
	require.NoError(t, c.Verify())
}

func TestPoolFullAndWatermark(t *testing.T) {
	c := newCache(t, 4, Config{})
	ks, ids := keysN(0, 6)
	res, err := c.BeginStore(StoreRequest{Keys: ks, BlockIDs: ids}, nil)
	require.NoError(t, err)
	var outcomes []StoreOutcome
	for _, r := range res {
		outcomes = append(outcomes, r.Outcome)
	}
	// Nothing is ready to evict while all four are writing: refused, never waiting.
	require.Equal(t, []StoreOutcome{StoreWrite, StoreWrite, StoreWrite, StoreWrite, StoreRefusedFull, StoreRefusedFull}, outcomes)
	var slots []Slot
	for _, r := range res[:4] {
		slots = append(slots, r.Slot)
	}
	require.NoError(t, c.CompleteStore(slots, nil))

	// With a watermark of 2, the LRU evicts ahead of demand.
	w := newCache(t, 4, Config{LowWatermark: 2})
	store(t, w, ks[:2], ids[:2])
	store(t, w, ks[2:4], ids[2:4])
	st := w.Stats()
	require.Equal(t, 2, st.Free)
	require.Equal(t, uint64(2), st.Evicted)
	require.Equal(t, 2, w.Lookup(ks[2:4]))
	require.NoError(t, w.Verify())
}

// LeaseHandles leases current handles only, and a block so leased is not
// evicted (a store needing its slot is refused) nor reused after Delete
// until its lease is given back.
func TestLeaseHandles(t *testing.T) {
	c := newCache(t, 2, Config{})
	ks, ids := keysN(0, 2)
	res := store(t, c, ks, ids)
	h := []Slot{res[0].Slot, res[1].Slot}
	// A handle of another generation (a stale one) is not leased.
	stale := h[1]
	stale.Gen++
	ok := c.LeaseHandles([]Slot{h[0], stale}, nil)
	require.Equal(t, []bool{true, false}, ok)
	require.Equal(t, 1, c.Stats().Leased)
	require.NoError(t, c.Verify())
	// The unleased block goes to a new store; the leased one stays.
	r2 := store(t, c, []Key{key(9)}, []int{9})
	require.Equal(t, StoreWrite, r2[0].Outcome)
	require.Equal(t, h[1].ID, r2[0].Slot.ID, "the unleased slot was the victim")
	require.Equal(t, []bool{true}, c.LeaseHandles([]Slot{r2[0].Slot}, nil))
	r3, err := c.BeginStore(StoreRequest{Keys: []Key{key(10)}, BlockIDs: []int{10}}, nil)
	require.NoError(t, err)
	require.Equal(t, StoreRefusedFull, r3[0].Outcome, "leased blocks are no victims")
	require.NoError(t, c.Unlease([]Slot{r2[0].Slot}))
	// Deleted while leased: not freed until Unlease.
	require.Equal(t, 1, c.Delete(ks[:1]))
	require.Equal(t, 0, c.Stats().Free)
	require.Equal(t, []bool{false}, c.LeaseHandles(h[:1], nil), "a deleted block is not leased again")
	require.NoError(t, c.Unlease(h[:1]))
	require.Equal(t, 1, c.Stats().Free)
	require.NoError(t, c.Verify())
	c.Close()
	require.Equal(t, []bool{false}, c.LeaseHandles([]Slot{r2[0].Slot}, nil), "nothing after Close")
}

func TestLeasedEvictionDeferred(t *testing.T) {
	c := newCache(t, 2, Config{})
	ks, ids := keysN(0, 2)
	store(t, c, ks, ids)
	n, leases := c.LookupLease(ks, nil)
	require.Equal(t, 2, n)
	require.Len(t, leases, 2)
	// Both leased: a new store finds no victim and is refused.
	res, err := c.BeginStore(StoreRequest{Keys: []Key{key(9)}, BlockIDs: []int{9}}, nil)
	require.NoError(t, err)
	require.Equal(t, StoreRefusedFull, res[0].Outcome)
	// Delete a leased block: invisible at once, slot freed after the lease.
	require.Equal(t, 1, c.Delete(ks[:1]))
	require.Equal(t, 0, c.Lookup(ks))
	st := c.Stats()
	require.Equal(t, 1, st.Releasing)
	require.Equal(t, 0, st.Free)
	require.NoError(t, c.Unlease(leases))
	st = c.Stats()
	require.Equal(t, 1, st.Free)
	require.Equal(t, 1, st.Ready)
	require.Equal(t, uint64(1), st.Orphaned) // ks[1]'s parent went away
	require.NoError(t, c.Verify())
}

func TestDeleteWhileWriting(t *testing.T) {
	c := newCache(t, 2, Config{})
	ks, ids := keysN(0, 1)
	res, err := c.BeginStore(StoreRequest{Keys: ks, BlockIDs: ids}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, c.Delete(ks))
	// The key may be stored again at once, in another slot.
	again, err := c.BeginStore(StoreRequest{Keys: ks, BlockIDs: ids}, nil)
	require.NoError(t, err)
	require.Equal(t, StoreWrite, again[0].Outcome)
	require.NotEqual(t, res[0].Slot.ID, again[0].Slot.ID)
	// The first slot is not reused before its copy completes.
	full, err := c.BeginStore(StoreRequest{Keys: []Key{key(7)}, BlockIDs: []int{7}}, nil)
	require.NoError(t, err)
	require.Equal(t, StoreRefusedFull, full[0].Outcome)
	require.NoError(t, c.CompleteStore([]Slot{res[0].Slot}, nil))
	require.Equal(t, 1, c.Stats().Free)
	require.Equal(t, 0, c.Lookup(ks))
	require.NoError(t, c.CompleteStore([]Slot{again[0].Slot}, nil))
	require.Equal(t, 1, c.Lookup(ks))
	require.NoError(t, c.Verify())
}

func TestClearNamespace(t *testing.T) {
	c := newCache(t, 8, Config{})
	a, aid := keysN(0, 3)
	b, bid := keysN(10, 3)
	res, err := c.BeginStore(StoreRequest{Namespace: 1, Keys: a, BlockIDs: aid}, nil)
	require.NoError(t, err)
	var slots []Slot
	for _, r := range res {
		slots = append(slots, r.Slot)
	}
	require.NoError(t, c.CompleteStore(slots, nil))
	res, err = c.BeginStore(StoreRequest{Namespace: 2, Keys: b, BlockIDs: bid}, nil)
	require.NoError(t, err)
	require.Equal(t, 3, c.Clear(1))
	require.Equal(t, 0, c.Lookup(a))
	require.Equal(t, 3, c.Clear(2)) // writing blocks too
	for _, r := range res {
		require.NoError(t, c.CompleteStore([]Slot{r.Slot}, nil))
	}
	require.Equal(t, 0, c.Lookup(b))
	require.Equal(t, 8, c.Stats().Free)
	require.NoError(t, c.Verify())
}

func TestTrim(t *testing.T) {
	c := newCache(t, 4, Config{})
	n, err := c.AddRegion(Region{ID: 2, Base: 0x100000, Size: 4 * 256})
	require.NoError(t, err)
	require.Equal(t, 4, n)
	ks, ids := keysN(0, 8)
	res := store(t, c, ks, ids)
	inRegion2 := 0
	for _, r := range res {
		if r.Slot.Region == 2 {
			inRegion2++
		}
	}
	require.Equal(t, 4, inRegion2)
	// Lease one block of region 2 and start a store into region 2.
	var leased []Slot
	for _, r := range res {
		if r.Slot.Region == 2 {
			_, leased = c.LookupLease(ks[:0], nil)
			lr, err := c.BeginLoad([]Key{ks[r.BlockID]}, []int{0}, nil)
			require.NoError(t, err)
			leased = append(leased, lr[0].Slot)
			break
		}
	}
	done, err := c.RemoveRegion(2)
	require.NoError(t, err)
	require.False(t, done)
	_, err = c.RemoveRegion(2)
	require.ErrorIs(t, err, errUnknownRegion)
	st := c.Stats()
	require.Equal(t, 4, st.Slots)
	require.Equal(t, uint64(4), st.Trimmed)
	require.Equal(t, 1, st.Releasing)
	require.Empty(t, c.TakeReleasable(nil))
	require.NoError(t, c.Verify())
	require.NoError(t, c.EndLoad(leased))
	require.Equal(t, []RegionID{2}, c.TakeReleasable(nil))
	require.Empty(t, c.TakeReleasable(nil))
	require.Equal(t, 1, c.Stats().Regions)
	// New regions reuse the retired slot ids; stale handles stay stale.
	_, err = c.AddRegion(Region{ID: 2, Base: 0x200000, Size: 2 * 256})
	require.NoError(t, err)
	require.ErrorIs(t, c.Unlease(leased), errStaleSlot)
	require.NoError(t, c.Verify())
}

func TestTinyLFUNoLeak(t *testing.T) {
	p, err := NewTinyLFU(TinyLFUConfig{MaxBlocks: 64})
	require.NoError(t, err)
	c := newCache(t, 64, Config{Policy: p, LowWatermark: 8})
	for i := 0; i < 200; i++ {
		ks, ids := keysN(i*4, 4)
		c.Lookup(ks)
		store(t, c, ks, ids)
		if i%16 == 0 {
			c.syncPolicy()
		}
	}
	c.syncPolicy()
	st := c.Stats()
	require.GreaterOrEqual(t, st.Free, 8)
	require.Equal(t, st.Stored, st.Evicted+st.Rejected+uint64(st.Ready))
	require.NoError(t, c.Verify())
	c.Close()
	c.Close()
	_, err = c.BeginStore(StoreRequest{}, nil)
	require.ErrorIs(t, err, errClosed)
}

func ExampleCache() {
	layout, _ := NewLayout(denseSpec(LayerSeparate, llama3_8B, 1024, 0x7f0000000000))
	c, _ := New(Config{Layout: layout, LowWatermark: 1})
	defer c.Close()
	n, _ := c.AddRegion(Region{ID: 1, Base: 0x10000000, Size: 8 << 20})
	keys, _ := ChainKeys([]byte("llama3-8b"), Key{}, make([]uint32, 40), 16)
	res, _ := c.BeginStore(StoreRequest{Keys: keys, BlockIDs: []int{7, 8}}, nil)
	segs, _ := layout.Segments(res[0].BlockID, nil)
	// ... copy segs to res[i].Slot.Addr + seg.Off, wait for the events ...
	_ = c.CompleteStore([]Slot{res[0].Slot, res[1].Slot}, nil)
	fmt.Println(n, "slots;", len(keys), "keys;", len(segs), "segments of", layout.SlotSize()>>20, "MiB;", c.Lookup(keys), "ready")
	// Output: 4 slots; 2 keys; 64 segments of 2 MiB; 2 ready
}

// TestUnleaseCountsHandlesPerCall: a release names a slot as many times
// as it may (one per lease); once more is errStaleSlot and changes nothing;
// the count starts again at every call, also across the wrap of the stamp
// that keeps it.
func TestUnleaseCountsHandlesPerCall(t *testing.T) {
	c := newCache(t, 8, Config{})
	ks, ids := keysN(0, 2)
	store(t, c, ks, ids)
	for _, epoch := range []uint32{0, ^uint32(0) - 1} {
		c.mu.Lock()
		c.dupEpoch = epoch
		c.mu.Unlock()
		_, a := c.LookupLease(ks, nil)
		_, b := c.LookupLease(ks[:1], nil)
		require.Len(t, a, 2)
		// ks[0] twice (two leases) and ks[1] twice (one lease): refused whole.
		err := c.Unlease([]Slot{a[0], b[0], a[1], a[1]})
		require.ErrorIs(t, err, errStaleSlot)
		require.ErrorContains(t, err, "released 2 times, it holds 1 leases")
		require.Equal(t, 2, c.Stats().Leased)
		require.NoError(t, c.Unlease([]Slot{a[0], b[0], a[1]})) // both leases of ks[0]
		require.Zero(t, c.Stats().Leased)
		// One lease each, released in two calls: each call counts afresh.
		_, a = c.LookupLease(ks[:1], nil)
		_, b = c.LookupLease(ks[:1], nil)
		require.NoError(t, c.Unlease(a))
		require.NoError(t, c.Unlease(b))
		require.ErrorIs(t, c.Unlease(b), errStaleSlot)
		require.NoError(t, c.Verify())
	}
	require.NotZero(t, c.dupEpoch, "the stamp skips 0 when it wraps")
	// A mark left from long ago equal to the stamp after a wrap: cleared.
	_, a := c.LookupLease(ks[:1], nil)
	c.mu.Lock()
	c.slots[a[0].ID].dupMark, c.slots[a[0].ID].dupN = 1, 5
	c.dupEpoch = ^uint32(0)
	c.mu.Unlock()
	require.NoError(t, c.Unlease(a))
}

// lruOrder is the LRU's list, most recent first.
func lruOrder(c *Cache) []int32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []int32
	for i := c.lru.head; i >= 0; i = c.lru.nodes[i].next {
		out = append(out, i)
	}
	return out
}

// TestLookupLeaseDeferred: LookupLeaseDeferred leases and answers as
// LookupLease does but leaves the LRU as it was; Accessed with its handles
// then puts the LRU where LookupLease would have, and skips handles whose
// blocks are gone.
func TestLookupLeaseDeferred(t *testing.T) {
	now, later := newCache(t, 16, Config{}), newCache(t, 16, Config{})
	ks, ids := keysN(0, 10)
	for _, c := range []*Cache{now, later} {
		store(t, c, ks[:5], ids[:5])
		store(t, c, ks[5:], ids[5:])
	}
	before := lruOrder(later)
	n1, a := now.LookupLease(ks[:7], nil)
	n2, b := later.LookupLeaseDeferred(ks[:7], nil)
	require.Equal(t, n1, n2)
	require.Equal(t, a, b, "the same leases and handles")
	require.Equal(t, now.Stats().Leased, later.Stats().Leased)
	require.Equal(t, before, lruOrder(later), "no move before Accessed")
	require.NotEqual(t, lruOrder(now), lruOrder(later))
	later.Accessed(b)
	require.Equal(t, lruOrder(now), lruOrder(later))

	// A handle of a block deleted meanwhile is skipped.
	_, b = later.LookupLeaseDeferred(ks[8:9], nil)
	require.NoError(t, later.Unlease(b))
	later.Delete(ks[8:9])
	order := lruOrder(later)
	later.Accessed(b)
	require.Equal(t, order, lruOrder(later))
	require.NoError(t, later.Verify())
}

// TestLeaseAll: every visible block is leased and listed with its key, the
// LRU and the lookup counters untouched; a block being written is not;
// Unlease gives them all back.
func TestLeaseAll(t *testing.T) {
	c := newCache(t, 16, Config{})
	ks, ids := keysN(0, 6)
	store(t, c, ks, ids)
	writing, err := c.BeginStore(StoreRequest{Keys: []Key{key(100)}, BlockIDs: []int{100}}, nil)
	require.NoError(t, err)
	require.Equal(t, StoreWrite, writing[0].Outcome)
	order, lookups := lruOrder(c), c.Stats().LookupKeys
	slots, keys := c.LeaseAll(nil, nil)
	require.Len(t, slots, 6, "the block being written is not listed")
	require.ElementsMatch(t, ks, keys)
	require.Equal(t, 6, c.Stats().Leased)
	require.Equal(t, order, lruOrder(c), "the LRU as it was")
	require.Equal(t, lookups, c.Stats().LookupKeys, "no lookup counted")
	for i, s := range slots {
		_, again := c.LookupLease(keys[i:i+1], nil)
		require.Equal(t, s, again[0], "handle %d is the block's", i)
		require.NoError(t, c.Unlease(again))
	}
	require.NoError(t, c.Unlease(slots))
	require.Zero(t, c.Stats().Leased)
	require.NoError(t, c.CompleteStore([]Slot{writing[0].Slot}, nil))
	slots, _ = c.LeaseAll(nil, nil)
	require.Len(t, slots, 7)
	require.NoError(t, c.Unlease(slots))
	require.NoError(t, c.Verify())

	// Most recently used first: the blocks touched last lead, in the
	// order of their last use.
	_, hit := c.LookupLease([]Key{ks[2]}, nil)
	require.NoError(t, c.Unlease(hit))
	_, hit = c.LookupLease([]Key{ks[4]}, nil)
	require.NoError(t, c.Unlease(hit))
	slots, keys = c.LeaseAll(nil, nil)
	require.Len(t, slots, 7)
	require.Equal(t, []Key{ks[4], ks[2]}, keys[:2], "the last used first")
	want := lruOrder(c)
	got := make([]int32, len(slots))
	for i, s := range slots {
		got[i] = int32(s.ID)
	}
	require.Equal(t, want, got, "the LRU's order, most recent first")
	require.NoError(t, c.Unlease(slots))
	require.NoError(t, c.Verify())
}
