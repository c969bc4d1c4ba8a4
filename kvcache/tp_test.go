package kvcache

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fakeClock is a Config.Clock the test moves by hand.
type fakeClock struct{ t time.Time }

func (f *fakeClock) now() time.Time          { return f.t }
func (f *fakeClock) advance(d time.Duration) { f.t = f.t.Add(d) }

// hostPool is host memory for a cache whose region starts at base: slot
// addresses map to offsets of mem.
type hostPool struct {
	base uintptr
	mem  []byte
}

func (p *hostPool) slot(s Slot, size uint64) []byte {
	return p.mem[uint64(s.Addr-p.base):][:size]
}

// tpCache is a cache for the tpGeo model (4 KV heads) with slots for n
// blocks and a fake clock; timeout 0 takes the default.
func tpCache(t *testing.T, n int, timeout time.Duration) (*Cache, *hostPool, *fakeClock) {
	t.Helper()
	l, err := NewLayout(DenseRankSpec(LayerSeparate, tpGeo, TokenMajor, HeadRange{}, 16, devBase))
	require.NoError(t, err)
	clk := &fakeClock{t: time.Unix(1000, 0)}
	c, err := New(Config{Layout: l, SlotAlign: 64, PartialTimeout: timeout, Clock: clk.now})
	require.NoError(t, err)
	t.Cleanup(c.Close)
	pool := &hostPool{base: 1 << 32, mem: make([]byte, uint64(n)*l.SlotSize())}
	_, err = c.AddRegion(Region{ID: 1, Base: pool.base, Size: uint64(len(pool.mem))})
	require.NoError(t, err)
	return c, pool, clk
}

// storeRank stores blocks (keys[b] at GPU block ids[b]) from the device of
// rank r of tp in order, completing each write with err; it returns the
// outcomes.
func storeRank(t *testing.T, c *Cache, pool *hostPool, d *devTensor, keys []Key, ids []int, complete bool, err error) []StoreResult {
	t.Helper()
	res, e := c.BeginStore(StoreRequest{Keys: keys, BlockIDs: ids, Heads: d.l.Heads()}, nil)
	require.NoError(t, e)
	var done []Slot
	for _, r := range res {
		if r.Outcome != StoreWrite {
			continue
		}
		require.Equal(t, d.l.Heads(), r.Heads)
		segs, e := d.l.segmentsOfRange(r.BlockID, r.Heads, nil)
		require.NoError(t, e)
		d.copySegs(t, segs, pool.slot(r.Slot, d.l.SlotSize()), true)
		done = append(done, r.Slot)
	}
	if complete && len(done) > 0 {
		require.NoError(t, c.CompleteStore(done, err))
	}
	return res
}

// loadRank loads keys into a poisoned device of rank r of tp (order
// order) and checks it byte for byte; it fails if a key is missing.
func loadRank(t *testing.T, c *Cache, pool *hostPool, order HeadOrder, tp, r int, keys []Key, ids []int) {
	t.Helper()
	d := newDevTensor(t, LayerSeparate, tpGeo, order, rankHeads(tpGeo.KVHeads, tp, r), 16)
	for i := range d.mem {
		d.mem[i] = 0x5A
	}
	res, err := c.BeginLoad(keys, ids, nil)
	require.NoError(t, err)
	var slots []Slot
	for _, lr := range res {
		require.True(t, lr.Found, "block %d missing", lr.BlockID)
		segs, err := d.l.Segments(lr.BlockID, nil)
		require.NoError(t, err)
		d.copySegs(t, segs, pool.slot(lr.Slot, d.l.SlotSize()), false)
		slots = append(slots, lr.Slot)
	}
	require.NoError(t, c.EndLoad(slots))
	// Only the loaded blocks hold the KV; compare those.
	want := newDevTensor(t, LayerSeparate, tpGeo, order, d.l.Heads(), 16)
	want.fill()
	for _, id := range ids {
		for i := 0; i < tpGeo.Layers; i++ {
			for kv := 0; kv < 2; kv++ {
				for tok := 0; tok < tpGeo.TokensPerBlock; tok++ {
					for lh := 0; lh < d.l.Heads().Count; lh++ {
						for e := 0; e < tpGeo.HeadDim*tpGeo.DTypeBytes; e++ {
							at := d.at(id, i, kv, tok, lh, e)
							require.Equal(t, want.mem[at], d.mem[at], "tp %d rank %d %v: block %d layer %d kv %d token %d head %d byte %d",
								tp, r, order, id, i, kv, tok, d.l.Heads().First+lh, e)
						}
					}
				}
			}
		}
	}
}

func tpKeys(n, salt int) ([]Key, []int) {
	var ks []Key
	var ids []int
	for i := 0; i < n; i++ {
		ks = append(ks, Key{byte(i), byte(salt), 0x7F})
		ids = append(ids, (i*5+salt)%16)
	}
	return ks, ids
}

// TestTPSizeSharing: the two ranks of TP=2 store a chain of blocks (their
// heads each) into shared slots; the blocks are visible only once both
// completed; then TP=1, TP=2 and TP=4 ranks, token-major and head-major,
// load them byte for byte against the same KV laid out for their TP size.
func TestTPSizeSharing(t *testing.T) {
	for _, storeOrder := range []HeadOrder{TokenMajor, HeadMajor} {
		t.Run(storeOrder.String(), func(t *testing.T) {
			c, pool, _ := tpCache(t, 8, 0)
			keys, ids := tpKeys(4, 1)
			ranks := make([]*devTensor, 2)
			for r := range ranks {
				ranks[r] = newDevTensor(t, LayerSeparate, tpGeo, storeOrder, rankHeads(tpGeo.KVHeads, 2, r), 16)
				ranks[r].fill()
			}
			res0 := storeRank(t, c, pool, ranks[0], keys, ids, false, nil)
			for _, r := range res0 {
				require.Equal(t, StoreWrite, r.Outcome)
			}
			require.Zero(t, c.Lookup(keys), "blocks visible before any head is committed")
			res1 := storeRank(t, c, pool, ranks[1], keys, ids, false, nil)
			for j, r := range res1 {
				require.Equal(t, StoreWrite, r.Outcome, "the second rank's store is a write")
				require.Equal(t, res0[j].Slot.ID, r.Slot.ID, "the ranks share one slot")
				require.Equal(t, res0[j].Slot.Gen, r.Slot.Gen)
			}
			st := c.Stats()
			require.Equal(t, uint64(4), st.StoreJoined)
			require.Equal(t, 4, st.Partial)
			require.Equal(t, 8, st.StoresInFlight)
			// A whole-block store and a replica of rank 0's heads are present.
			whole, err := c.BeginStore(StoreRequest{Keys: keys, BlockIDs: ids}, nil)
			require.NoError(t, err)
			again, err := c.BeginStore(StoreRequest{Keys: keys, BlockIDs: ids, Heads: HeadRange{0, 1}}, nil)
			require.NoError(t, err)
			for j := range keys {
				require.Equal(t, StorePresent, whole[j].Outcome)
				require.Equal(t, StorePresent, again[j].Outcome)
			}
			var h0, h1 []Slot
			for j := range keys {
				h0, h1 = append(h0, res0[j].Slot), append(h1, res1[j].Slot)
			}
			ready, err := c.CompleteStoreReady(h1, nil, nil)
			require.NoError(t, err)
			require.Empty(t, ready, "rank 1's heads alone complete no block")
			require.Zero(t, c.Lookup(keys), "blocks visible with rank 0's heads missing")
			lr, err := c.BeginLoad(keys, ids, nil)
			require.NoError(t, err)
			for _, r := range lr {
				require.False(t, r.Found)
			}
			ready, err = c.CompleteStoreReady(h0, nil, nil)
			require.NoError(t, err)
			require.Equal(t, h0, ready, "rank 0's heads complete every block")
			require.Equal(t, len(keys), c.Lookup(keys))
			require.Zero(t, c.Stats().Partial)
			for b, r := range res0 {
				require.Equal(t, headMajorSlot(ranks[0].l, ids[b], 0), pool.slot(r.Slot, ranks[0].l.SlotSize()), "slot of block %d", ids[b])
			}
			for _, order := range []HeadOrder{TokenMajor, HeadMajor} {
				for _, tp := range []int{1, 2, 4} {
					for r := 0; r < tp; r++ {
						loadRank(t, c, pool, order, tp, r, keys, ids)
					}
				}
			}
			require.NoError(t, c.Verify())
		})
	}
}

// A block one rank never stores is never loaded, and is reclaimed after the
// timeout; a rank that dies with its copy in flight releases the slot when
// the copy ends.
func TestTPRankDeath(t *testing.T) {
	const timeout = 5 * time.Second
	c, pool, clk := tpCache(t, 4, timeout)
	keys, ids := tpKeys(2, 2)
	r0 := newDevTensor(t, LayerSeparate, tpGeo, TokenMajor, HeadRange{0, 2}, 16)
	r0.fill()
	storeRank(t, c, pool, r0, keys, ids, true, nil)
	require.Zero(t, c.Lookup(keys))
	clk.advance(timeout - time.Millisecond)
	c.maintainIdle()
	require.Equal(t, 2, c.Stats().Partial, "reclaimed before the timeout")
	lr, err := c.BeginLoad(keys, ids, nil)
	require.NoError(t, err)
	require.False(t, lr[0].Found)
	clk.advance(time.Millisecond)
	c.ExpirePartials()
	st := c.Stats()
	require.Equal(t, uint64(2), st.PartialExpired)
	require.Zero(t, st.Partial)
	require.Equal(t, 4, st.Free)
	// The other rank arriving late starts the block afresh: a new slot, a
	// write of its heads only, still invisible.
	r1 := newDevTensor(t, LayerSeparate, tpGeo, TokenMajor, HeadRange{2, 2}, 16)
	r1.fill()
	res := storeRank(t, c, pool, r1, keys, ids, true, nil)
	require.Equal(t, StoreWrite, res[0].Outcome)
	require.Equal(t, uint64(0), c.Stats().StoreJoined)
	require.Zero(t, c.Lookup(keys))

	// A rank dies with its copy in flight: the block is reclaimed, the slot
	// freed only when the copy is reported done.
	c2, pool2, clk2 := tpCache(t, 2, timeout)
	res, err = c2.BeginStore(StoreRequest{Keys: keys[:1], BlockIDs: ids[:1], Heads: HeadRange{0, 2}}, nil)
	require.NoError(t, err)
	_ = pool2
	clk2.advance(timeout)
	c2.maintainIdle()
	st = c2.Stats()
	require.Equal(t, uint64(1), st.PartialExpired)
	require.Equal(t, 1, st.Releasing)
	require.Equal(t, 1, st.Free)
	// A late rank is a fresh block (the other slot).
	late, err := c2.BeginStore(StoreRequest{Keys: keys[:1], BlockIDs: ids[:1], Heads: HeadRange{2, 2}}, nil)
	require.NoError(t, err)
	require.Equal(t, StoreWrite, late[0].Outcome)
	require.NotEqual(t, res[0].Slot.ID, late[0].Slot.ID)
	require.NoError(t, c2.CompleteStore([]Slot{res[0].Slot}, nil))
	st = c2.Stats()
	require.Zero(t, st.Releasing)
	require.Equal(t, 1, st.Free)
	require.Zero(t, c2.Lookup(keys[:1]))
	require.NoError(t, c2.Verify())
}

// Replicated heads (TP above the KV heads, and MLA's latent) are stored once.
func TestTPReplicatedHeads(t *testing.T) {
	c, pool, _ := tpCache(t, 4, 0)
	keys, ids := tpKeys(1, 3)
	var writes, present int
	for r := 0; r < 8; r++ {
		d := newDevTensor(t, LayerSeparate, tpGeo, TokenMajor, rankHeads(4, 8, r), 16)
		d.fill()
		res := storeRank(t, c, pool, d, keys, ids, true, nil)
		switch res[0].Outcome {
		case StoreWrite:
			writes++
		case StorePresent:
			present++
		default:
			t.Fatalf("rank %d: %v", r, res[0].Outcome)
		}
		require.Equal(t, r >= 6, c.Lookup(keys) == 1, "after rank %d (rank 6 stores the last head, rank 7 its replica)", r)
	}
	require.Equal(t, 4, writes)
	require.Equal(t, 4, present)
	loadRank(t, c, pool, HeadMajor, 1, 0, keys, ids)

	// MLA: every rank holds the whole latent; the first stores it.
	g := Geometry{Layers: 2, KVHeads: 1, HeadDim: 8, DTypeBytes: 2, TokensPerBlock: 4}
	l, err := NewLayout(DenseRankSpec(MLA, g, TokenMajor, HeadRange{}, 4, devBase))
	require.NoError(t, err)
	m := newCache(t, 4, Config{Layout: l})
	for r := 0; r < 4; r++ {
		res, err := m.BeginStore(StoreRequest{Keys: keys, BlockIDs: ids, Heads: HeadRange{0, 1}}, nil)
		require.NoError(t, err)
		if r == 0 {
			require.Equal(t, StoreWrite, res[0].Outcome)
			require.Zero(t, res[0].Slot.Heads, "an MLA store is a whole-block store")
			require.NoError(t, m.CompleteStore([]Slot{res[0].Slot}, nil))
		} else {
			require.Equal(t, StorePresent, res[0].Outcome)
		}
	}
	require.Equal(t, 1, m.Lookup(keys))
}

// A failed range write leaves the range open for a retry; a block with no
// committed head and no write left is dropped.
func TestTPRangeFailure(t *testing.T) {
	c, pool, _ := tpCache(t, 4, 0)
	keys, ids := tpKeys(1, 4)
	r0 := newDevTensor(t, LayerSeparate, tpGeo, TokenMajor, HeadRange{0, 2}, 16)
	r1 := newDevTensor(t, LayerSeparate, tpGeo, TokenMajor, HeadRange{2, 2}, 16)
	r0.fill()
	r1.fill()
	fail := errors.New("copy failed")
	storeRank(t, c, pool, r0, keys, ids, true, fail)
	st := c.Stats()
	require.Zero(t, st.Partial)
	require.Equal(t, 4, st.Free, "a lone failed range drops the block")
	storeRank(t, c, pool, r0, keys, ids, true, nil)
	storeRank(t, c, pool, r1, keys, ids, true, fail)
	require.Equal(t, 1, c.Stats().Partial, "rank 0's heads stay committed")
	require.Zero(t, c.Lookup(keys))
	res := storeRank(t, c, pool, r1, keys, ids, true, nil)
	require.Equal(t, StoreWrite, res[0].Outcome, "the failed range is open again")
	require.Equal(t, 1, c.Lookup(keys))
	loadRank(t, c, pool, TokenMajor, 4, 3, keys, ids)
	st = c.Stats()
	require.Equal(t, uint64(2), st.StoreFailed)
	require.NoError(t, c.Verify())
}

func TestTPRangeErrors(t *testing.T) {
	c, _, _ := tpCache(t, 4, 0)
	keys, ids := tpKeys(2, 5)
	for _, h := range []HeadRange{{0, 5}, {-1, 1}, {4, 1}, {2, -1}} {
		before := c.Stats()
		_, err := c.BeginStore(StoreRequest{Keys: keys, BlockIDs: ids, Heads: h}, nil)
		require.ErrorIs(t, err, errHeadRange, "%v", h)
		require.ErrorContains(t, err, "StoreRequest.Heads")
		require.Equal(t, before, c.Stats())
	}
	a, err := c.BeginStore(StoreRequest{Keys: keys, BlockIDs: ids, Heads: HeadRange{0, 2}}, nil)
	require.NoError(t, err)
	b, err := c.BeginStore(StoreRequest{Keys: keys, BlockIDs: ids, Heads: HeadRange{2, 2}}, nil)
	require.NoError(t, err)
	// A handle with another range, a whole-block handle, a duplicate.
	bad := a[0].Slot
	bad.Heads = HeadRange{1, 1}
	require.ErrorIs(t, c.CompleteStore([]Slot{bad}, nil), errStaleSlot)
	bad.Heads = HeadRange{}
	require.ErrorIs(t, c.CompleteStore([]Slot{bad}, nil), errStaleSlot)
	require.ErrorIs(t, c.CompleteStore([]Slot{a[0].Slot, a[0].Slot}, nil), errDuplicate)
	// Both ranks' handles of a block in one call are fine.
	require.NoError(t, c.CompleteStore([]Slot{a[0].Slot, b[0].Slot, a[1].Slot, b[1].Slot}, nil))
	require.Equal(t, 2, c.Lookup(keys))
	require.ErrorIs(t, c.CompleteStore([]Slot{a[0].Slot}, nil), errStaleSlot)
	_, err = New(Config{Layout: c.layout, PartialTimeout: -1})
	require.ErrorIs(t, err, errConfig)
	require.ErrorContains(t, err, "PartialTimeout -1ns is negative")
}

// Whole-block stores are untouched by head ranges: the same outcomes, the
// same handles (no Heads), the same slot bytes as a layout of undeclared
// order would give.
func TestWholeStoreUnchanged(t *testing.T) {
	c, pool, _ := tpCache(t, 4, 0)
	keys, ids := tpKeys(2, 6)
	d := newDevTensor(t, LayerSeparate, tpGeo, HeadMajor, HeadRange{}, 16)
	d.fill()
	res := storeRank(t, c, pool, d, keys, ids, true, nil)
	for _, r := range res {
		require.Equal(t, StoreWrite, r.Outcome)
		require.Zero(t, r.Slot.Heads)
		require.Equal(t, HeadRange{0, 4}, r.Heads)
	}
	require.Equal(t, 2, c.Lookup(keys))
	u, err := NewLayout(denseSpec(LayerSeparate, tpGeo, 16, devBase))
	require.NoError(t, err)
	for b, r := range res {
		segs, err := u.Segments(ids[b], nil)
		require.NoError(t, err)
		slot := bytes.Repeat([]byte{0}, int(u.SlotSize()))
		d.copySegs(t, segs, slot, true)
		require.Equal(t, slot, pool.slot(r.Slot, u.SlotSize()), fmt.Sprintf("block %d", ids[b]))
	}
}

// CompleteStoreReady names the blocks a call made visible: not one deleted
// while being written, none on a failed copy.
func TestCompleteStoreReady(t *testing.T) {
	c, _, _ := tpCache(t, 4, 0)
	keys, ids := tpKeys(3, 7)
	res, err := c.BeginStore(StoreRequest{Keys: keys, BlockIDs: ids}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, c.Delete(keys[1:2]))
	prev := []Slot{{ID: 99}}
	ready, err := c.CompleteStoreReady([]Slot{res[0].Slot, res[1].Slot}, nil, prev)
	require.NoError(t, err)
	require.Equal(t, []Slot{{ID: 99}, res[0].Slot}, ready)
	ready, err = c.CompleteStoreReady([]Slot{res[2].Slot}, errors.New("copy failed"), nil)
	require.NoError(t, err)
	require.Empty(t, ready)
	got, err := c.CompleteStoreReady([]Slot{res[2].Slot}, nil, prev)
	require.ErrorIs(t, err, errStaleSlot)
	require.Equal(t, prev, got)
}

// The four ranks of TP=4 store the same chains at once, each its heads
// copied into the shared slots, while loaders of TP=1 and TP=2 load what is
// ready and check it byte for byte, until the ranks are done; then every
// block is ready. Run under -race: the slot bytes a rank writes are read
// only after the block is ready.
func TestConcurrentRanks(t *testing.T) {
	c, pool, _ := tpCache(t, 48, 0)
	const rounds = 120
	devs := make([]*devTensor, 4)
	for r := range devs {
		devs[r] = newDevTensor(t, LayerSeparate, tpGeo, TokenMajor, rankHeads(4, 4, r), 16)
		devs[r].fill()
	}
	var wg sync.WaitGroup
	for r := 0; r < 4; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			d := devs[r]
			for i := 0; i < rounds; i++ {
				keys, ids := tpKeys(4, (i*7)%9)
				res, err := c.BeginStore(StoreRequest{Keys: keys, BlockIDs: ids, Heads: d.l.Heads()}, nil)
				if !assertNoErr(t, err) {
					return
				}
				var done []Slot
				for _, x := range res {
					if x.Outcome != StoreWrite {
						continue
					}
					segs, err := d.l.segmentsOfRange(x.BlockID, x.Heads, nil)
					if !assertNoErr(t, err) {
						return
					}
					slot := pool.slot(x.Slot, d.l.SlotSize())
					for _, s := range segs {
						rows, row := max(s.Rows, 1), s.RowLen
						if s.Rows <= 1 {
							row = s.Len
						}
						for q := uint64(0); q < rows; q++ {
							copy(slot[s.Off+q*s.HostPitch:][:row], d.mem[s.Dev-d.base+q*s.DevPitch:][:row])
						}
					}
					done = append(done, x.Slot)
				}
				if !assertNoErr(t, c.CompleteStore(done, nil)) {
					return
				}
			}
		}(r)
	}
	var loads atomic.Int64
	var stop atomic.Bool
	var lg sync.WaitGroup
	for _, tp := range []int{1, 2} {
		lg.Add(1)
		go func(tp int) {
			defer lg.Done()
			for i := 0; !stop.Load(); i++ {
				keys, ids := tpKeys(4, (i*7)%9)
				n := c.Lookup(keys)
				lr, err := c.BeginLoad(keys[:n], ids[:n], nil)
				if !assertNoErr(t, err) {
					return
				}
				var found []Slot
				for _, x := range lr {
					if !x.Found {
						continue
					}
					found = append(found, x.Slot)
					want := headMajorSlot(devs[0].l, x.BlockID, 0)
					got := pool.slot(x.Slot, devs[0].l.SlotSize())
					for _, run := range mustRuns(t, devs[0].l, rankHeads(4, tp, i%tp)) {
						if !bytes.Equal(want[run.Off:run.Off+run.Len], got[run.Off:run.Off+run.Len]) {
							t.Errorf("block %d: heads of TP %d rank %d differ in layer %d (run %+v)", x.BlockID, tp, i%tp, run.Layer, run)
						}
					}
					loads.Add(1)
				}
				if !assertNoErr(t, c.EndLoad(found)) {
					return
				}
			}
		}(tp)
	}
	wg.Wait()
	stop.Store(true)
	lg.Wait()
	require.NoError(t, c.Verify())
	st := c.Stats()
	require.Zero(t, st.StoresInFlight)
	require.Zero(t, st.Partial)
	require.Equal(t, uint64(9*4*3), st.StoreJoined, "every block: one allocation, three joins")
	for salt := 0; salt < 9; salt++ {
		keys, ids := tpKeys(4, salt)
		require.Equal(t, 4, c.Lookup(keys), "salt %d", salt)
		loadRank(t, c, pool, HeadMajor, 2, salt%2, keys, ids)
	}
	t.Logf("loads while storing: %d", loads.Load())
}

func mustRuns(t *testing.T, l *Layout, r HeadRange) []hostRun {
	runs, err := l.hostRuns(r, nil)
	require.NoError(t, err)
	return runs
}
